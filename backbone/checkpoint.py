"""Trunk checkpoints: locate, check against the Inception-V4 layout, digest, and write seeded ones.

The loading path is the one the official `inception_v4_2016_09_09` checkpoint uses; a seeded
random checkpoint in the same layout stands in for it on machines that cannot download it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from backbone.errors import CheckpointError
from backbone.inception_v4 import (
    FEATURE_DIM,
    LOGITS_SCOPE,
    NUM_CLASSES,
    aux_logits_specs,
    variable_specs,
)
from backbone.tfimport import import_tensorflow

# Names inside a store (`<store>/trunk/...`): the official checkpoint wins when present.
OFFICIAL_CHECKPOINT = "inception_v4.ckpt"
DEMO_CHECKPOINT = "demo_inception_v4.ckpt"
# Next to a trunk checkpoint: its saved graph, compiled models and INT8 trunks.
CACHE_DIR = "graph_cache"


def checkpoint_exists(prefix: str | os.PathLike) -> bool:
    """A V2 checkpoint (`prefix.index` + data) or a V1 single file, like the official
    `inception_v4.ckpt` from the slim model zoo."""
    return os.path.isfile(f"{os.fspath(prefix)}.index") or os.path.isfile(prefix)


def default_trunk_checkpoint(store_dir: str | os.PathLike) -> str:
    """The trunk checkpoint prefix of a store: the official one if dropped in, else the demo one.

    Raises:
      CheckpointError: the store is a URL (a postgresql:// store keeps heads, not the trunk:
        the trunk checkpoint is then always given explicitly).
    """
    if isinstance(store_dir, str) and "://" in store_dir:
        raise CheckpointError(
            "a database store holds the heads, not the trunk: pass --trunk-checkpoint (or set "
            "MULTIHEAD_TRUNK_CHECKPOINT) with a postgresql:// store")
    trunk_dir = Path(store_dir) / "trunk"
    official = trunk_dir / OFFICIAL_CHECKPOINT
    if checkpoint_exists(official):
        return str(official)
    return str(trunk_dir / DEMO_CHECKPOINT)


def cache_dir_of(prefix: str | os.PathLike) -> Path:
    """Where a trunk checkpoint's graph, compiled models and INT8 trunks are kept: graph_cache/
    next to it (`<store>/trunk/graph_cache` for a store's own trunk)."""
    return Path(prefix).parent / CACHE_DIR


def resolve_prefix(path: str | os.PathLike) -> str:
    """Turns a checkpoint prefix (or a directory holding one) into an existing prefix.

    Raises:
      CheckpointError: naming the path, when no checkpoint is there.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        import tensorflow as tf

        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            candidates = sorted(Path(path).glob("*.index"))
            if len(candidates) != 1:
                raise CheckpointError(f"no trunk checkpoint found in directory '{path}'")
            latest = str(candidates[0])[: -len(".index")]
        path = latest
    if not checkpoint_exists(path):
        raise CheckpointError(f"trunk checkpoint not found: '{path}' (neither a V2 checkpoint "
                              f"'{path}.index' nor a V1 checkpoint file)")
    return path


def _reader(prefix: str):
    tf = import_tensorflow()

    try:
        return tf.train.load_checkpoint(prefix)
    except Exception as exc:  # noqa: BLE001 - tf raises DataLoss, NotFound, ... for bad files
        raise CheckpointError(f"cannot read checkpoint '{prefix}': {exc}") from None


def check_layout(prefix: str, *, with_logits: bool = False) -> int:
    """Checks that a checkpoint holds every trunk variable with the right shape.

    Extra variables (AuxLogits, optimizer slots, global_step, ...) are fine: only the trunk
    (and, with `with_logits`, the Logits layer of any class count) will be restored.

    Returns:
      The Logits class count if `with_logits`, else 0.

    Raises:
      CheckpointError: naming the first missing or mis-shaped variable and both shapes.
    """
    shapes = _reader(prefix).get_variable_to_shape_map()
    for name, want in variable_specs():
        if name not in shapes:
            raise CheckpointError(f"checkpoint '{prefix}' has no variable '{name}' "
                                  f"(expected shape {want})")
        if list(shapes[name]) != want:
            raise CheckpointError(f"checkpoint '{prefix}': variable '{name}' has shape "
                                  f"{list(shapes[name])}, the trunk expects {want}")
    if not with_logits:
        return 0
    weights = shapes.get(f"{LOGITS_SCOPE}/weights")
    biases = shapes.get(f"{LOGITS_SCOPE}/biases")
    if weights is None or biases is None:
        raise CheckpointError(f"checkpoint '{prefix}' has no '{LOGITS_SCOPE}' layer")
    if len(weights) != 2 or weights[0] != FEATURE_DIM or list(biases) != [weights[1]]:
        raise CheckpointError(f"checkpoint '{prefix}': '{LOGITS_SCOPE}' has shapes "
                              f"{list(weights)} and {list(biases)}, expected "
                              f"[{FEATURE_DIM}, n] and [n]")
    return int(weights[1])


def trunk_digest(prefix: str) -> str:
    """sha256 over the trunk variables (names, shapes, float32 bytes) of a checkpoint.

    Two checkpoints with the same digest give the same features, whatever else they hold.
    """
    prefix = resolve_prefix(prefix)
    check_layout(prefix)
    reader = _reader(prefix)
    digest = hashlib.sha256()
    for name, shape in sorted(variable_specs()):
        value = np.ascontiguousarray(reader.get_tensor(name), dtype=np.float32)
        digest.update(f"{name}:{shape}\n".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def random_variables(seed: int, *, num_classes: int = NUM_CLASSES,
                     aux_logits: bool = True) -> dict[str, np.ndarray]:
    """Seeded random values for every variable of the official layout (trunk, Logits, AuxLogits).

    Conv weights are He-normal (std sqrt(2 / fan_in)); batch norm is the identity
    (moving_mean 0, moving_variance 1 - eps, beta 0), so with ReLU every end point keeps an
    rms of order 1 and features stay finite and differ between images.
    """
    rng = np.random.default_rng(seed)
    values = {}
    specs = variable_specs(num_classes=num_classes)
    if aux_logits:
        specs += aux_logits_specs(num_classes)
    for name, shape in specs:
        leaf = name.rsplit("/", 1)[1]
        if leaf == "weights" and len(shape) == 4:
            fan_in = shape[0] * shape[1] * shape[2]
            value = rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
        elif leaf == "weights":  # Logits [1536, n], Aux_logits [768, n]
            value = rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / np.sqrt(shape[0]))
        elif leaf == "moving_variance":
            value = np.full(shape, 1.0 - 0.001, np.float32)
        else:  # beta, moving_mean, biases
            value = np.zeros(shape, np.float32)
        values[name] = value
    return values


def write_checkpoint(prefix: str, values: dict[str, np.ndarray]) -> str:
    """Writes a TF V2 checkpoint whose keys are exactly the given names (slim's layout)."""
    tf = import_tensorflow()

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    names = sorted(values)
    # NOTE: raw SaveV2 (eager) writes the keys verbatim, as slim's Saver did; no graph needed.
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names),
                      tensors=[tf.constant(values[n]) for n in names])
    return prefix


def write_random_checkpoint(out_prefix: str, seed: int = 0, *, num_classes: int = NUM_CLASSES,
                            aux_logits: bool = True) -> str:
    """Writes a seeded random Inception-V4 checkpoint (trunk, Logits, AuxLogits); returns its
    prefix.

    This is what `multihead init-trunk` writes; tests and the demo use it in place of the
    official checkpoint, which cannot be downloaded on these machines.
    """
    return write_checkpoint(out_prefix, random_variables(seed, num_classes=num_classes,
                                                         aux_logits=aux_logits))
