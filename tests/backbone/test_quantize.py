"""The INT8 trunk: NNCF quantization of the real trunk, its gate, the artifact's key and its
held-out features, the refusal below a bound, accuracy control where plain calibration misses
the gate, --force, and the atomic write.

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
from types import SimpleNamespace

import numpy as np
import pytest

from backbone import gate
from backbone import quantize as q
from cli.main import main
from tests.support.int8 import SAMPLES, held_out_features, link_checkpoint, save_artifact

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
    assert fidelity["mean_cosine"] >= gate.MIN_MEAN_COSINE
    assert set(fidelity["agreement"]) == {"colors"}
    assert fidelity["agreement"]["colors"] >= gate.MIN_HEAD_AGREEMENT
    assert fidelity["overall_agreement"] == fidelity["agreement"]["colors"]
    assert meta["calibration"]["images"] == SAMPLES and meta["calibration"]["date"]
    assert meta["float_layers"] == 0  # plain calibration passed: no accuracy control
    assert set(meta["versions"]) == {"openvino", "nncf", "tensorflow"}
    assert "PASS" in out and "wrote" in out and "accuracy control" not in out
    # The report names the held-out images of lowest cosine by their path under --images.
    lowest = fidelity["lowest"]
    assert len(lowest) == q.LOWEST_SHOWN and lowest[0]["cosine"] == fidelity["min_cosine"]
    assert all((demo_images / row["image"]).is_file() for row in lowest), lowest
    assert f"lowest cosines: {lowest[0]['image']} " in out


def test_the_artifact_keeps_the_held_out_features_a_later_head_is_judged_from(
        calibrated, demo_images):
    from backbone import preprocess
    from store import HeadStore

    _, _, prefix, store, made = calibrated
    artifact = q.Int8Artifact.find(Path(prefix).parent / "graph_cache", prefix)
    held = artifact.held_out()
    assert held.images == 8 and all((demo_images / name).is_file() for name in held.names)
    # The features of the held-out images under the models that were measured.
    images = np.stack([preprocess((demo_images / name).read_bytes()) for name in held.names])
    np.testing.assert_allclose(held.fp32, q.features(q.compile_model(made["fp32"]), images),
                               rtol=1e-4, atol=1e-4)
    assert held.int8.shape == (8, 1536) and not np.array_equal(held.int8, held.fp32)
    # Judged again from them, the gate is the recorded one; a head is one matmul.
    with HeadStore(store) as heads:
        colors = heads.get("colors")
        info = heads.info("colors")
    assert gate.judge(held, {"colors": gate.agreement(held, colors.weights, colors.biases)}) \
        == artifact.report()
    # The registered bot's agreement is recorded under its name, version and date.
    from service.core.bots import agreement_key

    # (servers of other tests record theirs beside it too)
    key = agreement_key("colors", info.version, info.created)
    assert artifact.agreements()[key] == artifact.report().agreement["colors"]
    assert q.float_layers(made["int8"]) == 0 < q.float_layers(made["fp32"])


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
    """A fresh checkpoint directory whose command run reuses the calibrated real models;
    accuracy control, if it runs, gives the plain INT8 model back (recorded in `.controlled`)."""
    _, _, _, store, made = calibrated
    controlled = []
    monkeypatch.setattr(q, "float_model", lambda *a, **k: made["fp32"])
    monkeypatch.setattr(q, "quantize", lambda *a, **k: made["int8"])
    monkeypatch.setattr(q, "quantize_with_accuracy_control",
                        lambda *a, **k: controlled.append((a, k)) or made["int8"])
    replay = SimpleNamespace(prefix=link_checkpoint(trunk_checkpoint, tmp_path / "trunk"),
                             store=store, controlled=controlled)
    return replay


def test_below_a_bound_it_exits_2_and_writes_nothing_unless_forced(replayed, demo_images,
                                                                  monkeypatch, capsys):
    directory = Path(replayed.prefix).parent / "graph_cache"
    monkeypatch.setattr(gate, "MIN_MEAN_COSINE", 1.01)  # a cosine never reaches it
    argv = ["quantize", "--images", str(demo_images), "--samples", str(SAMPLES),
            "--trunk-checkpoint", replayed.prefix, "--store", str(replayed.store),
            "--no-accuracy-control"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "FAIL: mean cosine" in captured.out and "not written" in captured.err
    assert _int8_files(directory) == [] and replayed.controlled == []

    assert main([*argv, "--force"]) == 0
    assert "forced, below a bound" in capsys.readouterr().out
    assert q.Int8Artifact.find(directory, replayed.prefix) is None  # never a passing one
    forced = q.Int8Artifact.find(directory, replayed.prefix, passing=False)
    assert forced is not None and forced.metadata()["fidelity"]["passed"] is False


def test_where_plain_calibration_misses_the_gate_accuracy_control_runs_with_the_heads(
        replayed, demo_images, monkeypatch, capsys):
    from store import HeadStore

    monkeypatch.setattr(gate, "MIN_MEAN_COSINE", 1.01)  # the plain model fails, and again
    argv = ["quantize", "--images", str(demo_images), "--samples", str(SAMPLES),
            "--trunk-checkpoint", replayed.prefix, "--store", str(replayed.store)]
    assert main(argv) == 2
    out = capsys.readouterr().out
    ((args, kwargs),) = replayed.controlled
    fp32_model, calibration, held_images, reference, heads = args
    with HeadStore(replayed.store) as store:
        colors = store.get("colors")
    assert list(heads) == ["colors"]
    np.testing.assert_array_equal(heads["colors"][0], colors.weights)
    assert len(calibration) == kwargs["samples"] == SAMPLES
    assert held_images.shape == (8, 299, 299, 3) and reference.images == 8
    assert "plain calibration misses the gate: NNCF's accuracy control" in out
    assert f"accuracy control kept 0 of {q.float_layers(fp32_model)} layers in float" in out
    # One kept below the gate without accuracy control (as the demo keeps it) is made again
    # with it when asked; once accuracy control made it, it is reused.
    replayed.controlled.clear()
    assert main([*argv, "--force", "--no-accuracy-control"]) == 0
    assert replayed.controlled == [] and main(argv) == 2
    assert "below the gate, without accuracy control: quantizing again" in \
        capsys.readouterr().out
    assert len(replayed.controlled) == 1
    # No registered head: nothing to judge answers by, so no accuracy control.
    replayed.controlled.clear()
    assert main([*argv[:-1], str(replayed.store.parent / "empty-store")]) == 2
    assert replayed.controlled == []
    assert "no registered head: accuracy control has no answers" in capsys.readouterr().out


def test_accuracy_control_judges_by_the_gate_and_ranks_by_the_features(monkeypatch):
    """What `quantize_with_accuracy_control` hands NNCF (recorded by a stand-in for NNCF's
    function): the gate's score as the metric, its scale as the maximum drop, the features
    as the outputs NNCF ranks layers by, each held-out image with its index."""
    import nncf

    held = held_out_features(8)
    weights = np.zeros((1536, 2), np.float32)
    weights[0, 0] = weights[1, 1] = 1.0
    images = np.zeros((8, 299, 299, 3), np.float32)
    seen = {}

    class Compiled:  # "runs" images 0..7 as their index says: fp32 or a flipped answer
        def __init__(self, flip):
            self.flip = flip

        def create_infer_request(self):
            return self

        def infer(self, inputs):
            index = int(inputs[0][0, 0, 0, 0])
            row = held.fp32[index].copy()
            if self.flip and index == 0:
                top = int(row[:2].argmax())
                row[:2] = 0.0
                row[1 - top] = 10.0  # the head's other class
            return [row[None]]

    def stand_in(model, calibration, validation, validation_fn, **kwargs):
        items = list(validation.get_data())
        seen.update(kwargs, items=items, inference=list(validation.get_inference_data()),
                    faithful=validation_fn(Compiled(False), items),
                    flipped=validation_fn(Compiled(True), items),
                    first=validation_fn(Compiled(True), items[:1]))
        return model

    class Model:
        def clone(self):
            return self

    for i in range(8):
        images[i, 0, 0, 0] = i  # the stand-in model reads the index back from the pixels
    monkeypatch.setattr(nncf, "quantize_with_accuracy_control", stand_in)
    monkeypatch.setattr(q, "float_layers", lambda model: 0)
    q.quantize_with_accuracy_control(Model(), images[:2], images, held,
                                     {"h": (weights, np.zeros(2, np.float32))}, samples=2)
    assert seen["max_drop"] == gate.SCALE and seen["drop_type"] == nncf.DropType.ABSOLUTE
    assert seen["subset_size"] == 2
    restorer = seen["advanced_accuracy_restorer_parameters"]
    assert (restorer.ranking_subset_size, restorer.max_num_iterations) == (
        q.RANKING_IMAGES, q.MAX_FLOAT_GROUPS)
    assert [index for index, _ in seen["items"]] == list(range(8))
    assert seen["inference"][3].shape == (1, 299, 299, 3)
    score, outputs = seen["faithful"]
    assert score == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_array_equal(outputs[5][0], held.fp32[5][None])
    score, _ = seen["flipped"]  # one answer of 8 changed: 87.5 % < 99 %
    assert score < 1 - gate.SCALE
    assert seen["first"][0] < 1 - gate.SCALE and len(seen["first"][1]) == 1


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
    with pytest.raises(OSError, match="disk full"):
        save_artifact(artifact, made["int8"], mean_cosine=1.0)
    assert not artifact.complete()
    assert q.Int8Artifact.find(tmp_path, prefix, passing=False) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left

    monkeypatch.setattr(os, "replace", real_replace)
    meta = save_artifact(artifact, made["int8"], mean_cosine=1.0)
    found = q.Int8Artifact.find(tmp_path, prefix)
    assert found.metadata() == json.loads(json.dumps(meta))
    np.testing.assert_array_equal(found.held_out().int8, held_out_features().int8)


def test_agreements_recorded_beside_an_artifact_go_with_a_new_save(calibrated, tmp_path):
    _, _, prefix, _, made = calibrated
    artifact = q.Int8Artifact(tmp_path, prefix=prefix, calibration="some set")
    save_artifact(artifact, made["int8"], mean_cosine=1.0)
    assert artifact.agreements() == {}
    artifact.record_agreements({"a@v1@t": 1.0})
    artifact.record_agreements({"b@v2@t": 0.5})
    assert artifact.agreements() == {"a@v1@t": 1.0, "b@v2@t": 0.5}
    # An agreements file is not taken for an artifact's metadata.
    assert [a.key for a in q.Int8Artifact.available(tmp_path, prefix)] == [artifact.key]
    save_artifact(artifact, made["int8"], mean_cosine=1.0)  # the same key made again
    assert artifact.agreements() == {}


def test_importing_the_module_imports_neither_openvino_nor_nncf():
    import subprocess
    import sys

    code = ("import sys, backbone, backbone.quantize, cli.main; "
            "print(sorted({'openvino', 'nncf', 'tensorflow'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert out.stdout.strip() == "[]"


def test_too_few_images_is_a_usage_error_before_any_work(tmp_path, capsys):
    from heads.demo_images import write_demo_images

    folder = write_demo_images(tmp_path / "images", "light", per_class=2)  # 6 < 8 + 1
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--images", str(folder), "--trunk-checkpoint", str(tmp_path / "none")])
    assert exit_info.value.code == 2
    assert "6 images, need at least 9" in capsys.readouterr().err
