"""Which precision and which runtime the trunk runs in: pure resolution rules, no side effects.

Everything here is a function of its inputs (the `Device`, whether OpenVINO is importable), so
the rules are unit-tested with fake devices; `Trunk.from_checkpoint` feeds them the detected one.

Rules:
  - "fp32" runs everywhere.
  - "bf16" needs a CPU with native bf16 (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo). On a
    CPU without them it is refused, never emulated: OpenVINO silently falls back to f32 there
    (its compiled model reports INFERENCE_PRECISION_HINT f32), and TF's oneDNN rewriter would
    emulate bf16 through slower conversions. On a GPU, TF has no bf16 auto mixed precision
    rewriter (its CUDA one is fp16): refused, use "fp16".
  - "fp16" needs a GPU (TF's CUDA `auto_mixed_precision` rewriter). On the CPU it is refused:
    TF's CPU fp16 path (`auto_mixed_precision_cpu`) only emulates it, for testing.
  - "auto": fp16 on a GPU, bf16 on a CPU with native bf16, fp32 otherwise.
  - runtime "openvino" runs on the CPU only (this package compiles for OpenVINO's CPU plugin);
    "auto" picks it on the CPU when `openvino` is importable, else "tf".
"""
from __future__ import annotations

import importlib.util

from backbone.device import Device
from backbone.errors import PrecisionUnsupported, RuntimeUnavailable

PRECISIONS = ("fp32", "bf16", "fp16")
RUNTIMES = ("tf", "openvino")


def resolve_precision(requested: str, *, device: Device) -> str:
    """Turns "fp32" | "bf16" | "fp16" | "auto" into the precision the trunk will run in.

    Args:
      requested: the user's choice.
      device: where the trunk runs (see `backbone.device.detect_device`).

    Raises:
      ValueError: an unknown name.
      PrecisionUnsupported: the precision cannot run natively on this device.
    """
    requested = requested.lower()
    if requested not in (*PRECISIONS, "auto"):
        raise ValueError(f"precision must be one of {', '.join((*PRECISIONS, 'auto'))}, "
                         f"got {requested!r}")
    if requested == "auto":
        return "fp16" if device.is_gpu else ("bf16" if device.bf16 else "fp32")
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
    return requested


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
