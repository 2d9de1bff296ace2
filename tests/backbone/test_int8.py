"""The INT8 trunk as the service loads it: `Trunk.from_checkpoint(..., precision="int8")` on the
OpenVINO runner, from the session's one real calibration (tests/support/int8.py).

Bounds, never timings: on demo images the calibration never saw, the int8 features stay within
the fidelity bounds of `backbone.quantize` against the TF fp32 trunk (min cosine >= 0.999, the
registered bot's top-1 kept on >= 99 %); the convolutions really run in 8 bits; a restart
imports the compiled INT8 trunk (same features, no TensorFlow); `auto` takes a passing INT8
trunk and only that; every refusal is one line.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backbone import Device, Int8ArtifactMissing, PrecisionUnsupported, Trunk, preprocess
from backbone import quantize as q
from backbone.checkpoint import cache_dir_of
from backbone.device import cpu_flags
from backbone.inception_v4 import LOGITS_SCOPE
from backbone.precision import float_layers_precision
from backbone.trunk import choose
from cli.demo_images import KINDS, demo_image
from tests.support.int8 import SAMPLES

pytest.importorskip("nncf")

ZEN3 = cpu_flags("flags\t\t: fpu sse2 avx avx2 fma f16c\n")
SAPPHIRE_RAPIDS = cpu_flags("flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n")
HELD_OUT_SEED = 7  # the calibration's demo images are seed 0


def _cpu(flags) -> Device:
    return Device("cpu", "/CPU:0", flags)


@pytest.fixture(scope="module")
def held_out() -> np.ndarray:
    """One demo image per class of the calibrated kinds, from another seed: [8, 299, 299, 3]."""
    images = []
    for kind in ("colors", "light"):
        for label in KINDS[kind]:
            buffer = io.BytesIO()
            demo_image(kind, label, 0, seed=HELD_OUT_SEED).save(buffer, "PNG")
            images.append(preprocess(buffer.getvalue()))
    return np.stack(images)


@pytest.fixture(scope="module")
def int8_features(int8_trunk, held_out) -> np.ndarray:
    return int8_trunk.features(held_out)  # [8, 1536]


def test_int8_features_are_within_the_fidelity_bounds_of_fp32(trunk, int8_calibrated,
                                                               held_out, int8_features):
    from store import HeadStore

    fp32 = trunk.features(held_out)  # the session's TF fp32 trunk
    with HeadStore(int8_calibrated.store) as store:
        report = q.fidelity(fp32, int8_features, {"colors": store.get("colors")})
    print("\n".join(report.lines()))
    assert int8_features.dtype == np.float32 and int8_features.shape == (8, 1536)
    assert report.min_cosine >= q.MIN_COSINE, report.lines()
    assert report.agreement["colors"] >= q.MIN_TOP1_AGREEMENT, report.lines()
    assert not np.array_equal(int8_features, fp32)  # it is another model, not fp32 again


def test_the_int8_trunk_reports_what_it_runs_and_its_calibration(int8_trunk, int8_calibrated,
                                                                  int8_images, trunk):
    meta = q.Int8Artifact.find(int8_calibrated.cache_dir, int8_calibrated.prefix).metadata()
    assert (int8_trunk.runtime, int8_trunk.precision) == ("openvino", "int8")
    assert int8_trunk.float_precision == float_layers_precision(int8_trunk.hardware)
    calibration = int8_trunk.calibration
    assert calibration.digest == meta["calibration"]["digest"]
    assert calibration.date == meta["calibration"]["date"]
    assert calibration.images == SAMPLES and calibration.passed
    assert str(int8_images.resolve()) in calibration.description
    assert calibration.min_cosine == meta["fidelity"]["min_cosine"]
    # The restored net's layout came with the IR (no TensorFlow at load): the trunk's own.
    assert int8_trunk.variables == [v for v in trunk.variables
                                    if not v[0].startswith(LOGITS_SCOPE)]
    assert int8_trunk.num_classes == 0


def test_the_int8_trunk_runs_its_convolutions_in_8_bits(int8_trunk):
    convolutions = int8_trunk.runner.executed_precisions()["Convolution"]
    assert set(convolutions) <= {"u8", "i8"}, convolutions
    assert sum(convolutions.values()) >= 149  # every conv of Inception-V4 (some may be fused)


def test_a_restart_imports_the_compiled_int8_trunk(int8_trunk, int8_calibrated, held_out,
                                                   int8_features):
    again = Trunk.from_checkpoint(int8_calibrated.prefix, device="cpu", runtime="openvino",
                                  precision="int8", warmup_batch_sizes=(),
                                  graph_cache_dir=int8_calibrated.cache_dir)
    try:
        assert again.compiled_from_cache and again.graph_from_cache
        assert again.timings.build_s == 0 and again.timings.restore_s == 0
        assert again.calibration == int8_trunk.calibration
        assert again.variables == int8_trunk.variables
        np.testing.assert_array_equal(again.features(held_out[:2]), int8_features[:2])
    finally:
        again.close()


def test_a_restart_of_the_int8_trunk_imports_no_tensorflow(int8_trunk, int8_calibrated):
    code = ("import sys; from backbone import Trunk; "
            f"t = Trunk.from_checkpoint({int8_calibrated.prefix!r}, device='cpu', "
            f"runtime='openvino', precision='int8', warmup_batch_sizes=(1,), "
            f"graph_cache_dir={str(int8_calibrated.cache_dir)!r}); "
            "print(t.precision, t.compiled_from_cache, 'tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert out.stdout.split() == ["int8", "True", "False"], out.stderr


def test_the_int8_trunk_is_found_where_quantize_writes_it(int8_trunk, int8_calibrated,
                                                          held_out, int8_features, tmp_path):
    """Without int8_dir, the INT8 trunk is looked up where `multihead quantize` wrote it and
    `serve` looks (graph_cache/ next to the checkpoint), not in another graph_cache_dir."""
    assert int8_calibrated.cache_dir == cache_dir_of(int8_calibrated.prefix)
    found = Trunk.from_checkpoint(int8_calibrated.prefix, device="cpu", runtime="openvino",
                                  precision="int8", warmup_batch_sizes=(),
                                  graph_cache_dir=tmp_path)  # the compiled model goes there
    try:
        assert (found.precision, found.calibration) == ("int8", int8_trunk.calibration)
        assert list(tmp_path.glob("inception_v4-ov-*.blob"))
        np.testing.assert_allclose(found.features(held_out[:2]), int8_features[:2], rtol=1e-4,
                                   atol=1e-4)
    finally:
        found.close()


def test_choose_looks_up_the_int8_trunk_for_any_runner_that_declares_it(int8_calibrated):
    from dataclasses import replace

    from backbone.runners import registry
    from backbone.runners.registry import INT8_TRUNK, Needs
    from tests.backbone.helpers import FAKE, FakeRunner

    runs_int8 = replace(FAKE, precisions={**FAKE.precisions, "int8": Needs(artifact=INT8_TRUNK)})
    want = q.Int8Artifact.find(int8_calibrated.cache_dir, int8_calibrated.prefix)
    with registry.registered(runs_int8, FakeRunner):
        for precision in ("int8", "auto"):
            choice = choose(int8_calibrated.prefix, device=_cpu(ZEN3), precision=precision,
                            runtime="fake", int8_dir=int8_calibrated.cache_dir)
            assert (choice.runtime, choice.precision) == ("fake", "int8")
            assert choice.int8_artifact.key == want.key
    with registry.registered(FAKE, FakeRunner):  # declares no INT8 trunk: none looked up
        choice = choose(int8_calibrated.prefix, device=_cpu(ZEN3), precision="auto",
                        runtime="fake", int8_dir=int8_calibrated.cache_dir)
        assert (choice.precision, choice.int8_artifact) == ("fp32", None)


def test_the_compiled_int8_cache_key_follows_the_artifact_and_the_float_precision(
        int8_calibrated, tmp_path):
    from backbone.runners.openvino import CompiledCache

    def path(precision="int8", variant="a|fp32"):
        return CompiledCache(tmp_path, prefix=int8_calibrated.prefix, precision=precision,
                             with_logits=False, variant=variant).path

    assert path() == path()
    assert len({path(), path(variant="b|fp32"), path(variant="a|bf16"),
                path(precision="fp32", variant="")}) == 4


# -- what auto chooses, and the refusals ------------------------------------------------------

@pytest.mark.parametrize("flags, runtime, want, float_layers", [
    (ZEN3, "auto", "int8", "fp32"),
    (SAPPHIRE_RAPIDS, "auto", "int8", "bf16"),  # int8 before bf16; bf16 for its float layers
    (ZEN3, "tf", "fp32", "fp32"),  # TF runs no int8
    (SAPPHIRE_RAPIDS, "tf", "bf16", "bf16"),
])
def test_auto_takes_the_passing_int8_trunk_on_openvino(int8_calibrated, flags, runtime, want,
                                                       float_layers):
    choice = choose(int8_calibrated.prefix, device=_cpu(flags), precision="auto",
                    runtime=runtime, int8_dir=int8_calibrated.cache_dir)
    assert (choice.precision, choice.float_precision) == (want, float_layers)
    assert (choice.int8_artifact is not None) == (want == "int8")


@pytest.mark.parametrize("flags, want", [(ZEN3, "fp32"), (SAPPHIRE_RAPIDS, "bf16")])
def test_auto_without_an_int8_trunk_is_the_float_choice(int8_calibrated, tmp_path, flags,
                                                        want):
    for int8_dir in (tmp_path, None):  # an empty directory, or none to look in
        choice = choose(int8_calibrated.prefix, device=_cpu(flags), precision="auto",
                        runtime="openvino", int8_dir=int8_dir)
        assert (choice.runtime, choice.precision, choice.int8_artifact) == ("openvino", want,
                                                                            None)


def test_a_forced_int8_trunk_serves_only_when_int8_is_asked_for(int8_calibrated, tmp_path):
    prefix, model = int8_calibrated.prefix, int8_calibrated.made["int8"]
    forced = q.Int8Artifact(tmp_path, prefix=prefix, calibration="a forced set")
    forced.save(model, report=q.FidelityReport(images=8, min_cosine=0.9), images=8,
                description="forced")
    device = _cpu(ZEN3)
    assert choose(prefix, device=device, precision="auto", runtime="openvino",
                  int8_dir=tmp_path).precision == "fp32"
    chosen = choose(prefix, device=device, precision="int8", runtime="openvino",
                    int8_dir=tmp_path).int8_artifact
    assert chosen.key == forced.key and chosen.passed is False
    # Once a passing one exists, "int8" takes it.
    passing = q.Int8Artifact(tmp_path, prefix=prefix, calibration="a passing set")
    passing.save(model, report=q.FidelityReport(images=8, min_cosine=0.9999), images=8,
                 description="passing")
    chosen = choose(prefix, device=device, precision="int8", runtime="openvino",
                    int8_dir=tmp_path).int8_artifact
    assert chosen.key == passing.key and chosen.passed is True


def test_int8_without_an_int8_trunk_is_refused_naming_the_command(trunk_checkpoint, tmp_path):
    with pytest.raises(Int8ArtifactMissing) as err:
        Trunk.from_checkpoint(trunk_checkpoint, device="cpu", runtime="openvino",
                              precision="int8", graph_cache_dir=tmp_path)
    message = str(err.value)
    assert "`multihead quantize --images DIR`" in message and "\n" not in message
    assert isinstance(err.value, PrecisionUnsupported)  # served as the same kind of refusal


def test_int8_on_runtime_tf_is_refused(int8_calibrated):
    with pytest.raises(PrecisionUnsupported, match="'int8' runs on OpenVINO") as err:
        Trunk.from_checkpoint(int8_calibrated.prefix, device="cpu", runtime="tf",
                              precision="int8", graph_cache_dir=int8_calibrated.cache_dir)
    assert "\n" not in str(err.value)


def test_int8_with_the_logits_layer_is_refused(int8_calibrated):
    with pytest.raises(PrecisionUnsupported, match="Logits"):
        Trunk.from_checkpoint(int8_calibrated.prefix, device="cpu", runtime="openvino",
                              precision="int8", with_logits=True, warmup_batch_sizes=(),
                              graph_cache_dir=int8_calibrated.cache_dir)
