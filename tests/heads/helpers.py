"""Shared helpers of the heads tests (plain functions; fixtures live in conftest.py)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from backbone.spec import FEATURE_DIM


def random_head(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """weights [1536, n], biases [n] and n labels, seeded."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((FEATURE_DIM, n)) / np.sqrt(FEATURE_DIM)).astype(np.float32)
    biases = rng.standard_normal(n).astype(np.float32)
    return weights, biases, [f"class-{seed}-{i}" for i in range(n)]


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
