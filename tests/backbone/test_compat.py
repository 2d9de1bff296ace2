"""The tf-slim 1.1.0 / TF 2.21 alias: needed, sufficient, and idempotent."""
import subprocess
import sys

from backbone import compat

# One fresh interpreter (nothing imported yet) tries the build without the alias, then
# installs it and builds again: a failed import leaves no half module behind.
BUILD_BATCH_NORM = """
import tensorflow as tf


def build():
    import tf_slim as slim

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 3])
        slim.batch_norm(x, is_training=False, scale=False)
    return len(g.get_operations())


try:
    print("without the alias: built", build())
except Exception as exc:
    print("without the alias:", type(exc).__name__, exc)
from backbone.compat import install_alias

install_alias()
print("with the alias: built", build())
"""


def test_batch_norm_needs_the_alias_and_builds_with_it():
    # TF_USE_LEGACY_KERAS as `multihead` imports TensorFlow (Keras 3 is not what is tested).
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": "", "TF_USE_LEGACY_KERAS": "1"}
    out = subprocess.run([sys.executable, "-c", BUILD_BATCH_NORM], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    without, with_alias = out.stdout.splitlines()[-2:]
    # If a future tf-keras ships the public module, this fails: the compat module can then go.
    assert without.startswith("without the alias: ModuleNotFoundError"), out.stdout
    assert "tf_keras.legacy_tf_layers" in without
    assert with_alias.startswith("with the alias: built "), out.stdout


def test_alias_points_at_tf_keras_own_modules():
    compat.install_alias()
    assert compat.install_alias() is False  # second call: nothing to do
    import tf_keras.src.legacy_tf_layers.normalization as real

    assert sys.modules["tf_keras.legacy_tf_layers.normalization"] is real
    assert compat.import_slim().__name__ == "tf_slim"
