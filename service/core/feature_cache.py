"""The feature cache: trunk features by a digest of the image bytes, per tenant unless shared
(`cache_key`), in a bounded LRU (`FeatureCache`). Used by `service.core.engine`."""
from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np


def cache_key(digest: bytes, tenant: str, scope: str) -> bytes:
    """The feature-cache key of an image's digest for a request charged to `tenant`: with the
    scope "tenant", a hash of the digest keyed by the tenant, so that one tenant never hits
    (and, by the hit's speed or `Server-Timing`, learns of) an image another tenant sent;
    with "shared", the digest itself (every tenant hits every other's images)."""
    if scope == "shared":
        return digest
    key = tenant.encode()
    if len(key) > 64:  # blake2b's longest key; tenant names have at most 64 characters
        key = hashlib.blake2b(key).digest()
    return hashlib.blake2b(digest, digest_size=20, key=key).digest()


class FeatureCache:
    """Bounded LRU of trunk features keyed by a digest of the image bytes (`cache_key`: per
    tenant unless the cache is shared). Thread-safe."""

    def __init__(self, max_entries: int):
        self._max = max_entries
        self._data: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: bytes, value: np.ndarray) -> None:
        if self._max <= 0:
            return
        value = np.array(value, np.float32)  # own copy: never a view of the batch array
        value.setflags(write=False)
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._max:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
