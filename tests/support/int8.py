"""ONE real INT8 trunk per test session: NNCF quantization of the session's seeded trunk, run
through `multihead quantize` on generated demo images (about 30-70 s on 2 shared cores).

Fixtures (tests/conftest.py imports them by name):
- `int8_images`: the 24 generated demo images the calibration reads (16 calibrate, 8 held out).
- `int8_calibrated`: that one command run: its exit code, its report, the checkpoint it
  calibrated (the session's, linked into a directory of its own so that only this one has an
  INT8 trunk next to it), the store of its registered bot, and the real fp32 and int8 models it
  made (later tests reuse them instead of building or quantizing again).
- `int8_trunk`: the INT8 trunk `Trunk.from_checkpoint(..., precision="int8")` loads from it.

`ProjectingTrunk` stands in for the trunk where its features are not the subject.
`save_artifact` writes another artifact of a real model with a report and held-out features
made up for the test (what a `--force` or the demo would have kept).
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

SAMPLES = 16  # calibration images; the other 8 of `int8_images` are held out


@dataclass
class Calibrated:
    """The session's `multihead quantize` run (see the module docstring)."""

    code: int
    out: str
    prefix: str
    store: Path
    made: dict = field(default_factory=dict)  # "fp32", "int8": the real openvino.Models

    @property
    def cache_dir(self) -> Path:
        return Path(self.prefix).parent / "graph_cache"


def held_out_features(n: int = 8, *, seed: int = 0):
    """Made-up held-out features of `n` images (`backbone.gate.HeldOut`): the INT8 trunk's a
    little off the float trunk's."""
    from backbone.gate import HeldOut

    rng = np.random.default_rng(seed)
    fp32 = rng.uniform(0, 1, (n, 1536)).astype(np.float32)
    int8 = fp32 + rng.normal(0, 0.001, fp32.shape).astype(np.float32)
    return HeldOut(tuple(f"held/{i:03d}.png" for i in range(n)), fp32, int8)


def save_artifact(artifact, model, *, mean_cosine: float, agreement: dict | None = None,
                  lowest: list | None = None, description: str = "test") -> dict:
    """Saves `model` as `artifact` (a `backbone.quantize.Int8Artifact`) with a report of this
    mean cosine and these heads' agreement, and made-up held-out features; returns the
    metadata."""
    from backbone.gate import FidelityReport

    report = FidelityReport(images=8, mean_cosine=mean_cosine, min_cosine=mean_cosine,
                            agreement=agreement or {}, lowest=lowest or [])
    return artifact.save(model, report=report, held_out=held_out_features(), images=8,
                         description=description)


class ProjectingTrunk:
    """A stand-in for the trunk where the subject is what a command does with features, not
    the features: a fixed random projection of a sample of the pixels (no trunk run)."""

    def __init__(self, checkpoint_prefix: str) -> None:
        self.checkpoint_prefix = checkpoint_prefix
        self._projection = np.random.default_rng(0).standard_normal((300, 1536)).astype(
            np.float32)

    def features(self, images: np.ndarray) -> np.ndarray:
        sampled = np.asarray(images)[:, ::30, ::30, :].reshape(len(images), -1)[:, :300]
        return sampled @ self._projection


def link_checkpoint(prefix: str, directory: Path) -> str:
    """The checkpoint `prefix` seen from `directory` (symlinks): its own graph_cache/ there."""
    directory.mkdir(parents=True)
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        (directory / path.name).symlink_to(path)
    return str(directory / Path(prefix).name)


@pytest.fixture(scope="session")
def int8_images(tmp_path_factory) -> Path:
    from heads.demo_images import write_demo_images

    root = tmp_path_factory.mktemp("demo_images")
    write_demo_images(root, "colors", per_class=3)  # 15 images
    write_demo_images(root, "light", per_class=3)  # 9 images
    return root


@pytest.fixture(scope="session")
def int8_calibrated(trunk_checkpoint, serving_graph_cache, int8_images,
                    tmp_path_factory) -> Calibrated:
    """The session's one real `multihead quantize` run (16 calibration images, 8 held out,
    one registered bot), recording the real models it made. Its checkpoint's graph cache
    holds the session's serving graph, as after a first `serve` (the demo's order): the
    calibration imports it instead of building the graph again."""
    pytest.importorskip("nncf")
    from backbone import quantize as q
    from cli.main import main
    from store import HeadStore
    from tests.backbone.helpers import copy_graphs

    base = tmp_path_factory.mktemp("int8")
    prefix = link_checkpoint(trunk_checkpoint, base / "trunk")
    copy_graphs(serving_graph_cache, base / "trunk" / "graph_cache")
    store = base / "store"
    rng = np.random.default_rng(0)
    with HeadStore(store) as heads:
        heads.register("colors", rng.normal(0, 0.05, (1536, 5)), np.zeros(5),
                       ["red", "green", "blue", "yellow", "purple"], source="test")
    made: dict = {}
    real_float_model, real_quantize = q.float_model, q.quantize
    with pytest.MonkeyPatch.context() as mp:  # record the real models for the later tests
        mp.setattr(q, "float_model", lambda *a, **k: made.setdefault("fp32", real_float_model(
            *a, **k)))
        mp.setattr(q, "quantize", lambda *a, **k: made.setdefault("int8", real_quantize(
            *a, **k)))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["quantize", "--images", str(int8_images), "--samples", str(SAMPLES),
                         "--trunk-checkpoint", prefix, "--store", str(store)])
    return Calibrated(code, out.getvalue(), prefix, store, made)


@pytest.fixture(scope="session")
def int8_trunk(int8_calibrated):
    """The INT8 trunk of the session's calibration, loaded as `serve` loads it (its compiled
    model is then cached next to the checkpoint: later loads import it)."""
    from backbone import Trunk

    assert int8_calibrated.code == 0, int8_calibrated.out
    trunk = Trunk.from_checkpoint(int8_calibrated.prefix, device="cpu", runtime="openvino",
                                  precision="int8", warmup_batch_sizes=(),
                                  graph_cache_dir=int8_calibrated.cache_dir)
    yield trunk
    trunk.close()
