"""The run's bots: seeded random heads registered into a store, named `bot-00000`, ...

A random head costs exactly what a trained one does (the same shapes), so the benchmark never
trains anything."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from backbone import FEATURE_DIM


def bot_id(i: int) -> str:
    return f"bot-{i:05d}"


def random_head(rng: np.random.Generator, classes: int) -> tuple[np.ndarray, np.ndarray, list]:
    """(weights [1536, classes], biases [classes], labels) of a seeded random head."""
    weights = (rng.standard_normal((FEATURE_DIM, classes), dtype=np.float32)
               * np.float32(1 / np.sqrt(FEATURE_DIM)))  # [1536, n]
    biases = (rng.standard_normal(classes, dtype=np.float32) * np.float32(0.1))  # [n]
    return weights, biases, [f"class-{i:03d}" for i in range(classes)]


def head_weight_bytes(classes: int) -> int:
    """Bytes of one head's float32 weights and biases."""
    return FEATURE_DIM * classes * 4 + classes * 4


def register_bots(store_dir: str | Path, count: int, classes: int, seed: int, start: int = 0,
                  store=None, on_each: Callable[[float], None] | None = None) -> list[str]:
    """Registers bots `bot_id(start..count-1)` with random heads into `store` (or a store
    opened on `store_dir`, a directory or a PostgreSQL URL); returns their ids. `on_each` gets
    the seconds of each registration."""
    from store import HeadStore

    own = store is None
    store = store or HeadStore(store_dir)
    rng = np.random.default_rng(seed + start)
    ids = []
    try:
        for i in range(start, count):
            weights, biases, labels = random_head(rng, classes)
            t0 = time.perf_counter()
            store.register(bot_id(i), weights, biases, labels, source="bench")
            if on_each is not None:
                on_each(time.perf_counter() - t0)
            ids.append(bot_id(i))
    finally:
        if own:
            store.close()
    return ids


def register_tenant_bots(store_dir: str | Path, tenants: Sequence[str], classes: int,
                         seed: int) -> dict[str, str]:
    """A store at `store_dir` with `tenants`, each owning one random bot `<tenant>-bot`;
    returns {tenant: bot}."""
    from store import HeadStore

    rng = np.random.default_rng(seed)
    bots = {}
    with HeadStore(store_dir) as heads:
        for tenant in tenants:
            heads.add_tenant(tenant)
            weights, biases, labels = random_head(rng, classes)
            bots[tenant] = f"{tenant}-bot"
            heads.register(bots[tenant], weights, biases, labels, source="bench",
                           tenant=tenant)
    return bots
