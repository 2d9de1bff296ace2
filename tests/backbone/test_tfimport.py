"""TensorFlow's CUDA probe is quiet where no GPU can exist, and loud when a GPU is asked for."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backbone.device import maybe_has_gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(maybe_has_gpu(), reason="a GPU driver is present: TF's CUDA "
                                "probe succeeds and prints no error to filter")


def _run(device: str) -> str:
    code = ("from backbone.tfimport import import_tensorflow\n"
            f"tf = import_tensorflow({device!r})\n"
            "g = tf.Graph()\n"
            "with g.as_default():\n"
            "    x = tf.constant(2.0) * 3\n"
            "print('result', tf.compat.v1.Session(graph=g).run(x))\n"
            "import sys; print('still on stderr', file=sys.stderr)\n")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0 and "result 6.0" in out.stdout, out.stderr
    return out.stderr


def test_no_cuinit_error_on_a_machine_without_a_gpu():
    stderr = _run("auto")
    assert "cuInit" not in stderr and "cuda drivers" not in stderr, stderr
    assert "still on stderr" in stderr  # only the probe's lines are dropped


def test_the_cuinit_error_stays_when_a_gpu_was_asked_for():
    assert "cuInit" in _run("gpu")
