"""The bring-up's start-up path: what it imports.

A real `multihead serve` whose compiled OpenVINO trunk is in the cache becomes ready without
importing TensorFlow (a stand-in compiled model: the start path is the subject, not the
features).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[3]


# -- a restart with the compiled trunk in the cache imports no TensorFlow --------------------------

def fake_compiled_trunk(cache_dir: Path, prefix: str) -> None:
    """Writes a compiled OpenVINO model where `serve` finds the compiled fp32 trunk of `prefix`:
    the mean colour of the image times a fixed matrix, [N, 299, 299, 3] -> [N, 1536]."""
    import openvino as ov
    from openvino import opset13 as ops

    from backbone.runners.base import Layout
    from backbone.runners.openvino import CompiledCache, compile_config

    images = ops.parameter([-1, 299, 299, 3], np.float32, name="input")
    mean = ops.reduce_mean(images, np.array([1, 2], np.int64), False)
    weights = np.random.default_rng(0).standard_normal((3, 1536)).astype(np.float32)
    model = ov.Model([ops.matmul(mean, ops.constant(weights), False, False)], [images], "fake")
    compiled = ov.Core().compile_model(model, "CPU", compile_config("fp32"))
    CompiledCache(cache_dir, prefix=prefix, precision="fp32", with_logits=False).save(
        compiled, Layout([], {"PreLogitsFlatten": [None, 1536]}, 0).to_json())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_ready(store: Path, *flags: str) -> tuple[dict, str]:
    """Runs `multihead serve` until /readyz says ready, then SIGTERM: (the full /readyz, what
    the process printed, ending with whether it had imported TensorFlow)."""
    port = free_port()
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('tensorflow imported:', 'tensorflow' in sys.modules,"
            " flush=True))\n"
            "from cli.main import main\n"
            f"sys.exit(main(['serve', '--store', {str(store)!r}, '--port', '{port}', "
            f"'--auth', 'none', *{list(flags)!r}]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    body, deadline = None, time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                    body = json.load(r)
                    break
            except OSError:
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert body is not None, out
    return body, out


@pytest.mark.subprocess
def test_a_restart_with_the_compiled_trunk_cached_imports_no_tensorflow(tmp_path):
    pytest.importorskip("openvino")
    store = tmp_path / "store"
    trunk = store / "trunk"
    trunk.mkdir(parents=True)
    prefix = trunk / "demo_inception_v4.ckpt"
    Path(f"{prefix}.index").write_bytes(b"the index of a checkpoint")
    Path(f"{prefix}.data-00000-of-00001").write_bytes(b"its weights")
    fake_compiled_trunk(trunk / "graph_cache", str(prefix))

    flags = ("--runtime", "openvino", "--precision", "fp32", "--max-batch-size", "4")
    body, out = serve_until_ready(store, *flags)
    assert body["status"] == "ready" and body["trunk"]["runtime"] == "openvino"
    assert body["timings"]["build_s"] == 0 and body["timings"]["restore_s"] == 0
    assert "no TensorFlow: the trunk loads without it" in out
    assert out.strip().splitlines()[-1] == "tensorflow imported: False", out
