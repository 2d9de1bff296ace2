"""The run's INT8 trunk (`bench.int8`) without calibrating: asked once per run, skipped with
its reason where it cannot be made, a failed calibration recorded, and calibration images that
are the same bytes every run (the output's cache is keyed by them) and never the uploads."""
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


def test_calibration_images_are_the_same_bytes_every_run_and_not_the_uploads(tmp_path):
    first = int8.write_images(tmp_path / "a", 3)
    again = int8.write_images(tmp_path / "b", 3)
    assert [p.name for p in first] == ["image-000.jpg", "image-001.jpg", "image-002.jpg"]
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert len({p.read_bytes() for p in first}) == 3
    assert not {p.read_bytes() for p in first} & set(make_jpegs(3))
