"""Every runner x precision of the trunk: refusals, what it reports, and fidelity bounds.

The rules that choose them, with fake devices, are in test_device.py. Every runtime x precision
this machine can run is held to a bound against the TF fp32 trunk (the session's `trunk`), on
the same 16 structured images:
  - fp32 runtimes: max |diff| <= 1e-4 x max(1, max |reference|). Both sides compute the same
    float32 net; only the summation order of ~12 G multiply-adds differs, which moves features
    of order 1 by ~1e-6 (measured 2e-6 for OpenVINO). The bound is relative to the feature
    scale so that real weights (features up to ~10) and seeded ones are held alike.
  - bf16 (bf16 matmuls/convs, fp32 accumulation): min cosine >= 0.9999 per image.
  - a random 100-way head agrees on top-1 for >= 99 % of the images (all 16 here).
Each extra trunk is built once per module; tests assert bounds, never timings.
"""
from __future__ import annotations

import numpy as np
import pytest

from backbone import PrecisionUnsupported, Trunk, detect_device, preprocess
from backbone.errors import BackboneError
from backbone.precision import resolve_precision, resolve_runtime
from backbone.runners import RUNNERS
from backbone.runners.registry import SPECS, available
from backbone.runners.tf import session_config
from tests.backbone.helpers import (
    concurrent_features,
    copy_graphs,
    encode,
    graph_cache_of,
    pattern,
)

HAS_BF16 = detect_device("cpu").bf16
HAS_OPENVINO = "openvino" in available()
NO_BF16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has neither avx512_bf16 nor amx_bf16")
NO_OPENVINO = pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")

FP32_TOLERANCE = 1e-4
BF16_MIN_COSINE = 0.9999
TOP1_AGREEMENT = 0.99



def _variants() -> list:
    """(runtime, precision) of every float precision a registered runner declares on the CPU,
    besides the reference tf/fp32 one (int8 is test_int8.py's), each skipped where this machine
    cannot run it (the reason is the refusal's message): a new runner is held to the bounds."""
    cpu = detect_device("cpu")
    out = []
    for runtime, spec in SPECS.items():
        for precision, needs in spec.precisions.items():
            if ((runtime, precision) == ("tf", "fp32") or needs.artifact
                    or not spec.runs_on("cpu") or needs.device not in (None, "cpu")):
                continue
            try:
                resolve_runtime(runtime, device=cpu, available=available())
                resolve_precision(precision, device=cpu, runtime=runtime)
                why_not = ""
            except BackboneError as exc:
                why_not = str(exc)
            out.append(pytest.param((runtime, precision), id=f"{runtime}-{precision}",
                                    marks=pytest.mark.skipif(bool(why_not), reason=why_not)))
    return out


VARIANTS = _variants()


# --- refusals at build, and what a trunk reports -------------------------------------------

def test_session_config_per_precision():
    from tensorflow.core.protobuf import rewriter_config_pb2

    on, default = rewriter_config_pb2.RewriterConfig.ON, rewriter_config_pb2.RewriterConfig.DEFAULT
    fp32 = session_config("fp32", 2, 1)
    assert fp32.intra_op_parallelism_threads == 2 and fp32.inter_op_parallelism_threads == 1
    assert fp32.allow_soft_placement and fp32.gpu_options.allow_growth
    rewrite = fp32.graph_options.rewrite_options
    assert rewrite.auto_mixed_precision_onednn_bfloat16 == default
    assert rewrite.auto_mixed_precision == default

    bf16 = session_config("bf16").graph_options.rewrite_options
    assert bf16.auto_mixed_precision_onednn_bfloat16 == on
    assert bf16.auto_mixed_precision == default

    fp16 = session_config("fp16").graph_options.rewrite_options
    assert fp16.auto_mixed_precision == on  # TF's CUDA fp16 rewriter
    assert fp16.auto_mixed_precision_onednn_bfloat16 == default
    assert fp16.auto_mixed_precision_cpu == default  # never the CPU fp16 emulation
    with pytest.raises(ValueError):
        session_config("auto")


def test_fp16_on_the_cpu_is_refused_before_any_build(trunk_checkpoint):
    with pytest.raises(PrecisionUnsupported, match="fp16"):
        Trunk.from_checkpoint(trunk_checkpoint, device="cpu", precision="fp16")


@pytest.mark.skipif(HAS_BF16, reason="this CPU has native bf16")
def test_bf16_on_a_cpu_without_it_is_refused(trunk_checkpoint):
    for runtime in ("tf", "openvino") if HAS_OPENVINO else ("tf",):
        with pytest.raises(PrecisionUnsupported, match="avx512_bf16"):
            Trunk.from_checkpoint(trunk_checkpoint, device="cpu", precision="bf16",
                                  runtime=runtime)


def test_default_trunk_reports_tf_fp32(trunk):
    assert (trunk.runtime, trunk.precision) == ("tf", "fp32")


# --- fidelity of every runtime x precision against TF fp32 ------------------------------------

@pytest.fixture(scope="module")
def images():
    """Sixteen structured images, preprocessed: [16, 299, 299, 3]."""
    return np.stack([preprocess(encode(pattern(100 + seed))) for seed in range(16)])


@pytest.fixture(scope="module")
def reference(trunk, images):
    """TF fp32 features of the images: [16, 1536]."""
    return np.concatenate([trunk.features(images[i:i + 8]) for i in (0, 8)])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, trunk, trunk_checkpoint):
    """This module's cache directory, seeded with the graph the session trunk saved (same
    layout, with the Logits layer): the variants import it; compiled models are this module's."""
    return copy_graphs(graph_cache_of(trunk_checkpoint), tmp_path_factory.mktemp("trunk_cache"))


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request, trunk_checkpoint, cache_dir):
    """A trunk per (runtime, precision), built once, with the Logits layer and a cache dir."""
    runtime, precision = request.param
    built = Trunk.from_checkpoint(trunk_checkpoint, device="cpu", runtime=runtime,
                                  precision=precision, with_logits=True,
                                  graph_cache_dir=cache_dir)
    yield built
    built.close()


@pytest.fixture(scope="module")
def variant_features(variant, images):
    """The variant's features of the images, in two batches of 8: [16, 1536]."""
    return np.concatenate([variant.features(images[i:i + 8]) for i in (0, 8)])


def _cosines(got, want):  # [N]
    return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


def assert_faithful(precision: str, got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.isfinite(got).all()
    if precision == "fp32":
        bound = FP32_TOLERANCE * max(1.0, float(np.abs(want).max()))
        assert float(np.abs(got - want).max()) <= bound
    else:
        assert float(_cosines(got, want).min()) >= BF16_MIN_COSINE


def test_variant_reports_what_it_runs(variant):
    assert variant.device.startswith("/CPU") and variant.hardware.kind == "cpu"
    assert variant.runtime in ("tf", "openvino") and variant.precision in ("fp32", "bf16")
    assert type(variant.runner) is RUNNERS[variant.runtime]
    assert variant.runner.info.precision == variant.precision
    assert variant.variables[:596] and variant.num_classes == 1001


def test_features_within_bound_of_tf_fp32(variant, variant_features, reference):
    assert_faithful(variant.precision, variant_features, reference)


def test_random_head_top1_agrees(variant_features, reference):
    got = variant_features
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((1536, 100)).astype(np.float32) / np.float32(np.sqrt(1536))
    biases = rng.standard_normal(100).astype(np.float32) * np.float32(0.1)
    agree = ((got @ weights + biases).argmax(1) == (reference @ weights + biases).argmax(1))
    assert agree.mean() >= TOP1_AGREEMENT


def test_logits_are_the_checkpoint_layer(variant, trunk, images):
    features, logits = variant.features_and_logits(images[:2])
    want_features, want_logits = trunk.features_and_logits(images[:2])
    assert logits.shape == (2, 1001) and logits.dtype == np.float32
    assert_faithful(variant.precision, features, want_features)
    assert_faithful(variant.precision, logits, want_logits)


def test_batch_invariance(variant, images):
    batch = variant.features(images[:4])
    alone = variant.features(images[3:4])
    assert_faithful(variant.precision, alone, batch[3:4])


def test_concurrent_calls_equal_serial_calls(variant, images):
    batches = [images[2 * i:2 * i + 2] for i in range(4)]
    serial = [variant.features(batch) for batch in batches]
    for got, want in zip(concurrent_features(variant, batches), serial):
        assert_faithful("fp32", got, want)  # same runtime, same precision: run to run equal


def test_closed_variant_refuses(trunk_checkpoint, variant, cache_dir, images):
    # A fresh instance (from the module's cache: cheap), not the shared one.
    # NOTE: with_logits as the variant was built, or the cached graph/compiled model is not it.
    other = Trunk.from_checkpoint(trunk_checkpoint, device="cpu", runtime=variant.runtime,
                                  precision=variant.precision, warmup_batch_sizes=(),
                                  with_logits=True, graph_cache_dir=cache_dir)
    other.close()
    other.close()
    with pytest.raises(RuntimeError, match="closed"):
        other.features(images[:1])


# --- the compiled-model cache -----------------------------------------------------------------

@NO_OPENVINO
@pytest.mark.parametrize("precision", [
    "fp32", pytest.param("bf16", marks=NO_BF16)])
def test_openvino_restart_imports_the_compiled_trunk(trunk_checkpoint, cache_dir, images,
                                                     reference, precision):
    """A second start with the same cache dir imports the compiled model: no build, no restore,
    no conversion; same features. (The module's variant trunk wrote the entry.)"""
    first = Trunk.from_checkpoint(trunk_checkpoint, device="cpu", runtime="openvino",
                                  precision=precision, with_logits=True,
                                  graph_cache_dir=cache_dir)
    second = Trunk.from_checkpoint(trunk_checkpoint, device="cpu", runtime="openvino",
                                   precision=precision, with_logits=True,
                                   graph_cache_dir=cache_dir)
    try:
        assert list(cache_dir.glob("inception_v4-ov-*.blob"))
        assert second.compiled_from_cache and second.graph_from_cache
        assert second.timings.build_s == 0 and second.timings.restore_s == 0
        assert second.variables == first.variables and second.end_points == first.end_points
        assert second.num_classes == 1001
        np.testing.assert_array_equal(second.features(images[:2]), first.features(images[:2]))
        assert_faithful(precision, second.features(images[:2]), reference[:2])
    finally:
        first.close()
        second.close()


@NO_OPENVINO
def test_compiled_cache_key_follows_the_weights_and_precision(tmp_path, trunk_checkpoint):
    from backbone.runners.openvino import CompiledCache, checkpoint_fingerprint

    base = CompiledCache(tmp_path, prefix=trunk_checkpoint, precision="fp32", with_logits=False)
    assert base.path == CompiledCache(tmp_path, prefix=trunk_checkpoint, precision="fp32",
                                      with_logits=False).path
    assert base.path != CompiledCache(tmp_path, prefix=trunk_checkpoint, precision="bf16",
                                      with_logits=False).path
    assert base.path != CompiledCache(tmp_path, prefix=trunk_checkpoint, precision="fp32",
                                      with_logits=True).path
    # V2: the index (a crc32c per tensor) names the content; V1: the bytes themselves.
    (tmp_path / "a.ckpt.index").write_bytes(b"index one")
    (tmp_path / "a.ckpt.data-00000-of-00001").write_bytes(b"x" * 10)
    first = checkpoint_fingerprint(str(tmp_path / "a.ckpt"))
    (tmp_path / "a.ckpt.index").write_bytes(b"index two")
    assert checkpoint_fingerprint(str(tmp_path / "a.ckpt")) != first
    (tmp_path / "v1.ckpt").write_bytes(b"weights one")
    v1 = checkpoint_fingerprint(str(tmp_path / "v1.ckpt"))
    (tmp_path / "v1.ckpt").write_bytes(b"weights two")
    assert checkpoint_fingerprint(str(tmp_path / "v1.ckpt")) != v1


@NO_OPENVINO
def test_corrupt_compiled_cache_entry_is_ignored(tmp_path, trunk_checkpoint):
    from backbone.runners.openvino import CompiledCache

    cache = CompiledCache(tmp_path, prefix=trunk_checkpoint, precision="fp32", with_logits=False)
    cache.path.write_bytes(b"garbage")
    cache.meta_path.write_text("{}")
    assert cache.load("fp32") is None and not cache.hit
