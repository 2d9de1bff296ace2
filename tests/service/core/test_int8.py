"""Serving the INT8 trunk: `serve`'s own bring-up with the default settings picks the INT8 trunk
calibrated for its checkpoint (the session's one real calibration, tests/support/int8.py) and
says so, with the calibration set and its date, on /readyz and /metrics; `serve` refuses int8
at start, in one line, where it cannot run."""
from __future__ import annotations

import pytest

from bench.prometheus import samples
from tests.backbone.helpers import encode, pattern
from tests.support.int8 import SAMPLES
from tests.support.servers import make_settings, started

pytest.importorskip("nncf")


def _trunk_info(text: str) -> list[dict[str, str]]:
    """The label sets of `multihead_trunk_info` in a /metrics text."""
    return [dict(labels) for name, labels in samples(text) if name == "multihead_trunk_info"]


async def test_serve_by_default_runs_the_int8_trunk_and_shows_its_calibration(
        aiohttp_client, store, tmp_path, int8_calibrated, int8_trunk):
    # No trunk given: the service builds its own from the settings, all trunk choices default.
    settings = make_settings(tmp_path, trunk_checkpoint=int8_calibrated.prefix, device="cpu")
    assert (settings.runtime, settings.precision) == ("auto", "auto")
    client = await started(aiohttp_client, settings, trunk=None, store=store)

    body = await (await client.get("/readyz")).json()
    trunk = body["trunk"]
    assert (trunk["runtime"], trunk["precision"]) == ("openvino", "int8")
    assert trunk["float_precision"] == int8_trunk.float_precision
    calibration = trunk["calibration"]
    assert calibration == int8_trunk.calibration.to_json()
    assert calibration["images"] == SAMPLES and calibration["passed"] is True
    assert calibration["date"] and calibration["description"].startswith(f"{SAMPLES} images")

    (labels,) = _trunk_info(await (await client.get("/metrics")).text())
    assert (labels["runtime"], labels["precision"]) == ("openvino", "int8")
    assert labels["calibration"] == calibration["digest"][:16]
    assert labels["calibration_images"] == str(SAMPLES)
    assert labels["calibration_date"] == calibration["date"]

    resp = await client.post("/classify/alpha", data=encode(pattern(3)),
                             headers={"Content-Type": "image/png"})
    assert resp.status == 200, await resp.text()


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
