"""Where the trunk runs: one `Device` value, detected in one place.

Everything the rest of the trunk layer decides by hardware (which precisions run natively,
which runtime may run, where the TF graph is placed, whether TensorFlow's CUDA probe is noise)
reads a `Device`: its kind, its TF device string and the CPU's feature flags. `detect_device`
is the only function that looks at the machine; its inputs (CPU flags, the GPUs TensorFlow
sees) can be injected, so every rule that reads a `Device` is tested with fake hardware.

TensorFlow is asked for its GPUs only where one may exist (a GPU was asked for, or a GPU
driver's device node is present): a CPU-only start detects its device without importing it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from backbone.errors import CheckpointError

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# Device nodes of the NVIDIA, ROCm and WSL GPU drivers: without one, no GPU can be used.
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


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


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (or the given text), else the platform's."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):  # x86, arm64, others
            return value.strip()
    import platform

    return platform.processor() or platform.machine()


def maybe_has_gpu() -> bool:
    """False when no GPU driver device node exists, so TensorFlow cannot see a GPU either.

    Lets a CPU-only start skip importing TensorFlow just to list GPUs (about 2-5 s); when it
    returns True, TensorFlow is asked.
    """
    return any(os.path.exists(p) for p in GPU_DRIVER_NODES)


@dataclass(frozen=True)
class Device:
    """The hardware the trunk runs on.

    Attributes:
      kind: "cpu" or "gpu".
      name: the TF device string the graph is placed on ("/CPU:0", "/GPU:1", ...).
      cpu_flags: the host CPU's feature flags (they matter on a GPU host too: heads, decode).
    """

    kind: str
    name: str
    cpu_flags: frozenset[str] = frozenset()

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def bf16(self) -> bool:
        """Whether the CPU computes bf16 natively (AVX512-BF16 dot products or AMX tiles)."""
        return any(flag in self.cpu_flags for flag in BF16_CPU_FLAGS)

    @property
    def amx(self) -> bool:
        """Whether the CPU has AMX tiles (bf16 and int8 matrix units)."""
        return "amx_tile" in self.cpu_flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.cpu_flags

    def __str__(self) -> str:
        return self.name


def normalize(device: str) -> str:
    """"auto" stays; "cpu", "gpu:1", "/device:GPU:0" become TF device strings ("/CPU", ...)."""
    if device == "auto":
        return device
    device = device.upper().replace("/DEVICE:", "/")
    return device if device.startswith("/") else f"/{device}"


def cpu_device_if_known(requested: str = "auto", *, flags=None) -> Device | None:
    """The CPU `Device` when the trunk is sure to run on the CPU, known without TensorFlow:
    the CPU was asked for, or "auto" on a machine without a GPU driver. Else None."""
    name = normalize(requested)
    if name.startswith("/CPU") or (name == "auto" and not maybe_has_gpu()):
        return detect_device(name, flags=flags, gpus=[])
    return None


def detect_device(requested: str | Device = "auto", *, flags=None, gpus=None) -> Device:
    """The device the trunk will run on.

    Args:
      requested: "auto" (the first GPU, else the CPU), "cpu", "gpu", "gpu:N", a TF device
        string, or a `Device` (returned as is).
      flags: the CPU's feature flags; None reads /proc/cpuinfo.
      gpus: the GPUs TensorFlow sees (names); None asks TensorFlow where a GPU may exist.

    Raises:
      CheckpointError: a GPU was asked for and TensorFlow sees none.
    """
    if isinstance(requested, Device):
        return requested
    flags = cpu_flags() if flags is None else frozenset(flags)
    name = normalize(requested)
    if name.startswith("/CPU"):
        return Device("cpu", name, flags)
    if gpus is None:
        gpus = [] if name == "auto" and not maybe_has_gpu() else visible_gpus()
    if name == "auto":
        return Device("gpu", "/GPU:0", flags) if gpus else Device("cpu", "/CPU:0", flags)
    if "GPU" in name and not gpus:
        raise CheckpointError(f"device '{name}' requested but TensorFlow sees no GPU")
    return Device("gpu" if "GPU" in name else "cpu", name, flags)


def visible_gpus() -> list[str]:
    """The names of the GPUs TensorFlow sees (imports TensorFlow).

    NOTE: a plain `import tensorflow`, not `backbone.tfimport`'s quiet one (which reads this
    module): this is only reached where a GPU may exist, where that import filters nothing.
    """
    import tensorflow as tf

    return [gpu.name for gpu in tf.config.list_physical_devices("GPU")]
