"""The decode pool: image decodes taken in the tenants' weighted fair order, not first come.

A decode of a hostile image (a 36-megapixel 16-bit PNG) takes seconds; with a FIFO pool, one
tenant's request of several such images held every other tenant's decodes behind them (issue
34). Here each decode waits in its tenant's FIFO, and a free thread takes the next decode from
the backlogged tenant of the smallest weighted virtual counter of decode cost: the same Virtual
Token Counter as the trunk's queue (`service.core.fair.TenantQueue`, reused as it is), counted
in decode cost (`backbone.preprocess.decode_cost`: 1 for an image up to 640 x 480 RGB 8-bit,
234 for that PNG) instead of trunk images. A tenant that starts decoding is lifted to the
smallest counter among the backlogged, so it cannot bank credit while idle, and its first
decode is taken before the backlogged tenants' next ones whenever it has not been served more
(cost / weight) than they have: a tenant's cheap decode waits at most for the decodes already
running (about one decode per thread), never for another tenant's queue.

With `scheduler="fifo"` decodes are taken in arrival order (what the thread pool did).

Heavy decodes have a lane of their own. Fair order alone does not stop a decode already running
from holding its thread and a core for seconds: measured on 2 cores (issue 34's isolation
bench), a tenant's requests of 36-megapixel 16-bit PNGs took B's p99 from 58 ms to 1.9 s, its
decodes waiting for a thread and its batches for the cores (`service.core.cores`). So a decode
of cost above `HEAVY_DECODE_COST` (8: about 2.4 megapixels of RGB 8-bit) is queued for the
heavy lane: `heavy_threads` threads (1) of their own, in the same weighted fair order among
tenants, at the lowest CPU priority the OS gives (nice 19 on Linux, set per thread): they use
the cores the trunk, the event loop and the ordinary decodes leave idle, and the trunk does not
wait for them (`in_heavy_lane`: the engine's decode skips the cores gate there). An ordinary
decode never waits behind a heavy one; a heavy one waits for idle cores (under a full load of
other work it may wait until its request's deadline).

A decode cancelled before it started (`Future.cancel`: its request failed) never runs and is
not counted. Work is charged to its tenant's counter when a thread takes it.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from accounts.tenants import DEFAULT_TENANT
from backbone.errors import ImageTooLarge, InvalidImage
from backbone.preprocess import REFERENCE_DECODE_BYTES, decode_cost, peek
from service.core.fair import TenantQueue

log = logging.getLogger(__name__)

# Above this decode cost a decode goes to the heavy lane (see the module doc).
HEAVY_DECODE_COST = 8.0
# The heavy lane's threads' niceness (19: the lowest priority).
HEAVY_NICE = 19

_lane = threading.local()


def in_heavy_lane() -> bool:
    """Whether the calling thread is a heavy-lane decode thread."""
    return getattr(_lane, "heavy", False)


def _lower_priority(nice: int) -> None:
    """This thread's CPU priority to `nice` (Linux: per thread); best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: full priority
        log.warning("the heavy decode lane runs at normal priority: %r", exc)


def cost_of(data: bytes, max_pixels: int) -> float:
    """The cost of encoded image bytes, in reference images: their decode's from their header
    (`decode_cost`; 1 when the decode will refuse the image at once: no readable header, more
    than `max_pixels`), or their own size / REFERENCE_DECODE_BYTES when that is larger. Bytes
    cost whether they decode or not (read, held, digested): a 10 MB body of padding costs 11,
    as its 10 MB of pixels would; an image's encoded bytes are fewer than its decoded ones."""
    try:
        header = peek(data)
    except (InvalidImage, ImageTooLarge):
        header = None
    cost = decode_cost(header) if header is not None and header.pixels <= max_pixels else 1.0
    return max(cost, len(data) / REFERENCE_DECODE_BYTES)


@dataclass(eq=False)
class _Work:
    """One queued decode (`service.core.fair.Queued`)."""

    tenant: str
    cost: float
    enqueued_s: float  # arrival order (a sequence number: the tie-break needs no clock)
    fn: Callable = field(repr=False)
    args: tuple = field(repr=False)
    future: concurrent.futures.Future = field(repr=False)
    group: str = ""


class FairDecodePool(concurrent.futures.Executor):
    """A fixed set of threads running the queued work in weighted fair order. Thread-safe.

    Args:
        threads: the worker threads (all started now, named `{thread_name_prefix}_{i}`).
        weight: `weight(tenant) -> float`, as for the trunk's queue (read at each take).
        scheduler: "fair" or "fifo" (`service.core.fair.SCHEDULERS`).
        heavy_cost: decodes above this cost go to the heavy lane (None: no heavy lane).
        heavy_threads: the heavy lane's threads (`{thread_name_prefix}_heavy_{i}`).
    """

    def __init__(self, threads: int, *, weight: Callable[[str], float] = lambda tenant: 1.0,
                 scheduler: str = "fair", thread_name_prefix: str = "multihead-decode",
                 heavy_cost: float | None = None, heavy_threads: int = 1) -> None:
        if threads < 1 or heavy_threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads!r}, {heavy_threads!r}")
        self.heavy_cost = heavy_cost
        self._queue = TenantQueue(scheduler, weight=weight)
        self._heavy = TenantQueue(scheduler, weight=weight)
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, args=(self._queue, False),
                                          name=f"{thread_name_prefix}_{i}", daemon=True)
                         for i in range(threads)]
        if heavy_cost is not None:
            self._threads += [threading.Thread(target=self._work, args=(self._heavy, True),
                                               name=f"{thread_name_prefix}_heavy_{i}",
                                               daemon=True) for i in range(heavy_threads)]
        for thread in self._threads:
            thread.start()

    def is_heavy(self, cost: float) -> bool:
        """Whether a decode of `cost` goes to the heavy lane."""
        return self.heavy_cost is not None and cost > self.heavy_cost

    def schedule(self, tenant: str, cost: float, fn: Callable, *args) -> concurrent.futures.Future:
        """Queues `fn(*args)` for `tenant` at decode cost `cost`; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            queue = self._heavy if self.is_heavy(cost) else self._queue
            queue.push([_Work(tenant, float(cost), float(next(self._order)), fn, args, future)])
            self._cond.notify_all()
        return future

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        """`Executor.submit`: work of the default tenant, at cost 1."""
        if kwargs:
            return self.schedule(DEFAULT_TENANT, 1.0, lambda: fn(*args, **kwargs))
        return self.schedule(DEFAULT_TENANT, 1.0, fn, *args)

    def counter(self, tenant: str) -> float:
        """`tenant`'s virtual counter of ordinary decodes: their cost taken so far, divided by
        its weight."""
        with self._cond:
            return self._queue.counter(tenant)

    @property
    def queued(self) -> int:
        """Decodes queued, not started yet (cancelled ones included until a thread drops them)."""
        return len(self._queue) + len(self._heavy)

    def _work(self, queue: TenantQueue, heavy: bool) -> None:
        if heavy:
            _lane.heavy = True
            _lower_priority(HEAVY_NICE)
        while True:
            with self._cond:
                while not queue and not self._closed:
                    self._cond.wait()
                if not queue:
                    return  # shut down, and nothing left to run
                # A cancelled decode leaves the queue uncounted; one taken is marked running.
                taken = queue.take(1, lambda w: w.future.set_running_or_notify_cancel())
            for work in taken:
                try:
                    result = work.fn(*work.args)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                    work.future.set_exception(exc)
                else:
                    work.future.set_result(result)
                del work

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new work; the queued work still runs (unless `cancel_futures`); `wait`: returns
        once every thread is done."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                for work in [*self._queue.pop_all(), *self._heavy.pop_all()]:
                    work.future.cancel()
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
