"""Which precision and which runtime the trunk runs in: pure resolution rules, no side effects.

Everything here is a function of its inputs (the `Device`, whether OpenVINO is importable,
the resolved runtime, whether an INT8 trunk was calibrated for the checkpoint), so the rules
are unit-tested with fake devices; `Trunk.from_checkpoint` feeds them what it found.

Rules:
  - "fp32" runs everywhere.
  - "bf16" needs a CPU with native bf16 (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo). On a
    CPU without them it is refused, never emulated: OpenVINO silently falls back to f32 there
    (its compiled model reports INFERENCE_PRECISION_HINT f32), and TF's oneDNN rewriter would
    emulate bf16 through slower conversions. On a GPU, TF has no bf16 auto mixed precision
    rewriter (its CUDA one is fp16): refused, use "fp16".
  - "fp16" needs a GPU (TF's CUDA `auto_mixed_precision` rewriter). On the CPU it is refused:
    TF's CPU fp16 path (`auto_mixed_precision_cpu`) only emulates it, for testing.
  - "int8" runs on OpenVINO (so on the CPU) from an INT8 trunk calibrated for this checkpoint
    by `multihead quantize` (`backbone.quantize.Int8Artifact`); without one it is refused,
    naming the command. OpenVINO's CPU plugin runs INT8 on any x86 CPU with AVX2 (VNNI and AMX
    make it faster). The layers NNCF leaves in float run in `float_layers_precision`: bf16
    where the CPU has it, else fp32.
  - "auto": fp16 on a GPU; on the CPU int8 when the runtime is OpenVINO and an INT8 trunk that
    passed its fidelity bounds exists, else bf16 where the CPU has it, else fp32.
  - runtime "openvino" runs on the CPU only (this package compiles for OpenVINO's CPU plugin);
    "auto" picks it on the CPU when `openvino` is importable, else "tf".
"""
from __future__ import annotations

import importlib.util

from backbone.device import Device
from backbone.errors import Int8ArtifactMissing, PrecisionUnsupported, RuntimeUnavailable

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
RUNTIMES = ("tf", "openvino")
# What is known of the INT8 trunks calibrated for a checkpoint (`resolve_precision`'s input):
# none, only ones written with --force below a fidelity bound, or one that passed.
INT8_NONE, INT8_FAILING, INT8_PASSING = "none", "failing", "passing"
QUANTIZE_COMMAND = "multihead quantize --images DIR"


def resolve_precision(requested: str, *, device: Device, runtime: str = "tf",
                      int8: str = INT8_NONE) -> str:
    """Turns "fp32" | "bf16" | "fp16" | "int8" | "auto" into the precision the trunk will run in.

    Args:
      requested: the user's choice.
      device: where the trunk runs (see `backbone.device.detect_device`).
      runtime: the resolved runtime ("tf" | "openvino", see `resolve_runtime`).
      int8: the INT8 trunks calibrated for this checkpoint: `INT8_NONE`, `INT8_FAILING` (only
        ones forced below a bound: "int8" takes them, "auto" does not) or `INT8_PASSING`.

    Raises:
      ValueError: an unknown name.
      PrecisionUnsupported: the precision cannot run natively on this device or runtime.
      Int8ArtifactMissing: "int8" and no INT8 trunk calibrated for this checkpoint.
    """
    requested = requested.lower()
    if requested not in (*PRECISIONS, "auto"):
        raise ValueError(f"precision must be one of {', '.join((*PRECISIONS, 'auto'))}, "
                         f"got {requested!r}")
    if requested == "auto":
        if device.is_gpu:
            return "fp16"
        if runtime == "openvino" and int8 == INT8_PASSING:
            return "int8"
        return float_layers_precision(device)
    if requested == "bf16":
        if device.is_gpu:
            raise PrecisionUnsupported(f"precision 'bf16' is not supported on {device} "
                                       f"(TF's GPU mixed precision is fp16): use 'fp16'")
        if not device.bf16:
            raise PrecisionUnsupported("precision 'bf16' needs a CPU with avx512_bf16 or "
                                       "amx_bf16, this CPU has neither: use 'fp32' or 'auto'")
    if requested == "fp16" and not device.is_gpu:
        raise PrecisionUnsupported(f"precision 'fp16' needs a GPU, the trunk runs on {device}: "
                                   f"use 'bf16' (CPUs with avx512_bf16/amx_bf16) or 'fp32'")
    if requested == "int8":
        if device.is_gpu:
            raise PrecisionUnsupported(f"precision 'int8' runs on OpenVINO's CPU plugin, not on "
                                       f"{device}: use 'fp16' or device 'cpu'")
        if runtime != "openvino":
            raise PrecisionUnsupported(f"precision 'int8' runs on OpenVINO, not on runtime "
                                       f"{runtime!r}: use runtime 'openvino' or 'auto' (needs "
                                       f"the openvino extra)")
        if int8 not in (INT8_PASSING, INT8_FAILING):
            raise Int8ArtifactMissing(f"precision 'int8' needs an INT8 trunk calibrated for "
                                      f"this checkpoint and there is none: make one with "
                                      f"`{QUANTIZE_COMMAND}`")
    return requested


def float_layers_precision(device: Device) -> str:
    """The float precision of a CPU trunk: bf16 where the CPU computes it natively, else fp32.

    It is `auto`'s float choice, and the precision of the layers an INT8 trunk keeps in float.
    """
    return "bf16" if device.bf16 else "fp32"


def openvino_available() -> bool:
    """Whether the `openvino` package can be imported (without importing it)."""
    return importlib.util.find_spec("openvino") is not None


def resolve_runtime(requested: str, *, device: Device, openvino: bool) -> str:
    """Turns "tf" | "openvino" | "auto" into the runtime the trunk will run on.

    Args:
      requested: the user's choice.
      device: where the trunk runs.
      openvino: whether the `openvino` package is importable (see `openvino_available`).

    Raises:
      ValueError: an unknown name.
      RuntimeUnavailable: "openvino" on a GPU, or without the package installed.
    """
    requested = requested.lower()
    if requested not in (*RUNTIMES, "auto"):
        raise ValueError(f"runtime must be one of {', '.join((*RUNTIMES, 'auto'))}, "
                         f"got {requested!r}")
    if requested == "auto":
        return "openvino" if openvino and not device.is_gpu else "tf"
    if requested == "openvino":
        if device.is_gpu:
            raise RuntimeUnavailable(f"runtime 'openvino' runs the trunk on the CPU only, "
                                     f"not on {device}: use runtime 'tf' or device 'cpu'")
        if not openvino:
            raise RuntimeUnavailable("runtime 'openvino' needs the openvino package "
                                     "(pip install 'multihead[openvino]'): use runtime 'tf'")
    return requested
