"""The on-disk format of one head version, and reading heads out of TF checkpoints.

A version directory `<store>/heads/<bot_id>/v<version>/` holds:

    head.ckpt.index, head.ckpt.data-00000-of-00001   TF checkpoint (V2 bundle): `weights`
                                                    float32 [1536, n], `biases` float32 [n]
    labels.txt                                      one label per line, UTF-8
    manifest.json                                   bot_id, version, n_classes, created, source,
                                                    sha256 of each file above

It is written once into a hidden temporary directory and renamed into place; it never changes
afterwards. TensorFlow is imported lazily, only to write or read checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from backbone.spec import FEATURE_DIM
from heads.errors import HeadLoadError, InvalidHead, InvalidLabel
from heads.head import MAX_CLASSES, Head, validate_labels

FORMAT_VERSION = 1
CKPT_NAME = "head.ckpt"
LABELS_NAME = "labels.txt"
MANIFEST_NAME = "manifest.json"
WEIGHTS_KEY = "weights"
BIASES_KEY = "biases"
# TF scope strings are checkpoint keys: the slim Inception-V4 classifier layer.
SLIM_LOGITS_SCOPE = "InceptionV4/Logits/Logits"
SLIM_WEIGHTS_KEY = f"{SLIM_LOGITS_SCOPE}/weights"
SLIM_BIASES_KEY = f"{SLIM_LOGITS_SCOPE}/biases"


# 100,000 labels of 80 bytes each: a labels file larger than this is refused unread.
MAX_LABELS_BYTES = 8 * 2**20
_LINE_END = re.compile("\r\n|\r|\n")


def read_labels(path: str | os.PathLike, *, stored: bool = False) -> tuple[str, ...]:
    """Read a labels file: one label per line (lines end with LF, CRLF or CR), surrounding
    whitespace stripped, each label following the label rules (`heads.head.validate_labels`;
    with `stored`, the file of a version already in the store: only what loading needs).

    Trailing blank lines are ignored; a blank line between labels is refused (it would shift
    every following label onto the wrong class). Other line breaks (U+2028, NEL, form feed...)
    do not end a line: they are refused inside a label, on its own line number.
    """
    p = Path(path)
    try:
        if p.stat().st_size > MAX_LABELS_BYTES:
            raise InvalidHead(f"labels file '{p}' is over the limit of {MAX_LABELS_BYTES} bytes")
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise HeadLoadError(f"labels file '{p}' not found") from None
    except IsADirectoryError:
        raise HeadLoadError(f"labels file '{p}' is a directory") from None
    except UnicodeDecodeError:
        raise HeadLoadError(f"labels file '{p}' is not UTF-8 text") from None
    except OSError as exc:
        raise HeadLoadError(f"cannot read labels file '{p}': {exc.strerror}") from None
    lines = [line.strip() for line in _LINE_END.split(text)]
    while lines and not lines[-1]:
        lines.pop()
    for i, line in enumerate(lines):
        if not line:
            raise InvalidLabel(f"labels file '{p}' has an empty line {i + 1}")
    return validate_labels(lines, source=f"labels file '{p}'", stored=stored)


def _tf():
    from backbone.tfimport import import_tensorflow

    tf = import_tensorflow()  # lazily: `import heads` must stay fast and TF-free

    return tf


def read_checkpoint_tensors(prefix: str | os.PathLike, names: Sequence[str]) -> list[np.ndarray]:
    """Read named tensors from a TF checkpoint (prefix, or a directory with a `checkpoint` file).

    Raises:
        HeadLoadError: the checkpoint is missing or unreadable, or lacks one of `names`.
    """
    tf = _tf()
    prefix = os.fspath(prefix)
    try:
        reader = tf.train.load_checkpoint(prefix)
    except tf.errors.NotFoundError:
        raise HeadLoadError(f"no TF checkpoint at '{prefix}'") from None
    except ValueError:
        raise HeadLoadError(f"no TF checkpoint in directory '{prefix}'") from None
    except (tf.errors.OpError, OSError):
        raise HeadLoadError(f"'{prefix}' is not a readable TF checkpoint") from None
    out = []
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    for name in names:
        if not reader.has_tensor(name):
            raise HeadLoadError(f"checkpoint '{prefix}' has no tensor '{name}'")
        # NOTE: shape and dtype come from the index: checked before any data is read.
        if not dtypes[name].is_floating:
            raise InvalidHead(f"tensor '{name}' is {dtypes[name].name}, expected float")
        if int(np.prod(shapes[name], dtype=np.int64)) > FEATURE_DIM * MAX_CLASSES:
            raise InvalidHead(f"tensor '{name}' has shape {list(shapes[name])}: more than a "
                              f"head of {MAX_CLASSES} classes")
        try:
            value = reader.get_tensor(name)
        except (tf.errors.OpError, IndexError, ValueError, OSError):
            raise HeadLoadError(f"tensor '{name}' of checkpoint '{prefix}' is corrupt") from None
        # Own the memory (the reader's buffer is not ours to keep) and drop TF's dtype quirks.
        out.append(np.array(value, copy=True))
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_checkpoint(prefix: Path, weights: np.ndarray, biases: np.ndarray) -> None:
    tf = _tf()
    from tensorflow.python.eager import context

    # NOTE: `SaveV2` runs eagerly even in a process whose trunk disabled eager execution or
    # whose thread is inside a `graph.as_default()` block; it never touches the trunk's graph.
    with context.eager_mode():
        tf.raw_ops.SaveV2(
            prefix=os.fspath(prefix),
            tensor_names=[WEIGHTS_KEY, BIASES_KEY],
            shape_and_slices=["", ""],
            tensors=[tf.constant(weights), tf.constant(biases)],
        )


def write_version_dir(
    directory: Path,
    *,
    bot_id: str,
    version: int,
    weights: np.ndarray,
    biases: np.ndarray,
    labels: Sequence[str],
    created: str,
    source: str,
) -> dict:
    """Write a complete version into the (new, empty) `directory` and fsync every file and it.

    The arrays and labels must already be validated. Returns the manifest.
    """
    _save_checkpoint(directory / CKPT_NAME, weights, biases)
    (directory / LABELS_NAME).write_text("".join(f"{label}\n" for label in labels), "utf-8")
    files = sorted(p.name for p in directory.iterdir())
    manifest = {
        "format": FORMAT_VERSION,
        "bot_id": bot_id,
        "version": int(version),
        "n_classes": int(weights.shape[1]),
        "created": created,
        "source": source,
        "files": {name: sha256_file(directory / name) for name in files},
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")
    for name in files + [MANIFEST_NAME]:
        fsync_file(directory / name)
    fsync_dir(directory)
    return manifest


def read_manifest(directory: Path) -> dict:
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text("utf-8"))
    except FileNotFoundError:
        raise HeadLoadError(f"head files missing in '{directory}'") from None
    except (OSError, ValueError):
        raise HeadLoadError(f"manifest of '{directory}' is unreadable") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise HeadLoadError(f"manifest of '{directory}' is malformed")
    return manifest


def load_version_dir(directory: Path, bot_id: str, version: int, *, verify: bool = True) -> Head:
    """Load one version directory into a `Head`.

    With `verify`, every file is checked against the sha256 in the manifest first, so a
    truncated or edited file is reported as such instead of serving wrong numbers.

    Raises:
        HeadLoadError: files missing, corrupt or not matching the manifest.
    """
    label = f"head '{bot_id}' v{version}"
    manifest = read_manifest(directory)
    if manifest.get("bot_id") != bot_id or manifest.get("version") != version:
        raise HeadLoadError(f"{label}: manifest in '{directory}' belongs to another head")
    if verify:
        for name, digest in manifest["files"].items():
            path = directory / name
            if os.sep in name or not path.is_file():
                raise HeadLoadError(f"{label}: file '{name}' is missing")
            if sha256_file(path) != digest:
                raise HeadLoadError(f"{label}: file '{name}' is corrupt (sha256 mismatch)")
    try:
        labels = read_labels(directory / LABELS_NAME, stored=True)
        weights, biases = read_checkpoint_tensors(directory / CKPT_NAME, [WEIGHTS_KEY, BIASES_KEY])
        return Head(bot_id, version, labels, weights, biases)
    except (HeadLoadError, InvalidHead) as exc:
        raise HeadLoadError(f"{label}: {exc}") from None
