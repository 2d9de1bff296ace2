"""The runner registry: a fake runner registered here, and nowhere else, is chosen, benched and
listed. Every list of runtimes is derived from the registry, so a place that named the runtimes
by hand again would miss the fake and fail here.

The fake (`tests.backbone.helpers.FakeRunner`) is pure numpy: deterministic features, no TensorFlow, no weights (the
checkpoint prefix is the session's, only checked to exist). It is registered for one test at a
time (`registry.registered`) and gone afterwards.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from backbone import Device, PrecisionUnsupported, RuntimeUnavailable, Trunk
from backbone.precision import (
    INT8_NONE,
    INT8_PASSING,
    PRECISION_CHOICES,
    RUNTIME_CHOICES,
    RUNTIMES,
    combinations,
    resolve_precision,
    resolve_runtime,
    runtime_help,
)
from backbone.runners import registry
from backbone.runners.base import LoadRequest
from backbone.runners.registry import (
    ANYWHERE,
    GPU_ONLY,
    INT8_TRUNK,
    Needs,
    RunnerSpec,
)
from backbone.spec import FEATURE_DIM, IMAGE_SIZE
from tests.backbone.helpers import FAKE, FakeRunner


@pytest.fixture
def fake():
    with registry.registered(FAKE, FakeRunner) as spec:
        yield spec


@pytest.fixture
def fake_first():
    with registry.registered(replace(FAKE, rank=0), FakeRunner) as spec:
        yield spec


def images(n: int = 4) -> np.ndarray:
    return np.random.default_rng(1).uniform(-1, 1, (n, IMAGE_SIZE, IMAGE_SIZE, 3)).astype(
        np.float32)


# -- chosen ------------------------------------------------------------------------------------

def test_the_fake_is_chosen_by_name(fake, trunk_checkpoint):
    trunk = Trunk.from_checkpoint(trunk_checkpoint, device="cpu", runtime="fake",
                                  precision="auto")
    try:
        assert type(trunk.runner) is FakeRunner
        assert (trunk.runtime, trunk.precision, trunk.float_precision) == ("fake", "fp32", None)
        batch = images()
        features = trunk.features(batch)
        assert features.shape == (4, FEATURE_DIM) and features.dtype == np.float32
        np.testing.assert_array_equal(trunk.features(batch[1:2]), features[1:2])
        assert not np.allclose(features[0], features[1])
    finally:
        trunk.close()
    assert trunk.runner.closed


def test_auto_chooses_the_fake_only_when_it_ranks_first(trunk_checkpoint, fake_first):
    trunk = Trunk.from_checkpoint(trunk_checkpoint, device="cpu", runtime="auto",
                                  precision="auto", warmup_batch_sizes=())
    try:
        assert (type(trunk.runner), trunk.runtime, trunk.precision) == (FakeRunner, "fake",
                                                                        "fp32")
    finally:
        trunk.close()


def test_auto_does_not_choose_a_fake_ranked_last(fake):
    cpu = Device("cpu", "/CPU:0", frozenset())
    assert resolve_runtime("auto", device=cpu, available=registry.available()) != "fake"
    assert registry.ranked()[-1] is fake


def test_the_fake_is_gone_after_its_registration(trunk_checkpoint):
    with registry.registered(FAKE, FakeRunner):
        assert "fake" in RUNTIMES
    assert "fake" not in RUNTIMES and "fake" not in RUNTIME_CHOICES
    with pytest.raises(ValueError, match="runtime must be one of tf, openvino, auto"):
        Trunk.from_checkpoint(trunk_checkpoint, device="cpu", runtime="fake")


# -- benched -----------------------------------------------------------------------------------

def test_the_bench_lists_and_measures_the_fake(fake, trunk_checkpoint, tmp_path):
    from bench.context import Context
    from bench.plan import Plan
    from bench.sections import trunk as section

    combos = section.combinations({})
    assert ("fake", "fp32") in combos and ("tf", "fp32") not in combos  # TF fp32: the reference
    context = Context(Plan(trunk_runs=2), out_dir=tmp_path / "out", tmp=tmp_path,
                      prefix=trunk_checkpoint)
    batch = images(4)
    reference = FakeRunner(LoadRequest(trunk_checkpoint, Device("cpu", "/CPU:0"))).features(
        batch[:8])
    measured = section.measure_runtimes(context, batch, (1, 4), reference, [("fake", "fp32")])
    entry = measured["fake-fp32"]
    assert "error" not in entry, entry
    assert [b["batch_size"] for b in entry["batches"]] == [1, 4]
    assert entry["min_cosine"] == pytest.approx(1.0) and entry["images_per_s_b1"] > 0
    text = section.render(section.TrunkResult(batches=entry["batches"],
                                              runtimes={"fake-fp32": entry}, bf16_cpu=False), {})
    assert "| fake-fp32 |" in text


# -- listed and accepted -----------------------------------------------------------------------

def test_settings_help_and_serve_accept_the_fake(fake, trunk_checkpoint, capsys):
    from cli.main import build_parser, main
    from cli.serve import check_precision_and_runtime
    from service.core.setting_fields import InvalidSettings
    from service.core.settings import Settings

    assert Settings(runtime="fake").runtime == "fake"
    assert "fake" in Settings.field_of("runtime").metadata["choices"]
    settings = Settings.from_env_and_args(
        build_parser().parse_args(["serve", "--runtime", "fake", "--precision", "fp32"]),
        environ={})
    assert (settings.runtime, settings.precision) == ("fake", "fp32")
    env = Settings.from_env_and_args(None, environ={"MULTIHEAD_RUNTIME": "fake"})
    assert env.runtime == "fake"
    check_precision_and_runtime(settings, trunk_checkpoint)  # `serve`'s start check
    for command in ("serve", "train", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "{tf,openvino,fake,auto}" in capsys.readouterr().out, command
    with pytest.raises(InvalidSettings, match="runtime must be one of tf, openvino, fake, auto"):
        Settings(runtime="onnx")


def test_the_demo_follows_the_fake():
    from cli.demo_setup import int8_runtimes, int8_wanted

    assert int8_wanted({"precision": "auto", "runtime": "tf"}) == "the trunk runs on TensorFlow"
    with registry.registered(FAKE, FakeRunner):
        assert int8_wanted({"precision": "auto", "runtime": "fake"}) == "the trunk runs on Fake"
    # A fake that runs the INT8 trunk: the demo calibrates one for it, and says so in --help.
    runs_int8 = replace(FAKE, precisions={"fp32": ANYWHERE, "int8": Needs(artifact=INT8_TRUNK)})
    with registry.registered(runs_int8, FakeRunner):
        assert int8_runtimes() == "OpenVINO or Fake"
        if int8_wanted({"runtime": "fake"}) is not None:  # only where NNCF is missing
            assert int8_wanted({"runtime": "fake"}).startswith("NNCF is not installed")


# -- the rules read the declarations (pure: declarations passed in, nothing registered) ---------

ZEN3 = Device("cpu", "/CPU:0", frozenset({"avx2"}))
GPU = Device("gpu", "/GPU:0", frozenset({"avx2"}))
# A GPU-only runner with a precision of its own (fp8) that would run the same INT8 trunk.
TRT = RunnerSpec(name="trt", title="TensorRT", devices=("gpu",), packages=("tensorrt",),
                 extra="tensorrt", rank=5,
                 precisions={"fp32": ANYWHERE, "fp16": GPU_ONLY, "fp8": GPU_ONLY,
                             "int8": Needs(artifact=INT8_TRUNK)})


def with_trt() -> dict[str, RunnerSpec]:
    return {**registry.SPECS, "trt": TRT}


@pytest.mark.parametrize("requested, device, installed, want", [
    ("auto", GPU, {"tf", "trt"}, "trt"),  # rank 5 first, where it runs
    ("auto", GPU, {"tf"}, "tf"),  # not installed
    ("auto", ZEN3, {"tf", "openvino", "trt"}, "openvino"),  # GPU only
])
def test_runtime_rules_read_devices_packages_and_rank(requested, device, installed, want):
    assert resolve_runtime(requested, device=device, available=installed,
                           runners=with_trt()) == want


def test_runtime_refusals_name_what_is_declared():
    with pytest.raises(RuntimeUnavailable, match=r"^runtime 'trt' runs the trunk on the GPU "
                       r"only, not on /CPU:0: use runtime 'tf' or 'openvino' or device 'gpu'$"):
        resolve_runtime("trt", device=ZEN3, available={"tf", "openvino", "trt"},
                        runners=with_trt())
    with pytest.raises(RuntimeUnavailable, match=r"needs the tensorrt package \(pip install "
                       r"'multihead\[tensorrt\]'\): use runtime 'tf'$"):
        resolve_runtime("trt", device=GPU, available={"tf"}, runners=with_trt())


@pytest.mark.parametrize("requested, runtime, int8, want", [
    ("auto", "trt", INT8_NONE, "fp16"),
    ("fp8", "trt", INT8_NONE, "fp8"),  # a precision only it declares is a choice
    ("int8", "trt", INT8_PASSING, "int8"),
])
def test_precision_rules_read_what_each_runner_declares(requested, runtime, int8, want):
    assert resolve_precision(requested, device=GPU, runtime=runtime, int8=int8,
                             runners=with_trt()) == want


def test_a_precision_of_another_runtime_is_refused_naming_it():
    with pytest.raises(PrecisionUnsupported, match=r"^precision 'fp8' runs on TensorRT, not on "
                       r"runtime 'tf': use runtime 'trt' or 'auto' \(needs the tensorrt extra\)$"):
        resolve_precision("fp8", device=GPU, runtime="tf", runners=with_trt())
    # The INT8 trunk now runs on a GPU too: on TF there, the refusal names TensorRT.
    with pytest.raises(PrecisionUnsupported, match="runs on TensorRT, not on runtime 'tf'"):
        resolve_precision("int8", device=GPU, runtime="tf", int8=INT8_PASSING,
                          runners=with_trt())


def test_combinations_and_help_follow_the_declarations():
    runners = with_trt()
    assert ("trt", "fp8") in combinations(device=GPU, available={"tf", "trt"}, runners=runners)
    assert not [c for c in combinations(device=ZEN3, available={"tf", "openvino", "trt"},
                                        runners=runners) if c[0] == "trt"]
    assert "trt (GPU; needs the tensorrt extra)" in runtime_help(runners)
    assert "auto = trt on a GPU when installed, openvino on a CPU when installed, else tf" in \
        runtime_help(runners)


# -- the registry itself -----------------------------------------------------------------------

def test_a_name_registers_once_and_auto_never(fake):
    with pytest.raises(ValueError, match="'fake' is registered already"):
        registry.add(FAKE, FakeRunner)
    with pytest.raises(ValueError, match="'auto'"):
        registry.add(replace(FAKE, name="auto"), FakeRunner)
    with pytest.raises(TypeError, match="not a Runner"):
        registry.add(replace(FAKE, name="other"), object)


def test_a_declaration_is_checked():
    with pytest.raises(ValueError, match="devices"):
        RunnerSpec(name="x", title="X", devices=("tpu",), precisions={"fp32": ANYWHERE})
    with pytest.raises(ValueError, match="no precision"):
        RunnerSpec(name="x", title="X", precisions={})
    with pytest.raises(ValueError, match="device must be"):
        Needs(device="tpu")


def test_the_choices_are_live_views():
    assert list(RUNTIME_CHOICES) == ["tf", "openvino", "auto"]
    assert list(PRECISION_CHOICES) == ["fp32", "bf16", "fp16", "int8", "auto"]
    with registry.registered(replace(FAKE, precisions={"fp32": ANYWHERE, "fp8": GPU_ONLY}),
                             FakeRunner):
        assert list(RUNTIME_CHOICES) == ["tf", "openvino", "fake", "auto"]
        assert "fp8" in PRECISION_CHOICES
    assert "fp8" not in PRECISION_CHOICES


def test_the_built_in_runners_declare_what_the_rules_said_by_hand():
    tf, openvino = registry.spec("tf"), registry.spec("openvino")
    assert list(registry.SPECS) == ["tf", "openvino"]  # the order of every list
    assert [s.name for s in registry.ranked()] == ["openvino", "tf"]  # auto's order
    assert (tf.devices, openvino.devices) == (("cpu", "gpu"), ("cpu",))
    assert list(tf.precisions) == ["fp32", "bf16", "fp16"]
    assert list(openvino.precisions) == ["fp32", "bf16", "int8"]
    assert (tf.artifacts, openvino.artifacts) == ((), (INT8_TRUNK,))
    assert openvino.packages == ("openvino",) and openvino.extra == "openvino"


# -- what a load imports (a start imports it beforehand, and only it) --------------------------

CPU = Device("cpu", "/CPU:0")


def test_a_runtime_loads_with_its_declared_packages_unless_it_says_more(fake, trunk_checkpoint):
    request = LoadRequest(trunk_checkpoint, CPU)
    assert registry.load_imports("fake", request) == ()  # FAKE declares no package
    registry.declare_load_imports("fake", lambda r: ("numpy",))
    assert registry.load_imports("fake", request) == ("numpy",)
    plan = Trunk.plan(trunk_checkpoint, device="cpu", runtime="fake", precision="auto")
    assert plan.packages == ("numpy",) and not plan.needs_tensorflow
    with pytest.raises(ValueError, match="no runner for runtime"):
        registry.declare_load_imports("nowhere", lambda r: ())


def test_a_declaration_goes_with_its_runner(trunk_checkpoint):
    with registry.registered(FAKE, FakeRunner):
        registry.declare_load_imports("fake", lambda r: ("numpy",))
    with registry.registered(FAKE, FakeRunner):
        assert registry.load_imports("fake", LoadRequest(trunk_checkpoint, CPU)) == ()


def test_tensorflow_loads_with_tensorflow(trunk_checkpoint):
    assert registry.load_imports("tf", LoadRequest(trunk_checkpoint, CPU)) == ("tensorflow",)


def test_openvino_needs_tensorflow_only_to_compile(trunk_checkpoint, tmp_path):
    """A compiled model in the cache, or an INT8 trunk (an OpenVINO IR), loads without
    TensorFlow; compiling from the checkpoint restores it with TensorFlow first."""
    pytest.importorskip("openvino")
    from backbone.runners.openvino import CompiledCache

    def packages(**kwargs):
        return registry.load_imports("openvino", LoadRequest(trunk_checkpoint, CPU, **kwargs))

    assert packages() == ("tensorflow", "openvino")  # no cache
    assert packages(cache_dir=tmp_path) == ("tensorflow", "openvino")  # an empty one
    assert packages(precision="int8", cache_dir=tmp_path) == ("openvino",)
    entry = CompiledCache(tmp_path, prefix=trunk_checkpoint, precision="fp32",
                          with_logits=False)
    entry.path.write_bytes(b"compiled")
    assert packages(cache_dir=tmp_path) == ("tensorflow", "openvino")  # no metadata yet
    entry.meta_path.write_text("{}")
    assert packages(cache_dir=tmp_path) == ("openvino",)
    assert packages(cache_dir=tmp_path, precision="bf16") == ("tensorflow", "openvino")
    assert packages(cache_dir=tmp_path, with_logits=True) == ("tensorflow", "openvino")
