"""Shared helpers of the heads tests (plain functions; fixtures live in conftest.py)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from backbone.spec import FEATURE_DIM
from tests.support.builders import random_head  # noqa: F401 - the heads tests import it here
from tests.support.polling import wait_until


def features(n: int = 3, seed: int = 9) -> np.ndarray:
    """[n, 1536] float32 trunk-like features, seeded."""
    return np.random.default_rng(seed).standard_normal((n, FEATURE_DIM)).astype(np.float32)


def version_of(store, bot_id: str) -> int | None:
    """The active version `store` serves for `bot_id`, None if it knows no such bot."""
    from heads import UnknownBot

    try:
        return store.get(bot_id).version
    except UnknownBot:
        return None


def listening(store) -> None:
    """PostgreSQL: watch the store (which starts its listener), wait until the listener has
    connected and the snapshot has caught up with it: from here on, only a new change makes the
    store read its rows again."""
    store.watch()
    wait_until(lambda: store._backend._changes.generation >= 1, 10)
    wait_until(lambda: store.snapshot.data_version == store._backend.data_version(), 10)


def tree_digest(root: str | os.PathLike) -> dict[str, str]:
    """{relative path: sha256 (or 'dir')} of everything under root; {} if root is absent.

    Compare two digests taken while no HeadStore has the store open (SQLite's -wal/-shm files
    exist only while a connection is open).
    """
    root = Path(root)
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[str(Path(dirpath, d).relative_to(root))] = "dir"
        for f in filenames:
            p = Path(dirpath, f)
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def save_checkpoint(prefix: str | os.PathLike, tensors: dict[str, np.ndarray]) -> str:
    """Write a TF checkpoint with exactly these tensor names (as a user's training would)."""
    import tensorflow as tf

    names = sorted(tensors)
    tf.raw_ops.SaveV2(prefix=os.fspath(prefix), tensor_names=names,
                      shape_and_slices=[""] * len(names),
                      tensors=[tf.constant(tensors[n]) for n in names])
    return os.fspath(prefix)


def write_labels(path: str | os.PathLike, labels) -> str:
    Path(path).write_text("".join(f"{label}\n" for label in labels), encoding="utf-8")
    return os.fspath(path)


def is_pg(location: str | os.PathLike) -> bool:
    return str(location).startswith(("postgresql://", "postgres://"))


PG_TABLES = {  # table -> ORDER BY: every row, in a stable order
    "state": "singleton", "versions": "bot_id, version", "blobs": "bot_id, version, name",
    "bots": "bot_id", "history": "id",
}


def pg_rows(url: str) -> dict[str, list[tuple]]:
    """Every row of the store's tables ({} if the schema was never created)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT to_regnamespace('multihead')").fetchone()[0] is None:
            return {}
        return {table: conn.execute(f"SELECT * FROM multihead.{table} ORDER BY {order}")
                .fetchall() for table, order in PG_TABLES.items()}


def pg_execute(url: str, sql: str, params=()) -> list[tuple]:
    """Run one statement on the store's database (autocommit); rows if it returns any."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []


def store_digest(location: str | os.PathLike) -> dict:
    """Everything a store holds, to compare before/after a refusal: the directory tree
    (see tree_digest: take it with no HeadStore open), or every row of the database."""
    if is_pg(location):
        return {table: [tuple(hashlib.sha256(v).hexdigest() if isinstance(v, bytes) else v
                              for v in row) for row in rows]
                for table, rows in pg_rows(str(location)).items()}
    return tree_digest(location)


def stored_entries(location: str | os.PathLike, bot_id: str) -> list[str]:
    """What the store keeps for `bot_id` besides the registry's view: the names in
    heads/<bot_id>/ (version dirs, and any crash leftover), or `v<N>` per version that has a
    versions row or a blob row."""
    if is_pg(location):
        rows = pg_execute(str(location),
                          "SELECT version FROM multihead.versions WHERE bot_id = %s UNION "
                          "SELECT version FROM multihead.blobs WHERE bot_id = %s",
                          (bot_id, bot_id))
        return [f"v{v}" for v in sorted(int(r[0]) for r in rows)]
    bot_dir = Path(location) / "heads" / bot_id
    return sorted(p.name for p in bot_dir.iterdir()) if bot_dir.exists() else []
