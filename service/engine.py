"""The protocol-agnostic data plane: images + heads in, per-bot top-k out.

HTTP handlers (native, WebSocket) parse a request, resolve its heads, and call
`Engine.classify`; the engine decodes in a thread pool, looks features up in the feature
cache, queues the misses on the cross-bot `Batcher`, and scores every head. It knows nothing of
aiohttp. `run_batch` runs in the batcher's single worker thread: ONE trunk call for the batch,
then each head applied once to the rows that asked for it.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backbone import FEATURE_DIM, preprocess
from heads import Head
from service.batcher import Batcher, Row
from service.errors import BadRequest, PayloadTooLarge
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """One head's answer for one image."""

    bot_id: str
    version: int
    labels_scores: list[tuple[str, float]]


@dataclass(frozen=True)
class Item:
    """One image of a request: the batcher's row payload."""

    image: np.ndarray | None  # [299, 299, 3] float32, None when the features were cached
    features: np.ndarray | None  # [1536] from the feature cache
    digest: bytes
    heads: tuple[Head, ...]
    top_k: int


class FeatureCache:
    """Bounded LRU of trunk features keyed by a digest of the image bytes. Thread-safe."""

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


def score(features: np.ndarray, items: Sequence[Item]) -> list[list[Prediction] | Exception]:
    """Applies each distinct head once to the rows that asked for it.

    Args:
      features: float32 [R, 1536], row r for items[r].

    Returns:
      Per item, its predictions in the order of its heads, or the Exception of a failing head
      (that item alone fails; other rows are untouched).
    """
    by_head: dict[int, list[int]] = collections.defaultdict(list)
    heads: dict[int, Head] = {}
    for row, item in enumerate(items):
        for head in item.heads:
            by_head[id(head)].append(row)
            heads[id(head)] = head
    answers: dict[tuple[int, int], list[tuple[str, float]]] = {}
    failed: dict[int, Exception] = {}
    for key, rows in by_head.items():
        head = heads[key]
        try:
            probabilities = head.probabilities(features[rows])  # [len(rows), n]
        except Exception as exc:  # a broken head fails its rows only
            log.exception("head %s v%s failed", head.bot_id, head.version)
            for row in rows:
                failed[row] = exc
            continue
        for position, row in enumerate(rows):
            k = min(items[row].top_k, head.n_classes)
            p = probabilities[position]
            top = np.argpartition(-p, k - 1)[:k]
            top = top[np.argsort(-p[top], kind="stable")]
            answers[(row, key)] = [(head.labels[i], float(p[i])) for i in top]
    results: list[list[Prediction] | Exception] = []
    for row, item in enumerate(items):
        if row in failed:
            results.append(failed[row])
            continue
        results.append([Prediction(h.bot_id, h.version, answers[(row, id(h))]) for h in item.heads])
    return results


class Engine:
    """Owns the batcher, the feature cache and the preprocessing pool for one trunk."""

    def __init__(self, trunk, settings: Settings, metrics: Metrics):
        self.trunk = trunk
        self.settings = settings
        self.metrics = metrics
        self.cache = FeatureCache(settings.feature_cache_size)
        self.decode_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.preprocess_threads, thread_name_prefix="multihead-decode")
        self.batcher = Batcher(self.run_batch, max_batch_size=settings.max_batch_size,
                               max_wait_ms=settings.max_wait_ms,
                               max_queue_rows=settings.max_queue_rows,
                               policy=settings.batch_policy, on_batch=metrics.observe_batch)
        metrics.bind_queue_depth(lambda: self.batcher.queue_depth)

    # -- the worker thread ------------------------------------------------------------------

    def run_batch(self, rows: list[Row]) -> list[list[Prediction] | Exception]:
        """One trunk call for the rows without cached features, then the heads. Worker thread."""
        items: list[Item] = [row.payload for row in rows]
        features = np.empty((len(items), FEATURE_DIM), np.float32)
        todo = [i for i, item in enumerate(items) if item.features is None]
        for i, item in enumerate(items):
            if item.features is not None:
                features[i] = item.features
        if todo:
            start = time.perf_counter()
            computed = self.trunk.features(np.stack([items[i].image for i in todo]))
            self.metrics.trunk_seconds.observe(time.perf_counter() - start)
            features[todo] = computed
            for i, row in zip(todo, computed):
                self.cache.put(items[i].digest, row)
        start = time.perf_counter()
        results = score(features, items)
        self.metrics.heads_seconds.observe(time.perf_counter() - start)
        return results


    # -- the event loop ---------------------------------------------------------------------

    def _prepare(self, data: bytes, heads: tuple[Head, ...], top_k: int) -> Item:
        """Digest, cache lookup and (on a miss) decode + preprocess. Decode pool thread."""
        digest = hashlib.blake2b(data, digest_size=20).digest()
        cached = self.cache.get(digest)
        self.metrics.observe_cache(hit=cached is not None)
        if cached is not None:
            return Item(None, cached, digest, heads, top_k)
        start = time.perf_counter()
        image = preprocess(data, max_pixels=self.settings.max_image_pixels)
        self.metrics.decode_seconds.observe(time.perf_counter() - start)
        return Item(image, None, digest, heads, top_k)

    async def classify(self, images: Sequence[bytes], heads: Sequence[Head], *,
                       top_k: int, deadline: float | None = None) -> list[list[Prediction]]:
        """Scores every image with every head: result[i][j] is image i under heads[j].

        Raises:
          InvalidImage / ImageTooLarge (first bad image, before anything is queued),
          Overloaded, DeadlineExceeded, ShuttingDown, or a head's error.
        """
        if not images:
            raise BadRequest("no image in the request")
        if len(images) > self.settings.max_images_per_request:
            raise PayloadTooLarge(f"{len(images)} images in one request, the limit is "
                             f"{self.settings.max_images_per_request}")
        heads = tuple(heads)
        loop = asyncio.get_running_loop()
        items = await asyncio.gather(*(
            loop.run_in_executor(self.decode_pool, self._prepare, data, heads, top_k)
            for data in images))
        group = ",".join(sorted({h.bot_id for h in heads}))
        for head in heads:
            self.metrics.observe_bot(head.bot_id, len(images))
        if all(item.features is not None for item in items):
            # Every image seen before: no trunk, no queue. Heads are microseconds of numpy.
            results = score(np.stack([item.features for item in items]), items)
        else:
            results = await self.batcher.submit_many(list(items), group=group, deadline=deadline)
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    async def close(self) -> None:
        """Stops accepting, finishes the queued rows, then stops the pools."""
        await self.batcher.close(timeout_s=self.settings.request_timeout_s)
        self.decode_pool.shutdown(wait=True)
