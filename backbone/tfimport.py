"""`import tensorflow` without the CUDA probe's noise on machines that cannot have a GPU.

TensorFlow probes for CUDA once per process, at import and at its first device listing or
session, and logs "Could not find cuda drivers" and an ERROR "failed call to cuInit" through
C++ logging (on fd 2, whatever TF_CPP_MIN_LOG_LEVEL says for the first). On a machine without
a GPU driver those lines are noise that looks like a fault. `import_tensorflow` runs that probe
once with fd 2 captured and writes back every captured line except those two; when a GPU is
asked for, or a driver device node exists, nothing is filtered.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading

from backbone.device import Device, maybe_has_gpu

NOISE = (b"failed call to cuInit", b"Could not find cuda drivers")
_lock = threading.Lock()
_probed = False


@contextlib.contextmanager
def _stderr_without(patterns: tuple[bytes, ...]):
    """Captures fd 2 (C++ and Python writes alike), then writes it back minus `patterns`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().splitlines(keepends=True):
                if not any(p in line for p in patterns):
                    os.write(2, line)


def quiet_probe_wanted(device) -> bool:
    """Filter only when no GPU was asked for and no GPU driver is present."""
    return "gpu" not in str(device).lower() and not maybe_has_gpu()


def import_tensorflow(device: str | Device = "auto"):
    """`import tensorflow as tf` and its CUDA probe, quiet where a GPU cannot exist.

    Unless the environment says otherwise, `tf.keras` is tf_keras (Keras 2, which tf-slim's
    layers need anyway): TensorFlow's import then skips Keras 3 and the scikit-learn it pulls
    in (about 3 s of a 2-core machine, for every process that imports TensorFlow)."""
    global _probed
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    with _lock:
        if _probed or not quiet_probe_wanted(device):
            import tensorflow as tf

            return tf
        with _stderr_without(NOISE):
            import tensorflow as tf

            tf.config.list_physical_devices("GPU")  # the once-per-process probe, here
        _probed = True
        return tf
