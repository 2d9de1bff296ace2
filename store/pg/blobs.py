"""The blobs of a PostgreSQL store: three rows per version in `blobs`, each with its sha256.

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
import psycopg

from accounts.tenants import combine_digests
from backbone.spec import FEATURE_DIM
from heads.errors import HeadLoadError, InvalidHead
from heads.head import Head, validate_labels
from store.blobs import Blobs
from store.bots import Step
from store.pg.database import Database
from store.pg.schema import NO_SCHEMA
from store.pg.schema import SCHEMA as S
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
    return validate_labels(labels, stored=True)  # registered under older rules: still loads


class PgBlobs(Blobs[psycopg.Connection]):
    """The `blobs` rows of a store. They reference their `versions` row (ON DELETE CASCADE):
    they are written and deleted in the registry's own transactions, nothing is left over."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def load(self, bot_id: str, version: int) -> Head:
        def work(conn):
            try:
                with conn.cursor(binary=True) as cur:
                    cur.execute(
                        f"SELECT v.n_classes, b.name, b.data, b.sha256 FROM {S}.versions v "
                        f"LEFT JOIN {S}.blobs b ON b.bot_id = v.bot_id AND b.version = v.version "
                        "WHERE v.bot_id = %s AND v.version = %s", (bot_id, version))
                    return cur.fetchall()
            except NO_SCHEMA:
                return []

        rows = self._db.read(work)
        if not rows:
            raise HeadLoadError(f"head '{bot_id}' v{version} is not in the store")
        stored = {name: (bytes(data), digest) for _, name, data, digest in rows
                  if name is not None}
        return decode(bot_id, version, int(rows[0][0]), stored)

    def write(self, tx: psycopg.Connection, bot_id: str, version: int, weights: np.ndarray,
              biases: np.ndarray, labels: tuple[str, ...], *, created: str, source: str,
              step: Step) -> str:
        """(Its `versions` row is inserted first: the blobs reference it.)"""
        encoded = encode(weights, biases, labels)
        with tx.cursor() as cur:
            cur.executemany(f"INSERT INTO {S}.blobs VALUES (%s, %s, %s, %s, %s)",
                            [(bot_id, version, name, *encoded[name]) for name in BLOB_NAMES])
        step("written")
        return combine_digests({name: encoded[name][1] for name in BLOB_NAMES})

    def digest(self, tx: psycopg.Connection, bot_id: str, version: int) -> str | None:
        digests = dict(tx.execute(
            f"SELECT name, sha256 FROM {S}.blobs WHERE bot_id = %s AND version = %s",
            (bot_id, version)).fetchall())
        return combine_digests(digests) if digests else None

    def stored(self, bot_id: str, versions: list[int]) -> list[int]:
        return list(versions)  # a version row without its blobs never commits

    def sweep(self, bot_id: str, registered: set[int]) -> list[int]:
        return []  # a failed writer's blobs were rolled back with its transaction

    def drop(self, bot_id: str, version: int | None = None) -> None:
        pass  # deleted with their versions rows, in that transaction
