"""The out-of-the-box path on a temporary store: demo set-up, then the README tour's steps
(classify over HTTP, train a new bot from a folder, import a slim checkpoint's classifier)."""
from __future__ import annotations

import asyncio
import hashlib
import io
import logging

import numpy as np
import pytest

from cli.demo_setup import ensure_demo
from cli.main import main
from heads.demo_images import KINDS, demo_image
from service.core.settings import Settings
from service.transports.http.app import SERVICE, create_app
from store import HeadStore

pytestmark = pytest.mark.timeout(600)


def _png(kind, label, index, seed):
    buffer = io.BytesIO()
    demo_image(kind, label, index, seed).save(buffer, "PNG")
    return buffer.getvalue()


class RememberingTrunk:
    """The session's trunk, remembering the features of every image it has run: the tour's
    `multihead train` reads the demo's own training images again (about a quarter of a second
    each through the trunk on 2 cores); their features are the trunk's all the same."""

    def __init__(self, trunk) -> None:
        self._trunk = trunk
        self._seen: dict[bytes, np.ndarray] = {}
        self.checkpoint_prefix = trunk.checkpoint_prefix

    def features(self, images: np.ndarray) -> np.ndarray:
        keys = [hashlib.sha256(np.ascontiguousarray(image).tobytes()).digest() for image in images]
        new = [i for i, key in enumerate(keys) if key not in self._seen]
        if new:
            for i, row in zip(new, self._trunk.features(images[new])):
                self._seen[keys[i]] = row
        return np.stack([self._seen[key] for key in keys])


async def test_demo_setup_and_tour(trunk, trunk_checkpoint, tmp_path, aiohttp_client):
    store_dir = tmp_path / "store"
    (store_dir / "trunk").mkdir(parents=True)
    remembering = RememberingTrunk(trunk)
    bots = ensure_demo(store_dir, per_class=4, trunk=remembering, held_out_per_class=2,
                       progress=False)
    assert [b.bot_id for b in bots] == list(KINDS) and all(b.trained for b in bots)
    for bot in bots:
        assert bot.held_out_accuracy >= 0.75, bot  # chance is 1/3 .. 1/5
    # A second run reuses everything (same trunk): nothing retrained.
    again = ensure_demo(store_dir, per_class=4, trunk=remembering, progress=False)
    assert not any(b.trained for b in again) and [b.version for b in again] == [1, 1, 1]

    # Serve the store and classify held-out images of each demo kind over HTTP.
    app = create_app(Settings(store=str(store_dir), warmup=False, auth="none"), trunk=trunk)
    client = await aiohttp_client(app)
    assert await app[SERVICE].wait_ready(), app[SERVICE].readiness.error
    correct = total = 0
    for kind, labels in KINDS.items():
        for label in labels:
            resp = await client.post(f"/classify/{kind}?top_k=1", data=_png(kind, label, 7, 9),
                                     headers={"Content-Type": "image/png"})
            assert resp.status == 200, await resp.text()
            top = (await resp.json())["results"][0]["predictions"][0]["label"]
            correct += top == label
            total += 1
    assert correct / total >= 0.75, (correct, total)

    # `multihead train` a new bot from a folder of images (the CLI parser and handler, with
    # the session's trunk instead of building another one).
    from cli.bots import cmd_train
    from cli.main import build_parser

    args = build_parser().parse_args(["train", "my-scenes", "--images",
                                      str(store_dir / "demo_images" / "scenes"),
                                      "--store", str(store_dir), "--no-progress"])
    assert cmd_train(args, trunk=remembering) == 0
    with HeadStore(store_dir) as store:
        assert store.info("my-scenes").labels == KINDS["scenes"]

    # `multihead register --from-slim-checkpoint`: the serving trunk is the same checkpoint.
    labels = tmp_path / "imagenet_labels.txt"
    labels.write_text("".join(f"class-{i}\n" for i in range(1001)))
    assert main(["register", "imagenet", "--from-slim-checkpoint", trunk_checkpoint,
                 "--labels", str(labels), "--store", str(store_dir),
                 "--trunk-checkpoint", trunk_checkpoint]) == 0

    # As the tour says, the running server serves it within a second: its lookups read the
    # store's snapshot, which a background thread keeps current.
    for _ in range(100):
        resp = await client.post("/classify?bots=imagenet,colors&top_k=3",
                                 data=_png("colors", "red", 0, 5),
                                 headers={"Content-Type": "image/png"})
        if resp.status != 404:
            break
        await asyncio.sleep(0.05)
    body = await resp.json()
    assert resp.status == 200, body
    assert body["results"]["colors"]["results"][0]["predictions"][0]["label"] == "red"
    assert len(body["results"]["imagenet"]["results"][0]["predictions"]) == 3


# -- the demo's INT8 trunk: when it calibrates one (the calibration itself is the session's one
# real run, tests/support/int8.py; here `calibrate` is recorded, not run) ----------------------

@pytest.mark.parametrize("kwargs, why_not", [
    ({"precision": "fp32", "runtime": "auto"}, "precision 'fp32' asked for"),
    ({"precision": "bf16"}, "precision 'bf16' asked for"),
    ({"precision": "auto", "runtime": "tf"}, "the trunk runs on TensorFlow"),
])
def test_the_demo_calibrates_no_int8_trunk_that_would_not_run(kwargs, why_not):
    from cli.demo_setup import int8_wanted

    assert int8_wanted(kwargs) == why_not


def test_the_demo_calibrates_an_int8_trunk_by_default_on_openvino():
    from backbone.device import maybe_has_gpu
    from backbone.runners.registry import available
    from cli.demo_setup import int8_wanted

    if maybe_has_gpu() or "openvino" not in available():
        pytest.skip("the trunk would not run on OpenVINO's CPU plugin here")
    pytest.importorskip("nncf")
    assert int8_wanted({"precision": "auto", "runtime": "auto"}) is None
    assert int8_wanted(None) is None


def test_the_demo_calibrates_once_on_its_own_images(int8_calibrated, trunk_checkpoint,
                                                    tmp_path, monkeypatch):
    import cli.quantize
    from cli.demo_setup import ensure_int8
    from tests.support.int8 import link_checkpoint

    calls = []
    monkeypatch.setattr(cli.quantize, "calibrate",
                        lambda *args, **kwargs: calls.append((args, kwargs)) or 0)
    # A passing INT8 trunk exists: nothing to do.
    assert ensure_int8(tmp_path, int8_calibrated.prefix, per_class=1, kinds=("light",))
    assert calls == []
    # None yet: the demo images are written, then calibrated on, kept even below a bound.
    prefix = link_checkpoint(trunk_checkpoint, tmp_path / "trunk")
    assert not ensure_int8(tmp_path, prefix, per_class=1, kinds=("light",))
    ((args, kwargs),) = calls
    assert args[:2] == (prefix, tmp_path / "demo_images")
    assert sorted(p.parent.name for p in args[2]) == sorted(KINDS["light"])
    assert kwargs["force"] is True and kwargs["store"] == str(tmp_path)
    assert kwargs["accuracy_control"] is False  # minutes more: not in the demo's first run


def test_the_demo_says_why_its_int8_trunk_fails_its_gate(int8_calibrated, trunk_checkpoint,
                                                         tmp_path, caplog):
    from backbone import quantize as q
    from backbone.checkpoint import cache_dir_of
    from cli.demo_setup import ensure_int8
    from tests.support.int8 import link_checkpoint, save_artifact

    prefix = link_checkpoint(trunk_checkpoint, tmp_path / "trunk")
    save_artifact(q.Int8Artifact(cache_dir_of(prefix), prefix=prefix, calibration="the demo's"),
                  int8_calibrated.made["int8"], mean_cosine=0.9995,
                  agreement={"colors": 1.0, "light": 0.97},
                  lowest=[{"image": "light/dim/032.png", "cosine": 0.9985, "norm_ratio": 0.1}])
    with caplog.at_level(logging.WARNING, logger="cli.demo_setup"):
        assert not ensure_int8(tmp_path, prefix, per_class=1, kinds=("light",))
    (line,) = [r.getMessage() for r in caplog.records if "INT8 trunk" in r.getMessage()]
    assert line.startswith("the demo's INT8 trunk gate fails for head 'light' (agreement "
                           "97.00 % < 99 %)")
    assert "the demo serves the float trunk (lowest cosine light/dim/032.png 0.998500, " \
        "features 0.10 x the median norm)" in line


def test_the_demo_trains_its_bots_before_it_calibrates(trunk_checkpoint, tmp_path,
                                                       monkeypatch):
    import cli.demo_setup
    import cli.quantize
    from tests.support.int8 import ProjectingTrunk

    registered_then = []

    def calibrate(prefix, folder, files, **kwargs):
        with HeadStore(kwargs["store"]) as store:
            registered_then.append([info.bot_id for info in store.list()])
        return 0

    monkeypatch.setattr(cli.quantize, "calibrate", calibrate)
    monkeypatch.setattr(cli.demo_setup, "int8_wanted", lambda trunk_kwargs: None)
    store_dir = tmp_path / "store"
    bots = ensure_demo(store_dir, per_class=5, trunk=ProjectingTrunk(trunk_checkpoint),
                       kinds=("light",), held_out_per_class=1, progress=False, int8=True)
    assert [(b.bot_id, b.trained) for b in bots] == [("light", True)]
    assert registered_then == [["light"]]  # its gate had the bot to judge
