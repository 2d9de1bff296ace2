"""The protocol-agnostic data plane: images + heads in, per-bot top-k out.

HTTP handlers (native, WebSocket, interop) parse a request, resolve its heads, and call
`Engine.classify` (encoded images) or `Engine.classify_arrays` (images already preprocessed to
float32 [N, 299, 299, 3]); the engine decodes in a thread pool taking the tenants' decodes in
weighted fair order (`service.core.decoding`), looks features up in the feature cache, queues
the misses on the cross-bot `Batcher`, and scores every head. It knows nothing of aiohttp.
Decoding waits while a CPU trunk's batch runs (`service.core.cores`); digests, cache lookups
and the heads of fully cached requests run in a light pool of their own, never behind it.
`run_batch` runs in the batcher's single worker thread: ONE trunk call for the batch, then
each head applied once to the rows that asked for it, and each bot's candidate (shadow or
canary, `service.core.candidates`) once to the same rows' features.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from accounts import Candidate
from accounts.tenants import DEFAULT_TENANT
from backbone import preprocess
from backbone.preprocess import prepare as prepare_preprocessing
from backbone.spec import FEATURE_DIM, INPUT
from heads import Head
from service.core import tracing as trace
from service.core.batcher import Batcher
from service.core.booking import Booking
from service.core.candidates import CandidateStats, Comparison, Route, route_for, route_key
from service.core.cores import Cores, blas_threads, one_blas_thread
from service.core.decoding import HEAVY_DECODE_COST, FairDecodePool, cost_of, in_heavy_lane
from service.core.errors import (
    BadRequest,
    DeadlineExceeded,
    DeadlineUnmeetable,
    Overloaded,
    PayloadTooLarge,
    ShuttingDown,
    error_status,
)
from service.core.feature_cache import FeatureCache, cache_key
from service.core.live_profile import LiveProfile
from service.core.metrics import Metrics
from service.core.quota import Quotas
from service.core.rows import Row
from service.core.schedule import PASSED_WAITING
from service.core.scoring import Item, Prediction, score
from service.core.settings import Settings
from service.core.sharing import light_batch_size, shared_batch_size
from service.core.tracing import NO_BATCH, BatchTrace, NoBatch, Tracing

log = logging.getLogger(__name__)

# NOTE: features of a preprocessed array are cached under a digest with this personalisation, so
# that an array's digest can never collide with the digest of some encoded image's bytes.
_ARRAY_DIGEST_PERSON = b"multihead-fp32"
# Preprocessed images are in [-1, 1]; the slack forgives rounding in a client's own resize.
_ARRAY_RANGE_SLACK = 1e-3


@dataclass(frozen=True)
class Images:
    """The images of one request, as a protocol delivers them: encoded bytes (JPEG, PNG, ...),
    or float32 [N, 299, 299, 3] already preprocessed (see `backbone.spec.INPUT`)."""

    encoded: Sequence[bytes] | None = None
    arrays: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrays) if self.arrays is not None else len(self.encoded or ())


def check_image_count(n_images: int, limit: int) -> None:
    """The one image-count rule of a request, whatever its protocol: at least one image, at most
    `limit` (`max_images_per_request`). Raises BadRequest or PayloadTooLarge (413)."""
    if not n_images:
        raise BadRequest("no image in the request")
    if n_images > limit:
        raise PayloadTooLarge(f"more than {limit} images in one request")


def _refused_at_start(future: concurrent.futures.Future) -> bool:
    """Whether a decode's future ended refused by its start check (nothing decoded)."""
    return (future.done() and not future.cancelled()
            and isinstance(future.exception(), DeadlineUnmeetable))


class Looked(NamedTuple):
    """One input after `Engine._look`: its digest, its feature-cache key, the cached features
    (None: a miss), and what it costs the tenant's quota (`decode_cost`; 0 for a hit)."""

    digest: bytes
    key: bytes
    cached: np.ndarray | None
    cost: float


class Engine:
    """Owns the batcher, the feature cache and the preprocessing pool for one trunk.

    Args:
        quotas: the tenants' token buckets (default: no tenant limited).
        weight, max_queued: a tenant's weight and own cap on queued images, for the batcher
            (default: 1 and none).
        tracing: the spans of each request (`service.core.tracing`); None: tracing is off.
        batch_size: the batcher's batch size (default: `settings.max_batch_size`).
        batch_seconds: the trunk's time per batch alone by size (the profile's `seconds_at`),
            the start of the live profile (`live`) that the batcher's deadlines read; None:
            no deadline is planned, rows are only dropped once theirs passed.
    """

    def __init__(self, trunk, settings: Settings, metrics: Metrics, *,
                 quotas: Quotas | None = None,
                 weight: Callable[[str], float] = lambda tenant: 1.0,
                 max_queued: Callable[[str], int | None] = lambda tenant: None,
                 tracing: Tracing | None = None,
                 candidate_stats: CandidateStats | None = None,
                 batch_size: int | None = None,
                 batch_seconds: Callable[[int], float] | None = None):
        self.trunk = trunk
        self.tracing = tracing
        self.settings = settings
        self.metrics = metrics
        self.candidate_stats = CandidateStats() if candidate_stats is None else candidate_stats
        self.quotas = quotas if quotas is not None else Quotas(lambda tenant: (None, None))
        self.cache = FeatureCache(settings.feature_cache_size)
        prepare_preprocessing()  # OpenCV imported before the first request, not in it
        # Decodes in the tenants' weighted fair order of decode cost (`decoding`); huge ones in
        # a lane of their own at the lowest CPU priority.
        self.decode_pool = FairDecodePool(
            settings.preprocess_threads, weight=weight, scheduler=settings.scheduler,
            thread_name_prefix="multihead-decode", heavy_cost=HEAVY_DECODE_COST)
        # Digests, cache lookups and the heads of fully cached requests: light work that must
        # not queue behind decodes waiting for the trunk's batch (`Cores`).
        self.light_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="multihead-light")
        # A CPU trunk runs alone: decodes wait for its batch, and the batcher gathers the rows
        # being decoded into the next one (`service.core.cores`).
        self.cores = Cores(settings.own_cores and bool(getattr(trunk, "owns_cores", False)),
                           on_wait=metrics.decode_wait_seconds.inc)
        if self.cores.exclusive:  # the heads' BLAS must not spin beside the trunk either
            one_blas_thread()
        # For /readyz, read once: it scans every library loaded (about 1 ms in a server).
        self.blas_threads = blas_threads()
        self.batch_seconds = batch_seconds
        self.live = None if batch_seconds is None else LiveProfile(batch_seconds)
        batch_size = batch_size or settings.max_batch_size
        self.batcher = Batcher(self.run_batch, max_batch_size=batch_size,
                               max_wait_ms=settings.max_wait_ms,
                               max_queue_rows=settings.max_queue_rows,
                               policy=settings.batch_policy, on_batch=metrics.observe_batch,
                               # Rows booked are being decoded: only then is waiting worth it.
                               wait_for_booked_only=True,
                               gather_booked=self.cores.exclusive,
                               scheduler=settings.scheduler, weight=weight,
                               max_queued=max_queued, on_served=metrics.observe_tenant_images,
                               shared_batch_size=shared_batch_size(
                                   batch_seconds, batch_size, settings.shared_batch_ms),
                               light_batch_size=light_batch_size(
                                   batch_seconds, batch_size, settings.shared_batch_ms),
                               batch_seconds=self.live and self.live.upper,
                               claim=self.cores.reserve,
                               upper_batch_size=settings.max_batch_size)
        self.batcher.deadlines.on_late = metrics.observe_rows_late
        self.batcher.deadlines.trunk_took = self.live and self.live.took
        metrics.bind_queue_depth(lambda: self.batcher.queue_depth)
        metrics.bind_tenant_state(self.batcher.tenant_state)

    # -- the worker thread ------------------------------------------------------------------

    def run_batch(self, rows: list[Row]) -> list[list[Prediction] | Exception]:
        """One trunk call for the rows without cached features, then the heads. Worker thread.
        Traced, the batch's spans (`trunk_batch`, each request's `queue_wait` and `heads`)."""
        if self.tracing is None:
            return self._run_batch(rows, NO_BATCH)
        items: list[Item] = [row.payload for row in rows]
        trunk_images = sum(item.features is None for item in items)
        with self.tracing.batch([i.trace for i in items], [i.heads for i in items],
                                trunk_images) as batch:
            return self._run_batch(rows, batch)

    def _run_batch(self, rows: list[Row], batch: BatchTrace | NoBatch
                   ) -> list[list[Prediction] | Exception]:
        """The trunk for the rows without features, then the heads. A row whose deadline
        (`time.monotonic()`) passed before the trunk started (it waited for a running decode,
        `Cores.trunk`) is not run: its result is DeadlineExceeded, as for a row dropped from
        the queue. The rows the trunk runs past their deadline all the same (one passing
        between that check and the trunk's call) are counted per tenant
        (`Metrics.observe_rows_run_expired`)."""
        items: list[Item] = [row.payload for row in rows]
        deadlines = [row.deadline for row in rows]
        features = np.empty((len(items), FEATURE_DIM), np.float32)
        todo = [i for i, item in enumerate(items) if item.features is None]
        for i, item in enumerate(items):
            if item.features is not None:
                features[i] = item.features
        gone: set[int] = set()
        if todo:
            batch_images = np.stack([items[i].image for i in todo])
            with self.cores.trunk():
                gone = _expired(todo, deadlines, time.monotonic())
                if gone:  # rare: copies the images still to run
                    keep = [k for k, i in enumerate(todo) if i not in gone]
                    todo, batch_images = [todo[k] for k in keep], batch_images[keep]
                if todo:
                    start = time.perf_counter()
                    expired = _expired(todo, deadlines, time.monotonic())
                    computed = self.trunk.features(batch_images)
                    took = time.perf_counter() - start
                    if expired:
                        self.metrics.observe_rows_run_expired(
                            collections.Counter(rows[i].tenant for i in expired))
            if todo:
                self.metrics.observe_trunk(len(todo), took)
                self.live and self.live.observe(len(todo), took)
                features[todo] = computed
                for i, row in zip(todo, computed):
                    self.cache.put(items[i].digest, row)
        if not gone:
            return self._score(features, items, batch)
        kept = [i for i in range(len(items)) if i not in gone]
        results: list[list[Prediction] | Exception] = [
            DeadlineExceeded(PASSED_WAITING) for _ in items]
        if kept:
            for i, result in zip(kept, self._score(features[kept], [items[i] for i in kept],
                                                   batch)):
                results[i] = result
        return results

    def _score(self, features: np.ndarray, items: list[Item], batch: BatchTrace | NoBatch
               ) -> list[list[Prediction] | Exception]:
        start = time.perf_counter()
        with batch.heads():
            results = score(features, items, self.observe_candidate)
        self.metrics.heads_seconds.observe(time.perf_counter() - start)
        return results

    def observe_candidate(self, live: Head, route: Route, comparison: Comparison | None,
                          answered: int, failed: int) -> None:
        """A candidate's scoring, into the per-process stats and the metrics."""
        version = route.head.version
        self.candidate_stats.observe(live.bot_id, version, route.mode, comparison,
                                     answered=answered, failed=failed)
        self.metrics.observe_candidate(
            live.bot_id, version, images=comparison.images if comparison else 0,
            agreed=comparison.agreed if comparison else 0,
            abs_diff=comparison.abs_diff if comparison else 0.0, answered=answered,
            failed=failed)

    # -- the event loop ---------------------------------------------------------------------

    def _look(self, data: bytes, tenant: str) -> Looked:
        """Digest and feature-cache lookup of one encoded image for `tenant`, and for a miss
        its decode cost from its header (`decode_cost`). Light pool thread."""
        digest = hashlib.blake2b(data, digest_size=20).digest()
        looked = self._cached(digest, tenant)
        if looked.cached is not None:
            return looked
        return looked._replace(cost=cost_of(data, self.settings.max_image_pixels))

    def _cached(self, digest: bytes, tenant: str) -> Looked:
        key = cache_key(digest, tenant, self.settings.feature_cache_scope)
        cached = self.cache.get(key)
        self.metrics.observe_cache(hit=cached is not None)
        return Looked(digest, key, cached, 0.0 if cached is not None else 1.0)

    def _decode(self, data: bytes, check: Callable[[], None] | None = None) -> np.ndarray:
        """Decode + preprocess of one encoded image (a cache miss), after `check` (which may
        refuse it: `_start_check`). Decode pool thread; in the heavy lane (lowest CPU
        priority) the trunk does not wait for it."""
        with contextlib.nullcontext() if in_heavy_lane() else self.cores.decode():
            if check is not None:
                check()
            start = time.perf_counter()
            image = preprocess(data, max_pixels=self.settings.max_image_pixels)
            self.metrics.decode_seconds.observe(time.perf_counter() - start)
        return image

    def _look_array(self, image: np.ndarray, tenant: str) -> Looked:
        """Range check, digest and cache lookup of one preprocessed image. Light pool thread.

        Args:
          image: float32 [299, 299, 3], C-contiguous.
        """
        low, high = INPUT.value_range
        # NaN fails these comparisons too.
        if not ((image >= low - _ARRAY_RANGE_SLACK) & (image <= high + _ARRAY_RANGE_SLACK)).all():
            finite = image[np.isfinite(image)]
            seen = (f"values in [{finite.min():.4g}, {finite.max():.4g}]" if finite.size
                    else "no finite value")
            if finite.size < image.size:
                seen += " and NaN/Inf"
            raise BadRequest(f"a preprocessed image must be {INPUT.describe()}; got {seen}")
        digest = hashlib.blake2b(image, digest_size=20, person=_ARRAY_DIGEST_PERSON).digest()
        return self._cached(digest, tenant)

    @staticmethod
    def _as_is(image: np.ndarray, check: Callable[[], None] | None = None) -> np.ndarray:
        if check is not None:
            check()
        return image

    def _start_check(self, deadline: float | None) -> Callable[[], None] | None:
        """What an image's decode calls as it starts (None: nothing to check, no deadline or
        no batch profile): raises DeadlineUnmeetable when its row could no longer be answered
        in time (`Schedule.too_late_to_start`), so that no work is spent on it. Decode
        thread: reads only."""
        schedule = self.batcher.deadlines
        if deadline is None or schedule.seconds is None:
            return None

        def check() -> None:
            now = time.monotonic()
            if schedule.too_late_to_start(deadline, now):
                raise DeadlineUnmeetable(
                    f"the request's deadline is in {max(deadline - now, 0) * 1e3:.0f} ms, "
                    "less than the batch running and then a batch of one take now that its "
                    "images' decoding can start: refused before any decoding")
        return check

    async def classify(self, images: Sequence[bytes], heads: Sequence[Head], *,
                       top_k: int, deadline: float | None = None,
                       tenant: str = DEFAULT_TENANT,
                       candidates: Sequence[Candidate | None] = (),
                       route_key: str | None = None) -> list[list[Prediction]]:
        """Scores every image with every head: result[i][j] is image i under heads[j], charged
        to `tenant` (its quota, its fair share of the trunk).

        `candidates` (empty, or one per head: that bot's candidate or None) are scored on the
        same features; a canary answers for its bot when the request's routing key (`route_key`,
        else the first image's digest) falls in its share (`service.core.candidates`).

        Raises:
          RateLimited (the tenant's quota, before any image is decoded), QueueShareExceeded,
          Overloaded (both before decoding), InvalidImage / ImageTooLarge (first bad image,
          before anything is queued), DeadlineExceeded, ShuttingDown, or a head's error.
        """
        check_image_count(len(images), self.settings.max_images_per_request)
        return await self._run(self._look, self._decode, images, tuple(heads), top_k, deadline,
                               tenant, candidates, route_key)

    async def classify_arrays(self, images: np.ndarray, heads: Sequence[Head], *,
                              top_k: int, deadline: float | None = None,
                              tenant: str = DEFAULT_TENANT,
                              candidates: Sequence[Candidate | None] = (),
                              route_key: str | None = None) -> list[list[Prediction]]:
        """Like `classify`, for images already preprocessed: float32 [N, 299, 299, 3] in [-1, 1].

        Same batcher, limits and deadlines; features are cached by a digest of each image's
        float32 bytes.

        Raises:
          BadRequest (wrong shape, values outside [-1, 1], NaN/Inf), PayloadTooLarge (too many
          images), then as `classify`.
        """
        images = np.asarray(images)
        if images.ndim != 4 or images.shape[1:] != INPUT.shape:
            raise BadRequest(f"preprocessed images must have shape [N, "
                             f"{', '.join(map(str, INPUT.shape))}], got {list(images.shape)}")
        check_image_count(images.shape[0], self.settings.max_images_per_request)
        images = np.ascontiguousarray(images, dtype=np.float32)
        return await self._run(self._look_array, self._as_is, images, tuple(heads), top_k,
                               deadline, tenant, candidates, route_key,
                               decode_pool=self.light_pool)

    async def _run(self, look, decode, inputs, heads: tuple[Head, ...], top_k: int,
                   deadline: float | None, tenant: str,
                   candidates: Sequence[Candidate | None] = (),
                   given_key: str | None = None, *,
                   decode_pool: concurrent.futures.Executor | None = None
                   ) -> list[list[Prediction]]:
        """`look` (digest, feature cache) of every input in the light pool, then `decode` of
        the misses in `decode_pool` (default: the decode pool), then the heads (and the trunk
        for the misses); raises the first failed row's error.

        Admission before work, in order, all before any image is decoded:
        - the deadline (with a batch profile, `batch_seconds`): the rows must be expected to
          be answered before it (`Batcher.expected_at`: the batch running, the rows the
          scheduler takes before them, the trunk's live times, the slack the estimates were
          seen to need: `service.core.schedule`), else DeadlineUnmeetable;
        - the tenant's quota takes each cache miss's decode cost (`Quotas.take`; the cost,
          read from the image's header by `look`: `backbone.preprocess.decode_cost`, at
          least 1 token, more for an image larger or deeper than 640 x 480 RGB 8-bit, or
          its encoded bytes / 640 x 480 x 3 when more: `decoding.cost_of`; a
          preprocessed array costs 1, a hit nothing); refused, RateLimited;
        - the request's one queue-room check: the rows' room is booked in the batcher
          (`Batcher.book`: the queue bound, the tenant's share), so a full queue refuses a
          request (Overloaded, QueueShareExceeded) before any decoding, and the rows are
          queued on that booking without another check. While rows are booked the batcher
          knows more are coming and waits for them (up to max_wait_ms); the booking is
          released when the rows are queued or will not be;
        - the last check, as each image's decode starts (in its decode thread, after any wait
          for the cores or the decode pool): an image whose row could no longer be answered
          in time even in the batch right after the one running
          (`Schedule.too_late_to_start`) is not decoded, and the request fails with
          DeadlineUnmeetable (`_start_check`).
        The tokens are given back if the request is refused before any decoding. Once
        decoding started, a decoded image stays charged whatever happens to the request
        (a bad image after it, a deadline, a push out of the queue): decoding is the work
        the tokens pay for, with the trunk's. When an image fails to decode, the decodes of
        the request not started yet are cancelled (they never run) and their tokens given
        back; those already running finish, charged.
        """
        if self.batcher.closing:  # refused before any work, even a digest
            raise ShuttingDown("the service is shutting down and accepts no new requests")
        if deadline is not None and deadline <= time.monotonic():  # even a cached answer
            self.metrics.observe_refusal(tenant, "deadline_exceeded")
            raise DeadlineExceeded("the request's deadline passed before its images were read")
        loop = asyncio.get_running_loop()
        looked = await asyncio.gather(*(loop.run_in_executor(self.light_pool, look, x, tenant)
                                        for x in inputs))
        misses = [i for i, seen in enumerate(looked) if seen.cached is None]
        group = ",".join(sorted({h.bot_id for h in heads}))
        routes = () if not any(candidates) else tuple(
            None if c is None else route_for(c, h.bot_id, route_key(given_key, looked[0][0]))
            for h, c in zip(heads, candidates))
        if not misses:
            items = [Item(None, seen.cached, seen.key, heads, top_k, routes=routes)
                     for seen in looked]
            self._observe_bots(heads, len(items))
            # Every image seen before: no quota, no trunk, no queue; the heads' numpy still
            # runs off the event loop (a 1001-class head on 32 rows is milliseconds).
            features = np.stack([item.features for item in items])
            with trace.span(self.tracing, trace.HEADS, heads=heads):
                results = await loop.run_in_executor(self.light_pool, score, features, items,
                                                     self.observe_candidate)
        else:
            with trace.span(self.tracing, trace.ADMISSION,
                            {trace.TENANT: tenant, trace.IMAGES: len(misses)}):
                cost = [looked[i].cost for i in misses]
                booking = self._admit(tenant, sum(cost), len(inputs), deadline)
            # Tokens to give back if the request fails: all of them until decoding starts,
            # then those of the images never decoded; a decoded image stays charged.
            due = sum(cost)
            try:
                with booking:
                    with trace.span(self.tracing, trace.DECODE, {trace.IMAGES: len(misses)}):
                        check = self._start_check(deadline)
                        futures = [
                            decode_pool.submit(decode, inputs[i], check)
                            if decode_pool is not None else
                            self.decode_pool.schedule(tenant, c, decode, inputs[i], check)
                            for i, c in zip(misses, cost)]
                        due = 0
                        # Pushed out of the queue for a tenant within its share: the decodes
                        # not started yet never run (the gather ends, cancelled).
                        booking.on_push = lambda: [f.cancel() for f in futures]
                        try:
                            images = await asyncio.gather(*map(asyncio.wrap_future, futures))
                        except BaseException as exc:
                            # One failed (or the request went away, or was pushed out): the
                            # decodes not started yet never run, and are not charged, nor
                            # those refused as they started (nothing decoded).
                            due = sum(c for c, f in zip(cost, futures)
                                      if f.cancel() or _refused_at_start(f))
                            if booking.pushed is not None:
                                raise booking.pushed from None
                            if isinstance(exc, DeadlineUnmeetable):
                                self.batcher.deadlines.refused_at_start(
                                    tenant, booking.due, deadline, time.monotonic())
                            raise
                    decoded = dict(zip(misses, images))
                    row_trace = (self.tracing.row_trace(tenant) if self.tracing is not None
                                 else None)
                    items = [Item(decoded.get(i), seen.cached, seen.key, heads, top_k,
                                  row_trace, routes=routes)
                             for i, seen in enumerate(looked)]
                    self._observe_bots(heads, len(items))
                    costs = [0.0 if item.features is not None else 1.0 for item in items]
                    results = await self.batcher.submit_many(
                        items, group=group, deadline=deadline, booking=booking, tenant=tenant,
                        costs=costs)
            except BaseException as exc:
                self.quotas.refund(tenant, due)
                if isinstance(exc, (Overloaded, DeadlineExceeded)):
                    self.metrics.observe_refusal(tenant, error_status(exc)[1])
                raise
        for result in results:
            if isinstance(result, Exception):
                if isinstance(result, DeadlineExceeded):  # dropped unrun: counted per tenant
                    self.metrics.observe_refusal(tenant, error_status(result)[1])
                raise result
        return results

    def _admit(self, tenant: str, misses: float, rows: int,
               deadline: float | None = None) -> Booking:
        """A request's admission: its deadline (`Batcher.expected_at`: its rows' time alone
        plus their expected wait times the slack that wait needs), then the tenant's quota
        takes its misses' decode costs, then the queue room of its rows is booked
        (`Batcher.book`). A refusal is counted; when the queue refuses, the tokens are given
        back (nothing was decoded)."""
        try:
            due = None if deadline is None else self.batcher.expected_at(tenant, rows)
            if due is not None and deadline is not None:
                now = time.monotonic()
                need = due.need_s(now)  # its time alone, and its wait times its slack
                if need > deadline - now:
                    raise DeadlineUnmeetable(
                        f"the request's deadline is in {max(deadline - now, 0) * 1e3:.0f} ms; "
                        f"its {rows} image(s) would be answered in {need * 1e3:.0f} ms (after "
                        "the batch running and the rows the scheduler takes before them)")
            self.quotas.take(tenant, misses)
        except (Overloaded, DeadlineExceeded) as exc:
            self.metrics.observe_refusal(tenant, error_status(exc)[1])
            raise
        try:
            return self.batcher.book(rows, tenant,
                                     due=None if due is None else (due.alone, due.due))
        except BaseException as exc:
            self.quotas.refund(tenant, misses)
            if isinstance(exc, Overloaded):
                self.metrics.observe_refusal(tenant, error_status(exc)[1])
            raise

    def _observe_bots(self, heads: Sequence[Head], n: int) -> None:
        for head in heads:
            self.metrics.observe_bot(head.bot_id, n)

    async def close(self) -> None:
        """Stops accepting, finishes the queued rows, then stops the pools."""
        await self.batcher.close(timeout_s=self.settings.request_timeout_s)
        # NOTE: waiting for the decode threads blocks: off the event loop.
        loop = asyncio.get_running_loop()
        for pool in (self.decode_pool, self.light_pool):
            await loop.run_in_executor(None, functools.partial(pool.shutdown, wait=True))


def _expired(todo: Sequence[int], deadlines: Sequence[float | None], now: float) -> set[int]:
    """Which of the rows `todo` (indices into `deadlines`) are past their deadline at `now`."""
    return {i for i in todo if deadlines[i] is not None and deadlines[i] <= now}
