"""Serving the INT8 trunk: `serve`'s own bring-up with the default settings judges the INT8
trunk calibrated for its checkpoint (the session's one real calibration, tests/support/int8.py)
for its bots, picks it where its gate passes and says why, with the calibration set and its
date, on /readyz and /metrics; each bot's agreement is in GET /bots/{id} and /metrics (bounded
labels), scored once per version; the next start serves the float trunk once a bot is below
the bound; `serve` refuses int8 at start, in one line, where it cannot run."""
from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from backbone.gate import percent
from bench.prometheus import by_labels, samples
from service.core.metrics import Metrics
from store import HeadStore
from tests.backbone.helpers import encode, pattern
from tests.support.int8 import SAMPLES
from tests.support.servers import make_settings, started

pytest.importorskip("nncf")


def steady_head(n: int = 3):
    """A head that answers class 0 by a margin no INT8 error moves: agreement 100 %."""
    biases = np.zeros(n, np.float32)
    biases[0] = 100.0
    return (np.random.default_rng(n).normal(0, 0.001, (1536, n)).astype(np.float32), biases,
            [f"class-{i}" for i in range(n)])


def tie_head(held_out):
    """A head whose boundary lies halfway between the float and the INT8 features of the
    first held-out image: its answer on that image flips, whatever the CPU (agreement at most
    (N - 1) / N, below 99 % on the session's 8 held-out images)."""
    d = held_out.int8[0] - held_out.fp32[0]  # [1536]
    weights = np.stack([d, np.zeros_like(d)], axis=1).astype(np.float32)  # [1536, 2]
    biases = np.array([-(held_out.fp32[0] @ d + held_out.int8[0] @ d) / 2, 0.0], np.float32)
    return weights, biases, ["int8-side", "float-side"]


def agreements(text: str) -> dict[str, float]:
    """`multihead_bot_int8_agreement` of a /metrics text: bot -> value."""
    return by_labels(text, "multihead_bot_int8_agreement")


def _trunk_info(text: str) -> list[dict[str, str]]:
    """The label sets of `multihead_trunk_info` in a /metrics text."""
    return [dict(labels) for name, labels in samples(text) if name == "multihead_trunk_info"]


async def test_serve_by_default_runs_the_int8_trunk_and_shows_its_calibration(
        aiohttp_client, tmp_path, int8_calibrated, int8_trunk, caplog):
    from backbone import quantize as q
    from service.core.bots import agreement_key

    artifact = q.Int8Artifact.find(int8_calibrated.cache_dir, int8_calibrated.prefix)
    mean = artifact.report().mean_cosine
    store = HeadStore(tmp_path / "store")
    for bot_id in ("alpha", "bravo"):
        store.register(bot_id, *steady_head())
    # No trunk given: the service builds its own from the settings, all trunk choices default.
    settings = make_settings(tmp_path, trunk_checkpoint=int8_calibrated.prefix, device="cpu")
    assert (settings.runtime, settings.precision) == ("auto", "auto")
    with caplog.at_level(logging.INFO, logger="backbone.trunk"):
        client = await started(aiohttp_client, settings, trunk=None, store=store)
    why = (f"int8: gate passed for 2 heads (min agreement 100.00 %, overall 100.00 %, mean "
           f"cosine {mean:.4f})")
    assert f"precision {why}" in [r.getMessage() for r in caplog.records]

    body = await (await client.get("/readyz")).json()
    trunk = body["trunk"]
    assert (trunk["runtime"], trunk["precision"], trunk["why"]) == ("openvino", "int8", why)
    assert trunk["gate"] == {
        "passed": True, "images": 8, "heads": 2, "lowest_head": "alpha", "min_agreement": 1.0,
        "overall_agreement": 1.0, "mean_cosine": mean,
        "min_cosine": artifact.report().min_cosine, "failures": 0,
        "bounds": {"head_agreement": 0.99, "overall_agreement": 0.995, "mean_cosine": 0.999}}
    assert trunk["float_precision"] == int8_trunk.float_precision
    calibration = trunk["calibration"]
    assert calibration == int8_trunk.calibration.to_json()
    assert calibration["images"] == SAMPLES and calibration["passed"] is True
    assert calibration["date"] and calibration["description"].startswith(f"{SAMPLES} images")

    text = await (await client.get("/metrics")).text()
    (labels,) = _trunk_info(text)
    assert (labels["runtime"], labels["precision"]) == ("openvino", "int8")
    assert labels["calibration"] == calibration["digest"][:16]
    assert labels["calibration_images"] == str(SAMPLES)
    assert labels["calibration_date"] == calibration["date"]
    assert agreements(text) == {"alpha": 1.0, "bravo": 1.0}
    assert (await (await client.get("/bots/alpha")).json())["int8_agreement"] == 1.0

    resp = await client.post("/classify/alpha", data=encode(pattern(3)),
                             headers={"Content-Type": "image/png"})
    assert resp.status == 200, await resp.text()

    # A bot registered by another process: scored when first asked for, recorded beside the
    # INT8 trunk, shown in /metrics at once.
    with HeadStore(tmp_path / "store") as other:
        other.register("tie", *tie_head(artifact.held_out()))
        info = other.info("tie")
    for _ in range(100):  # null until the heads lookup's poll (about every second) sees it
        resp = await client.get("/bots/tie")
        if resp.status == 200 and (await resp.json())["int8_agreement"] is not None:
            break
        await asyncio.sleep(0.1)
    tie = (await resp.json())["int8_agreement"]
    assert tie <= 7 / 8, tie
    assert artifact.agreements()[agreement_key("tie", 1, info.created)] == tie
    assert agreements(await (await client.get("/metrics")).text()) == {
        "alpha": 1.0, "bravo": 1.0, "tie": tie}
    await client.close()

    # The next start: `auto` passes over the INT8 trunk, saying which bot failed its gate.
    store.close()
    caplog.clear()
    with HeadStore(tmp_path / "store") as again, caplog.at_level(logging.INFO,
                                                                   logger="backbone.trunk"):
        client = await started(aiohttp_client, settings, trunk=None, store=again)
        trunk = (await (await client.get("/readyz")).json())["trunk"]
        assert trunk["precision"] in ("bf16", "fp32") and "calibration" not in trunk
        assert trunk["why"].startswith(f"{trunk['precision']}: the INT8 trunk's gate fails for "
                                       f"head 'tie' (agreement {percent(tie)} < 99 %)")
        assert f"precision {trunk['why']}" in [r.getMessage() for r in caplog.records]
        assert (trunk["gate"]["passed"], trunk["gate"]["lowest_head"]) == (False, "tie")
        assert (await (await client.get("/bots/tie")).json())["int8_agreement"] == tie
        await client.close()


async def test_a_float_trunk_shows_no_calibration(shared_client):
    body = await (await shared_client.get("/readyz")).json()
    assert body["trunk"]["precision"] == "fp32"
    assert "calibration" not in body["trunk"] and "float_precision" not in body["trunk"]
    async with shared_client.get("/metrics") as resp:
        (labels,) = _trunk_info(await resp.text())
    assert labels["precision"] == "fp32"
    assert (labels["calibration"], labels["calibration_images"],
            labels["calibration_date"]) == ("", "", "")


@pytest.mark.parametrize("flags, says", [
    (["--precision", "int8"], "`multihead quantize --images DIR`"),
    (["--precision", "int8", "--runtime", "tf"], "'int8' runs on OpenVINO"),
])
def test_serve_refuses_int8_at_start_in_one_line(trunk_checkpoint, tmp_path, capsys, monkeypatch,
                                                 flags, says):
    import service.transports.http.app
    from cli.main import main

    served = []
    monkeypatch.setattr(service.transports.http.app, "run_app",
                        lambda settings, listeners=(): served.append(settings))  # never block
    # The session's checkpoint: no INT8 trunk was ever calibrated next to it.
    code = main(["serve", "--store", str(tmp_path / "store"), "--trunk-checkpoint",
                 trunk_checkpoint, "--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert code == 2 and not served
    assert err.count("\n") == 1 and err.startswith("multihead serve: error: ") and says in err


# -- the agreement gauge: bounded labels ---------------------------------------------------------

def test_the_agreement_gauge_labels_the_busiest_bots_then_the_lowest_then_other():
    metrics = Metrics(top_bots=3)
    for _ in range(3):
        metrics.observe_bot("busy")
    values = {"busy": 1.0, "a": 0.95, "b": 0.99, "c": 0.97, "d": 1.0, "other": 0.5}
    metrics.bind_int8_agreement(lambda: values)
    assert agreements(metrics.render()[0].decode()) == {
        "busy": 1.0, "a": 0.95, "c": 0.97, "other": 0.5}  # other: the lowest of b, d, "other"
    values.pop("other")
    assert agreements(metrics.render()[0].decode()) == {"busy": 1.0, "a": 0.95, "c": 0.97,
                                                        "other": 0.99}
    values.pop("b")
    values.pop("d")  # removed bots: no stale series
    assert agreements(metrics.render()[0].decode()) == {"busy": 1.0, "a": 0.95, "c": 0.97}
    none = Metrics(top_bots=0)
    none.bind_int8_agreement(lambda: {"a": 0.9, "b": 1.0})
    assert agreements(none.render()[0].decode()) == {"other": 0.9}
    assert agreements(Metrics().render()[0].decode()) == {}  # no INT8 trunk: no series


# -- each bot scored once per version --------------------------------------------------------------

class Artifact:
    """An INT8 trunk's held-out features and recorded agreements, in memory."""

    key = "test"

    def __init__(self, recorded=None):
        from tests.support.int8 import held_out_features

        self.features = held_out_features(8)
        self.recorded = dict(recorded or {})

    def held_out(self):
        return self.features

    def agreements(self):
        return dict(self.recorded)

    def record_agreements(self, values):
        self.recorded.update(values)


def test_each_bot_version_is_scored_once_and_recorded(tmp_path, monkeypatch):
    from service.core.bots import Int8Agreement, agreement_key

    store = HeadStore(tmp_path / "store")
    store.register("a", *steady_head())
    store.register("b", *steady_head(2))
    loads = []
    real_get = store.get
    monkeypatch.setattr(store, "get", lambda bot_id: loads.append(bot_id) or real_get(bot_id))
    int8 = Int8Agreement(store)
    assert int8.of(store.info("a")) is None and int8.judge(Artifact()) == {"a": 1.0, "b": 1.0}
    artifact = int8.artifact
    assert sorted(loads) == ["a", "b"]
    assert artifact.recorded == {agreement_key(i.bot_id, i.version, i.created): 1.0
                                 for i in store.list()}
    assert int8.refresh() == {"a": 1.0, "b": 1.0} and int8.of(store.info("a")) == 1.0
    assert sorted(loads) == ["a", "b"]  # nothing loaded twice
    store.register("a", *tie_head(artifact.features))  # a new version: scored again
    assert int8.of(store.info("a")) <= 7 / 8 and sorted(loads) == ["a", "a", "b"]
    assert int8.current()["a"] <= 7 / 8
    # A restart reads what was recorded: no head is loaded for it.
    loads.clear()
    again = Int8Agreement(store)
    assert again.judge(Artifact(artifact.recorded)) == int8.refresh() and loads == []
    store.remove("b")
    assert set(again.refresh()) == {"a"}
    store.close()
