"""What runs where: the `Device` (detected with injected CPU flags and GPU lists), the precision
and runtime rules that read it, and the runner each runtime names. No trunk is built here."""
from __future__ import annotations

import subprocess
import sys

import pytest

from backbone import (
    Device,
    Int8ArtifactMissing,
    PrecisionUnsupported,
    RuntimeUnavailable,
    detect_device,
)
from backbone.device import cpu_device_if_known, cpu_flags, maybe_has_gpu
from backbone.precision import (
    INT8_FAILING,
    INT8_NONE,
    INT8_PASSING,
    RUNTIMES,
    float_layers_precision,
    resolve_precision,
    resolve_runtime,
)
from backbone.runners import RUNNERS, OpenVinoRunner, TfRunner, runner_class

# The runtimes installed, with and without the openvino extra.
WITH_OPENVINO, WITHOUT_OPENVINO = frozenset({"tf", "openvino"}), frozenset({"tf"})

ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n"
ZEN4 = "flags\t\t: avx2 avx512f avx512_bf16 avx512_vnni\n"


def cpu(cpuinfo: str) -> Device:
    return detect_device("cpu", flags=cpu_flags(cpuinfo))


def gpu(cpuinfo: str = ZEN3) -> Device:
    return detect_device("auto", flags=cpu_flags(cpuinfo), gpus=["/physical_device:GPU:0"])


# --- the Device, detected with injected hardware ----------------------------------------------

def test_cpu_flags_parse_proc_cpuinfo():
    assert cpu_flags(ZEN3) == {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}
    assert cpu_flags("model name : x\n") == frozenset()
    assert cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}  # arm64


@pytest.mark.parametrize("cpuinfo, bf16, amx, avx512", [
    (ZEN3, False, False, False),
    (ZEN4, True, False, True),
    (SAPPHIRE_RAPIDS, True, True, True),
])
def test_cpu_device_reports_its_flags(cpuinfo, bf16, amx, avx512):
    device = cpu(cpuinfo)
    assert (device.kind, device.name, device.is_gpu) == ("cpu", "/CPU", False)
    assert (device.bf16, device.amx, device.avx512) == (bf16, amx, avx512)
    assert Device("cpu", "/CPU:0", frozenset({"amx_bf16"})).bf16


@pytest.mark.parametrize("requested, gpus, kind, name", [
    ("auto", ["/physical_device:GPU:0"], "gpu", "/GPU:0"),
    ("auto", [], "cpu", "/CPU:0"),
    ("gpu:1", ["/physical_device:GPU:0", "/physical_device:GPU:1"], "gpu", "/GPU:1"),
    ("/device:GPU:0", ["/physical_device:GPU:0"], "gpu", "/GPU:0"),
    ("cpu", ["/physical_device:GPU:0"], "cpu", "/CPU"),  # asked for: a GPU present or not
    ("cpu:0", [], "cpu", "/CPU:0"),
])
def test_device_detection_with_a_gpu_list(requested, gpus, kind, name):
    device = detect_device(requested, flags=cpu_flags(ZEN4), gpus=gpus)
    assert (device.kind, device.name) == (kind, name)
    assert device.bf16  # the host CPU's flags, on a GPU host too


def test_a_gpu_asked_for_and_none_seen_is_refused():
    from backbone import CheckpointError

    with pytest.raises(CheckpointError, match="'/GPU:0' requested but TensorFlow sees no GPU"):
        detect_device("gpu:0", flags=frozenset(), gpus=[])


def test_a_device_passes_through_detection():
    device = Device("gpu", "/GPU:3", frozenset({"avx2"}))
    assert detect_device(device) is device


@pytest.mark.skipif(maybe_has_gpu(), reason="a GPU driver is present")
def test_a_cpu_only_machine_is_known_without_tensorflow():
    code = ("import sys; from backbone import detect_device; d = detect_device('auto'); "
            "print(d.kind, d.name, 'tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu", "/CPU:0", "False"]
    assert cpu_device_if_known("auto", flags={"avx2"}) == Device("cpu", "/CPU:0",
                                                                 frozenset({"avx2"}))


def test_a_gpu_request_is_never_known_without_tensorflow():
    assert cpu_device_if_known("gpu", flags=frozenset()) is None
    assert cpu_device_if_known("cpu", flags=frozenset()).name == "/CPU"


# --- precision and runtime, by the Device ---------------------------------------------------------

@pytest.mark.parametrize("requested, device, want", [
    ("auto", cpu(ZEN3), "fp32"),
    ("auto", cpu(ZEN4), "bf16"),
    ("auto", cpu(SAPPHIRE_RAPIDS), "bf16"),
    ("auto", gpu(ZEN3), "fp16"),
    ("auto", gpu(ZEN4), "fp16"),
    ("fp32", cpu(ZEN3), "fp32"),
    ("fp32", gpu(ZEN4), "fp32"),
    ("bf16", cpu(ZEN4), "bf16"),
    ("BF16", cpu(SAPPHIRE_RAPIDS), "bf16"),
    ("fp16", gpu(ZEN3), "fp16"),
])
def test_precision_resolution(requested, device, want):
    assert resolve_precision(requested, device=device) == want


@pytest.mark.parametrize("requested, device, match", [
    ("bf16", cpu(ZEN3), "avx512_bf16 or amx_bf16"),
    ("fp16", cpu(ZEN4), "needs a GPU"),
    ("fp16", cpu(ZEN3), "needs a GPU"),
    ("bf16", gpu(ZEN4), "use 'fp16'"),
])
def test_unsupported_precision_is_refused_not_emulated(requested, device, match):
    with pytest.raises(PrecisionUnsupported, match=match) as err:
        resolve_precision(requested, device=device)
    assert "\n" not in str(err.value)


# (requested, device, runtime, INT8 trunks for the checkpoint) -> precision: the rules of int8
# and of `auto` with the CPU's flags injected (Zen 3: AVX2 only; Zen 4 and Sapphire Rapids:
# bf16), with and without a calibrated INT8 trunk.
@pytest.mark.parametrize("requested, device, runtime, int8, want", [
    ("auto", cpu(ZEN3), "openvino", INT8_PASSING, "int8"),
    ("auto", cpu(SAPPHIRE_RAPIDS), "openvino", INT8_PASSING, "int8"),  # int8 before bf16
    ("auto", cpu(ZEN4), "openvino", INT8_FAILING, "bf16"),  # a forced one: never by auto
    ("auto", cpu(ZEN3), "openvino", INT8_FAILING, "fp32"),
    ("auto", cpu(ZEN4), "openvino", INT8_NONE, "bf16"),
    ("auto", cpu(ZEN3), "openvino", INT8_NONE, "fp32"),
    ("auto", cpu(ZEN3), "tf", INT8_PASSING, "fp32"),  # TF runs no int8
    ("auto", cpu(SAPPHIRE_RAPIDS), "tf", INT8_PASSING, "bf16"),
    ("auto", gpu(ZEN4), "tf", INT8_PASSING, "fp16"),
    ("int8", cpu(ZEN3), "openvino", INT8_PASSING, "int8"),
    ("INT8", cpu(ZEN4), "openvino", INT8_FAILING, "int8"),  # asked for: a forced one runs
    ("fp32", cpu(ZEN3), "openvino", INT8_PASSING, "fp32"),
    ("bf16", cpu(ZEN4), "openvino", INT8_PASSING, "bf16"),
])
def test_int8_and_auto_by_runtime_and_int8_trunk(requested, device, runtime, int8, want):
    assert resolve_precision(requested, device=device, runtime=runtime, int8=int8) == want


@pytest.mark.parametrize("device, runtime, int8, error, match", [
    (cpu(ZEN3), "openvino", INT8_NONE, Int8ArtifactMissing,
     r"none: make one with `multihead quantize --images DIR`"),
    (cpu(ZEN3), "tf", INT8_PASSING, PrecisionUnsupported, "'int8' runs on OpenVINO"),
    (gpu(ZEN4), "tf", INT8_PASSING, PrecisionUnsupported, "OpenVINO's CPU plugin"),
])
def test_int8_refusals_are_one_line(device, runtime, int8, error, match):
    with pytest.raises(error, match=match) as err:
        resolve_precision("int8", device=device, runtime=runtime, int8=int8)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("cpuinfo, want", [(ZEN3, "fp32"), (ZEN4, "bf16"),
                                           (SAPPHIRE_RAPIDS, "bf16")])
def test_the_float_layers_of_an_int8_trunk_are_bf16_where_the_cpu_has_it(cpuinfo, want):
    assert float_layers_precision(cpu(cpuinfo)) == want


def test_unknown_precision_and_runtime_names():
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("int4", device=cpu(ZEN3))
    with pytest.raises(ValueError, match="runtime must be one of"):
        resolve_runtime("onnx", device=cpu(ZEN3), available=WITH_OPENVINO)


@pytest.mark.parametrize("requested, device, installed, want", [
    ("auto", cpu(ZEN3), WITH_OPENVINO, "openvino"),
    ("auto", cpu(ZEN3), WITHOUT_OPENVINO, "tf"),
    ("auto", gpu(), WITH_OPENVINO, "tf"),
    ("tf", cpu(ZEN3), WITH_OPENVINO, "tf"),
    ("openvino", cpu(ZEN3), WITH_OPENVINO, "openvino"),
])
def test_runtime_resolution(requested, device, installed, want):
    assert resolve_runtime(requested, device=device, available=installed) == want


@pytest.mark.parametrize("device, installed, match", [
    (gpu(), WITH_OPENVINO, "CPU only"),
    (cpu(ZEN3), WITHOUT_OPENVINO, "needs the openvino package"),
])
def test_unavailable_runtime_is_refused(device, installed, match):
    with pytest.raises(RuntimeUnavailable, match=match):
        resolve_runtime("openvino", device=device, available=installed)


# --- the runner each runtime names ----------------------------------------------------------------

@pytest.mark.parametrize("device, installed, want", [
    (cpu(ZEN3), WITH_OPENVINO, OpenVinoRunner),
    (cpu(ZEN3), WITHOUT_OPENVINO, TfRunner),
    (gpu(), WITH_OPENVINO, TfRunner),
])
def test_auto_runtime_selects_a_runner(device, installed, want):
    assert runner_class(resolve_runtime("auto", device=device, available=installed)) is want


def test_every_runtime_has_a_runner():
    assert set(RUNNERS) == set(RUNTIMES)
    with pytest.raises(ValueError, match="no runner for runtime 'onnx'"):
        runner_class("onnx")


def test_import_backbone_loads_neither_tensorflow_nor_openvino():
    code = ("import sys, backbone, backbone.trunk, backbone.precision, backbone.runners; "
            "print('tensorflow' in sys.modules, 'openvino' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
