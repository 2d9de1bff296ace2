"""How a head is stored in PostgreSQL: three blobs per version, each with its sha256.

    weights   float32 [1536, n], little-endian, C order
    biases    float32 [n]
    labels    a UTF-8 JSON array of n strings

Plain bytes: readable by anything, no TensorFlow needed. Every blob is checked against its
sha256 on load, so edited or truncated bytes are reported instead of serving wrong numbers.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from backbone.spec import FEATURE_DIM
from heads.errors import HeadLoadError, InvalidHead
from heads.head import Head, validate_labels
from store.schema import BLOB_NAMES

_FLOAT = np.dtype("<f4")


def encode(weights: np.ndarray, biases: np.ndarray,
           labels: tuple[str, ...]) -> dict[str, tuple[bytes, str]]:
    """{blob name: (bytes, sha256 hex)} of one (already validated) head."""
    blobs = {
        "weights": np.ascontiguousarray(weights, dtype=_FLOAT).tobytes(),
        "biases": np.ascontiguousarray(biases, dtype=_FLOAT).tobytes(),
        "labels": json.dumps(list(labels), ensure_ascii=False).encode("utf-8"),
    }
    return {name: (data, hashlib.sha256(data).hexdigest()) for name, data in blobs.items()}


def decode(bot_id: str, version: int, n_classes: int,
           blobs: dict[str, tuple[bytes, str]]) -> Head:
    """The head held by `blobs` ({name: (bytes, stored sha256)}) of a version of n_classes.

    Raises:
        HeadLoadError: a blob missing, corrupt (sha256 mismatch) or of the wrong size or form.
    """
    label = f"head '{bot_id}' v{version}"
    for name in BLOB_NAMES:
        if name not in blobs:
            raise HeadLoadError(f"{label}: blob '{name}' is missing")
        data, digest = blobs[name]
        if hashlib.sha256(data).hexdigest() != digest:
            raise HeadLoadError(f"{label}: blob '{name}' is corrupt (sha256 mismatch)")
    try:
        weights = _decode_floats(blobs["weights"][0], (FEATURE_DIM, n_classes), "weights")
        biases = _decode_floats(blobs["biases"][0], (n_classes,), "biases")
        labels = _decode_labels(blobs["labels"][0])
        return Head(bot_id, version, labels, weights, biases)
    except InvalidHead as exc:
        raise HeadLoadError(f"{label}: {exc}") from None


def _decode_floats(data: bytes, shape: tuple[int, ...], name: str) -> np.ndarray:
    expected = int(np.prod(shape)) * _FLOAT.itemsize
    if len(data) != expected:
        raise InvalidHead(f"blob '{name}' has {len(data)} bytes, expected {expected} for "
                          f"float32 {list(shape)}")
    # Read-only, backed by the fetched bytes: no copy (on a little-endian machine).
    return np.frombuffer(data, dtype=_FLOAT).reshape(shape).astype(np.float32, copy=False)


def _decode_labels(data: bytes) -> tuple[str, ...]:
    try:
        labels = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise InvalidHead("blob 'labels' is not a UTF-8 JSON array") from None
    if not isinstance(labels, list):
        raise InvalidHead("blob 'labels' is not a JSON array")
    return validate_labels(labels)
