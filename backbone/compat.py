"""tf-slim 1.1.0 on TensorFlow 2.16+: the one alias it needs.

Why: tf-slim's layers go through `tensorflow.python.layers.*`, which on TF 2.16+ lazily imports
`tf_keras.legacy_tf_layers.<module>`. tf-keras (installed at TensorFlow's minor version) ships
those modules only as `tf_keras.src.legacy_tf_layers.<module>`, so the first `slim.batch_norm`
fails with `ModuleNotFoundError: No module named 'tf_keras.legacy_tf_layers'`. Registering the
package and its submodules under the public name before the first slim layer is built fixes
it without patching either library. Import tf-slim only through `import_slim()`.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

ALIAS = "tf_keras.legacy_tf_layers"
TARGET = "tf_keras.src.legacy_tf_layers"


def install_alias() -> bool:
    """Registers `tf_keras.legacy_tf_layers` (and its submodules) in `sys.modules`.

    Returns:
      True if the alias was added now, False if the name already resolved (a tf-keras release
      that ships the module itself, or a second call).
    """
    if ALIAS in sys.modules:
        return False
    try:
        importlib.import_module(ALIAS)
        return False
    except ModuleNotFoundError:
        pass
    package = importlib.import_module(TARGET)
    sys.modules[ALIAS] = package
    # NOTE: alias every submodule too, so that `import_module(ALIAS + ".normalization")` returns
    # the module tf_keras itself uses instead of loading a second copy of it.
    for info in pkgutil.iter_modules(package.__path__):
        sys.modules[f"{ALIAS}.{info.name}"] = importlib.import_module(f"{TARGET}.{info.name}")
    return True


def import_slim():
    """Returns the `tf_slim` module, with the compat alias installed first."""
    install_alias()
    import tf_slim

    return tf_slim
