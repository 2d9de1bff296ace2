"""Which precision and which runtime the trunk runs in: pure resolution rules, no side effects.

Everything here is a function of its inputs (CPU flags, device string, whether OpenVINO is
importable), so the rules are unit-tested with fake inputs; `Trunk.from_checkpoint` feeds them
the real ones. TensorFlow is imported only by `session_config`.

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
import os

from backbone.errors import PrecisionUnsupported, RuntimeUnavailable

PRECISIONS = ("fp32", "bf16", "fp16")
RUNTIMES = ("tf", "openvino")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (or of the given text); empty if unreadable."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 / arm64 spelling
            return frozenset(value.split())
    return frozenset()


def cpu_has_bf16(flags) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 dot products or AMX tiles)."""
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def is_gpu(device: str) -> bool:
    return "GPU" in device.upper()


def resolve_precision(requested: str, *, device: str, flags) -> str:
    """Turns "fp32" | "bf16" | "fp16" | "auto" into the precision the trunk will run in.

    Args:
      requested: the user's choice.
      device: the resolved TF device string ("/CPU:0", "/GPU:0").
      flags: CPU feature flags (see `cpu_flags`).

    Raises:
      ValueError: an unknown name.
      PrecisionUnsupported: the precision cannot run natively on this device.
    """
    requested = requested.lower()
    if requested not in (*PRECISIONS, "auto"):
        raise ValueError(f"precision must be one of {', '.join((*PRECISIONS, 'auto'))}, "
                         f"got {requested!r}")
    gpu = is_gpu(device)
    if requested == "auto":
        return "fp16" if gpu else ("bf16" if cpu_has_bf16(flags) else "fp32")
    if requested == "bf16":
        if gpu:
            raise PrecisionUnsupported(f"precision 'bf16' is not supported on {device} "
                                       f"(TF's GPU mixed precision is fp16): use 'fp16'")
        if not cpu_has_bf16(flags):
            raise PrecisionUnsupported("precision 'bf16' needs a CPU with avx512_bf16 or "
                                       "amx_bf16, this CPU has neither: use 'fp32' or 'auto'")
    if requested == "fp16" and not gpu:
        raise PrecisionUnsupported(f"precision 'fp16' needs a GPU, the trunk runs on {device}: "
                                   f"use 'bf16' (CPUs with avx512_bf16/amx_bf16) or 'fp32'")
    return requested


def openvino_available() -> bool:
    """Whether the `openvino` package can be imported (without importing it)."""
    return importlib.util.find_spec("openvino") is not None


def resolve_runtime(requested: str, *, device: str, openvino: bool) -> str:
    """Turns "tf" | "openvino" | "auto" into the runtime the trunk will run on.

    Args:
      requested: the user's choice.
      device: the resolved TF device string.
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
        return "openvino" if openvino and not is_gpu(device) else "tf"
    if requested == "openvino":
        if is_gpu(device):
            raise RuntimeUnavailable(f"runtime 'openvino' runs the trunk on the CPU only, "
                                     f"not on {device}: use runtime 'tf' or device 'cpu'")
        if not openvino:
            raise RuntimeUnavailable("runtime 'openvino' needs the openvino package "
                                     "(pip install 'multihead[openvino]'): use runtime 'tf'")
    return requested


def maybe_has_gpu() -> bool:
    """False when no GPU driver device node exists, so TensorFlow cannot see a GPU either.

    Lets a CPU-only start skip importing TensorFlow just to list GPUs (about 2-5 s); when it
    returns True, TensorFlow is asked.
    """
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd",
                                           "/dev/dxg"))


def session_config(device: str, precision: str, intra_op_threads: int | None = None,
                   inter_op_threads: int | None = None):
    """The TF session ConfigProto for a resolved device and precision.

    bf16 turns on the oneDNN auto mixed precision rewriter (CPU); fp16 turns on the CUDA auto
    mixed precision rewriter (GPU). Both cast inside the graph: inputs and features stay
    float32. Call with an already resolved precision (`resolve_precision`).
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import rewriter_config_pb2

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
    config.gpu_options.allow_growth = True
    if intra_op_threads:
        config.intra_op_parallelism_threads = intra_op_threads
    if inter_op_threads:
        config.inter_op_parallelism_threads = inter_op_threads
    rewrite = config.graph_options.rewrite_options
    if precision == "bf16":
        rewrite.auto_mixed_precision_onednn_bfloat16 = rewriter_config_pb2.RewriterConfig.ON
    elif precision == "fp16":
        rewrite.auto_mixed_precision = rewriter_config_pb2.RewriterConfig.ON
    return config
