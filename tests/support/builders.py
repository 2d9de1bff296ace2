"""Builders of test data, each defined once."""
from __future__ import annotations

import numpy as np

from backbone.spec import FEATURE_DIM


def random_head(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """weights [1536, n], biases [n] and n labels `class-<seed>-<i>`, seeded.

    Scaled so that softmax scores on real trunk features are spread (not all mass on one class).
    """
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((FEATURE_DIM, n)) / np.sqrt(FEATURE_DIM)).astype(np.float32)
    biases = rng.standard_normal(n).astype(np.float32)
    return weights, biases, [f"class-{seed}-{i}" for i in range(n)]


def tenants_with_bots(store, bots: dict[str, str], seed: int = 0) -> dict[str, str]:
    """Each tenant of `bots` ({tenant: its bot}) added to `store` with its bot (3 classes,
    seeded `seed`, `seed` + 1, ...) and an infer key; {tenant: that key's token}."""
    tokens = {}
    for i, (tenant, bot) in enumerate(bots.items()):
        store.add_tenant(tenant)
        store.register(bot, *random_head(3, seed=seed + i), tenant=tenant)
        tokens[tenant] = store.add_key(tenant, "infer")[1]
    return tokens
