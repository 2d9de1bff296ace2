"""The run's INT8 trunk (`bench.int8`) without calibrating: asked once per run, skipped with
its reason where it cannot be made, a failed calibration recorded, and calibration images that
are the same bytes every run (the output's cache is keyed by them), never the images the gate's
bots trained on, nor the uploads. The calibration itself (`multihead train` and `multihead
quantize` as child processes) runs in the benchmark, not here: about a minute."""
from __future__ import annotations

import pytest

from bench import int8
from bench.context import Context
from bench.load import make_jpegs
from bench.plan import Plan


def _context(tmp_path) -> Context:
    return Context(Plan(progress=False), tmp_path / "out", tmp_path / "tmp")


def test_without_nncf_the_run_has_no_int8_trunk_and_says_why_once(monkeypatch, tmp_path):
    context = _context(tmp_path)
    monkeypatch.setattr(int8, "why_not", lambda: "NNCF is not installed (the openvino extra)")
    assert int8.ensure_int8(context) == {"skipped": "NNCF is not installed (the openvino extra)"}
    monkeypatch.setattr(int8, "why_not", lambda: pytest.fail("asked twice in one run"))
    assert int8.ensure_int8(context) is context.int8


def test_a_failed_calibration_is_recorded_and_not_retried(monkeypatch, tmp_path):
    context = _context(tmp_path)
    calls = []

    def fail(ctx):
        calls.append(ctx)
        raise RuntimeError("multihead quantize exited with 1: boom")

    monkeypatch.setattr(int8, "why_not", lambda: None)
    monkeypatch.setattr(int8, "_calibrate", fail)
    assert int8.ensure_int8(context) == {
        "error": "RuntimeError: multihead quantize exited with 1: boom"}
    assert int8.ensure_int8(context)["error"] and len(calls) == 1
    assert context.errors["int8-calibration"].startswith("RuntimeError")
    assert (context.out_dir / "error-int8-calibration.txt").exists()


def test_gate_images_are_the_same_bytes_every_run_the_labels_in_turn_and_never_trained_on(
        tmp_path):
    from heads.demo_images import KINDS, write_demo_images

    first = int8.write_images(tmp_path / "a", 14)
    again = int8.write_images(tmp_path / "b", 14)
    names = [p.relative_to(tmp_path / "a").as_posix() for p in first]
    assert len(names) == 14 and names == sorted(names)
    labels = {name.rsplit("/", 1)[0] for name in names}
    assert labels == {f"{kind}/{label}" for kind, ls in KINDS.items() for label in ls}
    assert {"colors/red/001.png", "colors/green/001.png"} <= set(names)  # 12 labels, then again
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert len({p.read_bytes() for p in first}) == 14
    # Not the images the gate's bots are trained on (the demo's, seed 0), nor the uploads.
    trained = set()
    for kind in KINDS:
        folder = write_demo_images(tmp_path / "train", kind, 2, seed=int8.TRAIN_SEED)
        trained |= {p.read_bytes() for p in folder.rglob("*.png")}
    assert not {p.read_bytes() for p in first} & (trained | set(make_jpegs(3)))


def test_the_runs_random_bots_are_scored_on_the_held_out_features(tmp_path):
    import numpy as np

    from backbone.gate import HeldOut, agreement
    from store import HeadStore

    rng = np.random.default_rng(3)
    fp32 = rng.standard_normal((40, 1536)).astype(np.float32)
    held = HeldOut(tuple(f"i{k}" for k in range(40)), fp32,
                   fp32 + 0.3 * rng.standard_normal(fp32.shape).astype(np.float32))
    heads = {bot: (rng.standard_normal((1536, 5)).astype(np.float32) * scale,
                   np.zeros(5, np.float32))
             for bot, scale in (("steady", 1.0), ("shaky", 1e-3))}
    heads["tied"] = (np.zeros((1536, 5), np.float32), np.zeros(5, np.float32))
    with HeadStore(str(tmp_path / "store")) as store:
        for bot, (w, b) in heads.items():
            store.register(bot, w, b, [f"c{k}" for k in range(5)])
    expected = {bot: agreement(held, w, b) for bot, (w, b) in heads.items()}
    got = int8.random_heads(held, tmp_path / "store")
    lowest = min(expected, key=lambda k: (expected[k], k))
    assert got["bots"] == 3 and got["lowest"] == [lowest, expected[lowest]]
    assert got["mean"] == np.mean(list(expected.values()))
    assert got["below_bound"] == sum(v < 0.99 for v in expected.values())
    assert int8.random_heads(held, tmp_path / "empty") == {"bots": 0}
