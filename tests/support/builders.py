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
