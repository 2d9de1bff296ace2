"""The tf-slim 1.1.0 / TF 2.21 alias: needed, sufficient, and idempotent."""
import subprocess
import sys
import textwrap

from backbone import compat

BUILD_BATCH_NORM = """
import tensorflow as tf
{prelude}
import tf_slim as slim
g = tf.Graph()
with g.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 3])
    slim.batch_norm(x, is_training=False, scale=False)
print("built", len(g.get_operations()))
"""


def _run(prelude: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(BUILD_BATCH_NORM.format(prelude=prelude))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": ""})


def test_batch_norm_needs_the_alias_and_builds_with_it():
    without = _run("")
    # If a future tf-keras ships the public module, this fails: the compat module can then go.
    assert without.returncode != 0
    assert "tf_keras.legacy_tf_layers" in without.stderr
    with_alias = _run("from backbone.compat import install_alias; install_alias()")
    assert with_alias.returncode == 0, with_alias.stderr[-2000:]
    assert "built" in with_alias.stdout


def test_alias_points_at_tf_keras_own_modules():
    compat.install_alias()
    assert compat.install_alias() is False  # second call: nothing to do
    import tf_keras.src.legacy_tf_layers.normalization as real

    assert sys.modules["tf_keras.legacy_tf_layers.normalization"] is real
    assert compat.import_slim().__name__ == "tf_slim"
