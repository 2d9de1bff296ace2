"""The INT8 trunk: NNCF quantization of the real trunk, its fidelity bounds, the artifact's key,
the refusal below a bound, --force, and the atomic write.

ONE real calibration per session (tests/support/int8.py: the session's seeded trunk, real NNCF,
16 generated demo images, 8 held out) runs through `multihead quantize`; the other command runs
reuse its fp32 and int8 models (both real) instead of building and quantizing again, which
costs minutes on 2 shared cores: what they test is the command's decision, not NNCF. The
INT8 trunk loaded from it is tested in test_int8.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from backbone import quantize as q
from cli.main import main
from tests.support.int8 import SAMPLES, link_checkpoint

pytest.importorskip("nncf")


def _int8_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(f"*{q.PREFIX}*")) if directory.exists() else []


@pytest.fixture
def calibrated(int8_calibrated):
    """The session's one real `multihead quantize` run (tests/support/int8.py): (exit code,
    stdout, prefix, store, fp32 and int8 models it made)."""
    c = int8_calibrated
    return c.code, c.out, c.prefix, c.store, c.made


@pytest.fixture
def demo_images(int8_images):
    return int8_images


def test_int8_fidelity_on_the_demo_images_is_within_the_bounds(calibrated, demo_images):
    code, out, prefix, _, _ = calibrated
    print(out)  # the report, shown by `pytest -rP`
    assert code == 0, out
    artifact = q.Int8Artifact.find(Path(prefix).parent / "graph_cache", prefix)
    assert artifact is not None, out
    meta = artifact.metadata()
    fidelity = meta["fidelity"]
    assert fidelity["passed"] and fidelity["images"] == 8
    assert fidelity["min_cosine"] >= q.MIN_COSINE
    assert set(fidelity["agreement"]) == {"colors"}
    assert fidelity["agreement"]["colors"] >= q.MIN_TOP1_AGREEMENT
    assert meta["calibration"]["images"] == SAMPLES and meta["calibration"]["date"]
    assert set(meta["versions"]) == {"openvino", "nncf", "tensorflow"}
    assert "PASS" in out and "wrote" in out
    # The report names the held-out images of lowest cosine by their path under --images.
    lowest = fidelity["lowest"]
    assert len(lowest) == q.LOWEST_SHOWN and lowest[0]["cosine"] == fidelity["min_cosine"]
    assert all((demo_images / row["image"]).is_file() for row in lowest), lowest
    assert f"lowest cosines: {lowest[0]['image']} " in out


def test_the_written_artifact_loads_and_gives_the_measured_features(calibrated):
    _, _, prefix, _, made = calibrated
    artifact = q.Int8Artifact.find(Path(prefix).parent / "graph_cache", prefix)
    images = np.random.default_rng(1).uniform(-1, 1, (2, 299, 299, 3)).astype(np.float32)
    loaded = q.features(q.compile_model(artifact.load()), images)
    measured = q.features(q.compile_model(made["int8"]), images)
    np.testing.assert_allclose(loaded, measured, rtol=1e-5, atol=1e-5)


def test_the_same_checkpoint_and_calibration_set_reuse_the_artifact(calibrated, demo_images,
                                                                     capsys):
    _, _, prefix, store, _ = calibrated
    before = _int8_files(Path(prefix).parent / "graph_cache")
    assert main(["quantize", "--images", str(demo_images), "--samples", str(SAMPLES),
                 "--trunk-checkpoint", prefix, "--store", str(store)]) == 0
    assert "already calibrated on these images" in capsys.readouterr().out
    assert _int8_files(Path(prefix).parent / "graph_cache") == before


def test_a_different_checkpoint_or_calibration_set_never_reuses_an_artifact(calibrated,
                                                                          tmp_path):
    _, _, prefix, _, _ = calibrated
    directory = Path(prefix).parent / "graph_cache"
    found = q.Int8Artifact.find(directory, prefix)
    same = q.Int8Artifact(directory, prefix=prefix, calibration=found.calibration)
    other_set = q.Int8Artifact(directory, prefix=prefix, calibration=q.calibration_digest([b"x"]))
    assert same.xml_path == found.xml_path and same.complete()
    assert other_set.key != found.key and not other_set.complete()
    # Another checkpoint (its index differs, as when any tensor does) in the same directory.
    other = tmp_path / "other.ckpt"
    Path(f"{other}.index").write_bytes(Path(f"{prefix}.index").read_bytes() + b"\0")
    theirs = q.Int8Artifact(directory, prefix=str(other), calibration=found.calibration)
    assert theirs.key != found.key and not theirs.complete()
    assert q.Int8Artifact.find(directory, str(other)) is None


def test_the_calibration_digest_ignores_order_and_sees_content():
    a, b = b"first image", b"second image"
    assert q.calibration_digest([a, b]) == q.calibration_digest([b, a])
    assert q.calibration_digest([a, b]) != q.calibration_digest([a, b + b"!"])
    array = np.zeros((2, 3), np.float32)
    assert q.calibration_digest([array]) != q.calibration_digest([array.reshape(3, 2)])


@pytest.fixture
def replayed(calibrated, trunk_checkpoint, tmp_path, monkeypatch):
    """A fresh checkpoint directory whose command run reuses the calibrated real models."""
    _, _, _, store, made = calibrated
    monkeypatch.setattr(q, "float_model", lambda *a, **k: made["fp32"])
    monkeypatch.setattr(q, "quantize", lambda *a, **k: made["int8"])
    return link_checkpoint(trunk_checkpoint, tmp_path / "trunk"), store


def test_below_a_bound_it_exits_2_and_writes_nothing_unless_forced(replayed, demo_images,
                                                                  monkeypatch, capsys):
    prefix, store = replayed
    directory = Path(prefix).parent / "graph_cache"
    monkeypatch.setattr(q, "MIN_COSINE", 1.01)  # a cosine never reaches it: a failing bound
    argv = ["quantize", "--images", str(demo_images), "--samples", str(SAMPLES),
            "--trunk-checkpoint", prefix, "--store", str(store)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "FAIL: min cosine" in captured.out and "not written" in captured.err
    assert _int8_files(directory) == []

    assert main([*argv, "--force"]) == 0
    assert "forced, below a bound" in capsys.readouterr().out
    assert q.Int8Artifact.find(directory, prefix) is None  # never taken as a passing one
    forced = q.Int8Artifact.find(directory, prefix, passing=False)
    assert forced is not None and forced.metadata()["fidelity"]["passed"] is False


def test_a_crash_before_the_metadata_commits_leaves_no_artifact(calibrated, tmp_path,
                                                               monkeypatch):
    _, _, prefix, _, made = calibrated
    artifact = q.Int8Artifact(tmp_path, prefix=prefix, calibration="some set")
    real_replace = os.replace

    def crash_at_the_commit(src, dst):
        if str(dst).endswith(".json"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_at_the_commit)
    report = q.FidelityReport(images=1, min_cosine=1.0)
    with pytest.raises(OSError, match="disk full"):
        artifact.save(made["int8"], report=report, images=1, description="test")
    assert not artifact.complete()
    assert q.Int8Artifact.find(tmp_path, prefix, passing=False) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left

    monkeypatch.setattr(os, "replace", real_replace)
    meta = artifact.save(made["int8"], report=report, images=1, description="test")
    assert q.Int8Artifact.find(tmp_path, prefix).metadata() == json.loads(json.dumps(meta))


def test_fidelity_measures_cosine_and_top1_agreement_per_head():
    class Head:  # a head is anything with logits(features); this one looks at two features
        def logits(self, features):
            return features[:, :2]

    rng = np.random.default_rng(0)
    fp32 = rng.normal(size=(4, 1536)).astype(np.float32)
    fp32[:, :2] = [[1.0, 0.99], [2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]
    int8 = fp32.copy()
    int8[0, :2] = [0.99, 1.0]  # swaps the top-1 of image 0 for the head, barely moves cosine
    report = q.fidelity(fp32, int8, {"h": Head()})
    assert report.agreement == {"h": 0.75}
    assert q.MIN_COSINE <= report.min_cosine < 1.0
    assert report.failures == [f"head 'h': top-1 agreement 75.00% < {q.MIN_TOP1_AGREEMENT:.0%}"]
    assert not report.passed
    far = q.fidelity(fp32, -fp32)
    assert far.min_cosine == pytest.approx(-1.0) and not far.passed
    assert q.fidelity(fp32, fp32).passed
    with pytest.raises(ValueError):
        q.fidelity(fp32, fp32[:3])


def test_the_report_names_the_lowest_images_and_why_by_their_feature_norm():
    rng = np.random.default_rng(1)
    fp32 = np.abs(rng.normal(size=(6, 1536))).astype(np.float32)
    fp32[2] *= 0.05  # a flat picture: small features
    fp32[4] *= 3.0  # a bright one: large features
    noise = rng.normal(size=fp32.shape).astype(np.float32)
    # The same absolute error on every image, except a clipped-looking extra one on image 4.
    int8 = fp32 + 0.01 * noise
    int8[4] += 0.2 * noise[4]
    names = [f"img{i}.png" for i in range(6)]
    report = q.fidelity(fp32, int8, names=names)
    assert [row["image"] for row in report.lowest][:2] == ["img2.png", "img4.png"]
    assert report.lowest[0]["cosine"] == report.min_cosine
    assert report.lowest[0]["norm_ratio"] < q.LOW_NORM < 1 < q.HIGH_NORM < report.lowest[1][
        "norm_ratio"]
    assert len(report.lowest) == q.LOWEST_SHOWN
    text = "\n".join(report.lines())
    assert "lowest cosines: img2.png" in text
    assert not report.passed and "img2.png: a low-signal picture" in text
    # The reason printed is the lowest image's: a large-feature image gets the clipping one.
    swapped = q.fidelity(fp32[[4, 0, 1]], int8[[4, 0, 1]], names=["b", "c", "d"])
    assert swapped.lowest[0]["image"] == "b" and not swapped.passed
    assert "b: stronger activations" in "\n".join(swapped.lines())
    # No reason when the bound is met; "#i" names by default; the report survives JSON.
    close = q.fidelity(fp32, fp32 + 1e-6 * noise)
    assert close.passed and close.lowest[0]["image"].startswith("#")
    assert not any(line.startswith("  ") for line in close.lines())
    assert q.FidelityReport(**{k: v for k, v in json.loads(json.dumps(report.to_dict())).items()
                               if k != "passed"}) == report
    with pytest.raises(ValueError):
        q.fidelity(fp32, int8, names=names[:2])


def test_importing_the_module_imports_neither_openvino_nor_nncf():
    import subprocess
    import sys

    code = ("import sys, backbone, backbone.quantize, cli.main; "
            "print(sorted({'openvino', 'nncf', 'tensorflow'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert out.stdout.strip() == "[]"


def test_too_few_images_is_a_usage_error_before_any_work(tmp_path, capsys):
    from cli.demo_images import write_demo_images

    folder = write_demo_images(tmp_path / "images", "light", per_class=2)  # 6 < 8 + 1
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--images", str(folder), "--trunk-checkpoint", str(tmp_path / "none")])
    assert exit_info.value.code == 2
    assert "6 images, need at least 9" in capsys.readouterr().err
