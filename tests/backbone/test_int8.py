"""The INT8 trunk as the service loads it: `Trunk.from_checkpoint(..., precision="int8")` on the
OpenVINO runner, from the session's one real calibration (tests/support/int8.py).

Bounds, never timings: on demo images the calibration never saw, the int8 features pass the
gate of `backbone.gate` against the TF fp32 trunk (mean cosine >= 0.999, the registered bot's
top-1 kept on >= 99 %); the convolutions really run in 8 bits; a restart imports the compiled
INT8 trunk (same features, no TensorFlow); `auto` takes an INT8 trunk whose gate passes for the
active heads and only that, saying why; every refusal is one line.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backbone import Device, Int8ArtifactMissing, PrecisionUnsupported, Trunk, gate, preprocess
from backbone import quantize as q
from backbone.checkpoint import cache_dir_of
from backbone.device import cpu_flags
from backbone.inception_v4 import LOGITS_SCOPE
from backbone.precision import float_layers_precision
from backbone.trunk import choose
from heads.demo_images import KINDS, demo_image
from tests.support.int8 import SAMPLES, save_artifact

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
    assert report.mean_cosine >= gate.MIN_MEAN_COSINE, report.lines()
    assert report.agreement["colors"] >= gate.MIN_HEAD_AGREEMENT, report.lines()
    assert report.passed, report.lines()
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
    save_artifact(forced, model, mean_cosine=0.9, description="forced")
    device = _cpu(ZEN3)
    assert choose(prefix, device=device, precision="auto", runtime="openvino",
                  int8_dir=tmp_path).precision == "fp32"
    chosen = choose(prefix, device=device, precision="int8", runtime="openvino",
                    int8_dir=tmp_path).int8_artifact
    assert chosen.key == forced.key and chosen.passed is False
    # Once a passing one exists, "int8" takes it.
    passing = q.Int8Artifact(tmp_path, prefix=prefix, calibration="a passing set")
    save_artifact(passing, model, mean_cosine=0.9999, description="passing")
    chosen = choose(prefix, device=device, precision="int8", runtime="openvino",
                    int8_dir=tmp_path).int8_artifact
    assert chosen.key == passing.key and chosen.passed is True


# -- the gate for the active heads: auto passes over an INT8 trunk that fails one ---------------

class Heads:
    """What a service answers `choose` (`HeadsAgreement`): fixed agreements, and the INT8
    trunks it was asked about."""

    def __init__(self, **agreement: float) -> None:
        self.agreement, self.asked = agreement, []

    def __call__(self, artifact):
        self.asked.append(artifact.key)
        return self.agreement


def test_auto_passes_over_an_int8_trunk_whose_gate_fails_for_an_active_head(int8_calibrated):
    artifact = q.Int8Artifact.find(int8_calibrated.cache_dir, int8_calibrated.prefix)
    mean = artifact.report().mean_cosine
    heads = Heads(good=1.0, x=0.975)
    for flags, floats in ((ZEN3, "fp32"), (SAPPHIRE_RAPIDS, "bf16")):
        choice = choose(int8_calibrated.prefix, device=_cpu(flags), precision="auto",
                        runtime="openvino", int8_dir=int8_calibrated.cache_dir, heads=heads)
        assert (choice.precision, choice.int8_artifact) == (floats, None)
        assert choice.judged.key == artifact.key and heads.asked[-1] == artifact.key
        assert choice.gate.agreement == {"good": 1.0, "x": 0.975} and not choice.gate.passed
        assert choice.why == (f"{floats}: the INT8 trunk's gate fails for head 'x' (agreement "
                              f"97.50 % < 99 %); all heads' answers (agreement 98.75 % < 99.5 %)")
    # Every active head within the bounds: int8, and the log line says why.
    choice = choose(int8_calibrated.prefix, device=_cpu(ZEN3), precision="auto",
                    runtime="openvino", int8_dir=int8_calibrated.cache_dir,
                    heads=Heads(a=1.0, b=1.0, c=0.99))
    assert (choice.precision, choice.int8_artifact.key) == ("int8", artifact.key)
    assert choice.why == (f"int8: gate passed for 3 heads (min agreement 99.00 %, overall "
                          f"99.67 %, mean cosine {mean:.4f})")
    # No active head: the mean cosine alone.
    choice = choose(int8_calibrated.prefix, device=_cpu(ZEN3), precision="auto",
                    runtime="openvino", int8_dir=int8_calibrated.cache_dir, heads=Heads())
    assert choice.precision == "int8"
    assert choice.why == f"int8: gate passed with no registered head (mean cosine {mean:.4f})"
    # Without heads to ask, the gate recorded at calibration decides (the session's bot).
    choice = choose(int8_calibrated.prefix, device=_cpu(ZEN3), precision="auto",
                    runtime="openvino", int8_dir=int8_calibrated.cache_dir)
    assert choice.precision == "int8" and choice.gate == artifact.report()


def test_int8_asked_for_runs_an_int8_trunk_whose_gate_fails_and_says_so(int8_calibrated):
    choice = choose(int8_calibrated.prefix, device=_cpu(ZEN3), precision="int8",
                    runtime="openvino", int8_dir=int8_calibrated.cache_dir,
                    heads=Heads(x=0.5))
    assert choice.precision == "int8" and choice.int8_artifact is not None
    assert choice.why.startswith("int8: asked for, although the INT8 trunk's gate fails for "
                                 "head 'x' (agreement 50.00 % < 99 %)")


def test_auto_takes_the_newest_int8_trunk_whose_gate_passes_for_the_heads(int8_calibrated,
                                                                         tmp_path):
    prefix, model = int8_calibrated.prefix, int8_calibrated.made["int8"]
    older = q.Int8Artifact(tmp_path, prefix=prefix, calibration="older")
    save_artifact(older, model, mean_cosine=0.9999)
    newer = q.Int8Artifact(tmp_path, prefix=prefix, calibration="newer")
    meta = save_artifact(newer, model, mean_cosine=0.9999)
    meta["calibration"]["date"] = "9999-01-01T00:00:00Z"  # newer by its date
    newer.meta_path.write_text(json.dumps(meta))

    class FailsOnNewer(Heads):
        def __call__(self, artifact):
            super().__call__(artifact)
            return {"x": 0.5 if artifact.key == newer.key else 1.0}

    heads = FailsOnNewer()
    choice = choose(prefix, device=_cpu(ZEN3), precision="auto", runtime="openvino",
                    int8_dir=tmp_path, heads=heads)
    assert choice.int8_artifact.key == older.key and heads.asked == [newer.key, older.key]


@pytest.mark.parametrize("precision, runtime, why", [
    ("fp32", "openvino", "fp32: asked for"),
    ("auto", "tf", "fp32: the fastest TensorFlow runs here (it runs no INT8 trunk)"),
])
def test_no_int8_trunk_is_judged_where_none_is_looked_up(int8_calibrated, precision, runtime,
                                                         why):
    heads = Heads(x=0.5)
    choice = choose(int8_calibrated.prefix, device=_cpu(ZEN3), precision=precision,
                    runtime=runtime, int8_dir=int8_calibrated.cache_dir, heads=heads)
    assert (choice.why, choice.gate, choice.judged, heads.asked) == (why, None, None, [])


def test_auto_without_an_int8_trunk_says_how_to_make_one(int8_calibrated, tmp_path):
    choice = choose(int8_calibrated.prefix, device=_cpu(ZEN3), precision="auto",
                    runtime="openvino", int8_dir=tmp_path, heads=Heads())
    assert choice.why == ("fp32: no INT8 trunk calibrated for this checkpoint (`multihead "
                          "quantize --images DIR`)")


def test_the_trunk_logs_its_choice_and_keeps_it(int8_calibrated, caplog):
    """`Trunk.from_checkpoint` asks the heads, logs the precision and why, and keeps the
    choice (a pure-numpy runner declaring the INT8 trunk stands in for OpenVINO: the subject
    is the choice, not the load)."""
    import logging
    from dataclasses import replace

    from backbone.runners import registry
    from backbone.runners.registry import INT8_TRUNK, Needs
    from tests.backbone.helpers import FAKE, FakeRunner

    runs_int8 = replace(FAKE, precisions={**FAKE.precisions, "int8": Needs(artifact=INT8_TRUNK)})
    with registry.registered(runs_int8, FakeRunner), caplog.at_level(logging.INFO,
                                                                     logger="backbone.trunk"):
        trunk = Trunk.from_checkpoint(int8_calibrated.prefix, device="cpu", runtime="fake",
                                      precision="auto", warmup_batch_sizes=(),
                                      heads=Heads(x=0.97))
        asked = Trunk.from_checkpoint(int8_calibrated.prefix, device="cpu", runtime="fake",
                                      precision="int8", warmup_batch_sizes=(),
                                      heads=Heads(x=0.97))
    assert trunk.precision == "fp32" and trunk.choice.why.startswith(
        "fp32: the INT8 trunk's gate fails for head 'x' (agreement 97.00 % < 99 %)")
    assert asked.precision == "int8"
    lines = [(r.levelname, r.getMessage()) for r in caplog.records
             if r.getMessage().startswith("precision ")]
    assert lines == [("INFO", f"precision {trunk.choice.why}"),
                     ("WARNING", f"precision {asked.choice.why}")]
    trunk.close()
    asked.close()


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
