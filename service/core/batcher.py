"""Dynamic cross-bot batching, in pure asyncio.

Rows (one image each, plus whatever the caller needs to finish it, e.g. the resolved head) are
queued by `submit`; one background task forms batches and hands each to a BLOCKING
`run_batch(rows) -> results` callable in ONE dedicated worker thread, so the event loop never
blocks and at most one batch runs at a time (the trunk is one graph). While a batch runs, new
rows accumulate for the next one.

A batch is flushed when `max_batch_size` rows are waiting or `max_wait_ms` after its FIRST row
was queued, whichever comes first; the wait is measured from the oldest row's arrival, so rows
that piled up while the previous batch ran go out at once.

Which rows a batch takes is `service.core.fair.TenantQueue`'s: `fair` (the default) by the
tenants' weighted virtual counters (VTC), FIFO within a tenant, `fifo` in arrival order; either
way whatever waits, up to its size (under `fair` shorter: a share per tenant waiting beside a
light tenant, `service.core.sharing`; its most urgent rows first for its earliest deadline,
`service.core.schedule`).
Under `fair` a tenant queues at most its weighted share of `max_queue_rows` (429 `queue_share`
beyond it); one within its share is never refused for another's flood: the flooder's newest
requests are pushed out instead.

The batcher knows nothing of TensorFlow, heads or HTTP; `group` (the bot id) is used only by the
`per_group` policy and for stats, `tenant` by the fair scheduler and the shares. Shaped like Ray
Serve's `_BatchQueue` and MLServer's adaptive batcher, it guards against the bugs those had (a
wrong number of results, a failing `run_batch`, futures whose client went away, a row failing).

    batcher = Batcher(run_batch, max_batch_size=16, max_wait_ms=5, max_queue_rows=256)
    result = await batcher.submit(payload, group="acme-7", tenant="acme")
    await batcher.close()    # stop accepting, finish queued rows, stop the worker thread

Queue room is checked in ONE place, `book(n)` (`service.core.booking`): a caller that prepares
its rows before queueing them books their room first and hands the `Booking` to `submit_many`.
A `Row` in an `Entry`, and how its future is finished: `service.core.rows`.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from service.core.booking import Booking, QueueRoom
from service.core.errors import BatchError, DeadlineExceeded, ShuttingDown
from service.core.fair import SCHEDULERS, TenantQueue
from service.core.rows import Entry, Row, deliver, fail, results
from service.core.schedule import Estimate, Schedule, backlog
from service.core.sharing import Sharing

log = logging.getLogger(__name__)

POLICIES = ("mixed", "per_group")

# gather_booked: a batch waits for rows being prepared while one of them came this recently.
GATHER_IDLE_S = 0.05

RunBatch = Callable[[list[Row]], Sequence[Any]]
OnBatch = Callable[[int, int, list[float], float], None]
OnServed = Callable[[dict[str, int]], None]


class Batcher:
    """Queue rows from many callers and run them in batches on one worker thread.

    Args:
        run_batch: BLOCKING `run_batch(rows: list[Row]) -> list[result]`, one result per row in
            order. A result that is an `Exception` instance fails that row only. Called in the
            worker thread, one call at a time.
        max_batch_size: most rows per batch (>= 1).
        max_wait_ms: longest the first row of a batch waits for more rows (>= 0).
        max_queue_rows: most rows waiting (not counting the running batch), with the rows
            booked (`book`); a submission or booking that would exceed it raises `Overloaded`
            at once.
        executor: the executor `run_batch` runs in. It must have ONE worker (one batch at a
            time is the contract). Default: a single-thread executor owned by the batcher and
            shut down by `close()`; a passed executor is left running.
        policy: "mixed" (a batch holds any mix of groups, FIFO) or "per_group" (a batch holds
            one group only, like per-model servers; kept for the benchmark's comparison).
        on_batch: stats hook `on_batch(size, groups, queue_wait_s, run_s)` called on the event
            loop after each batch; `queue_wait_s` has one entry per row. Errors in it are logged.
        wait_for_booked_only: when True, a waiting batch waits out max_wait_ms only while
            some rows are booked (being prepared by their callers: they will come); with none
            booked it runs at once. False (default): it always waits up to max_wait_ms.
        gather_booked: when True (the trunk runs alone on the cores, `service.core.cores`:
            decoding cannot overlap its batch), a batch that is not full waits for the rows
            being decoded, past max_wait_ms, until none is booked, the batch is full, or none
            came for GATHER_IDLE_S; with none booked but fewer rows queued than the last batch
            had, it waits max_wait_ms for its callers coming back. "mixed" policy only.
        clock: the monotonic clock of arrivals, waits, deadlines and batch times (tests pass
            a controlled one; a change of time is noticed on the next submit or `poke()`).
        scheduler: "fair" (rows taken by the tenants' weighted counters, queue shares; see
            `service.core.fair`) or "fifo" (arrival order, one bound for all). The
            "per_group" policy takes one group's rows in arrival order either way.
        weight: `weight(tenant) -> float` (default 1 for all), read at each batch and booking.
        max_queued: `max_queued(tenant) -> int | None`: a tenant's own cap on queued and
            booked rows (None: none), under either scheduler.
        on_served: hook `on_served({tenant: rows})` called on the event loop with each
            batch's rows per tenant. Errors in it are logged.
        shared_batch_size: a tenant's share of a batch beside a light tenant (fair only; the
            batch takes this many rows per tenant waiting: `sharing`); None: full batches.
        light_batch_size: the most rows of a batch that carries a light tenant's rows
            (`sharing`); None: a share per tenant waiting, as any shared batch.
        upper_batch_size: the most rows of a fair batch at saturation, with no light tenant
            and no deadline close (`sharing`); None: max_batch_size. "mixed" policy only.
        claim: called on the event loop as each batch is taken, before it is handed to the
            worker thread (the engine's: `Cores.reserve`, so that no decode starts in that
            moment and makes the batch's trunk wait for it); it returns what to call once the
            batch is done, to give back what the batch did not take. None: nothing.
        batch_seconds: the trunk's time for a batch of n (the engine's live profile's
            `upper`), for deadlines (`service.core.schedule.Schedule`: admission's estimate,
            `expected_at`; rows that can no longer make theirs dropped; a fair batch's most
            urgent rows first); None: rows are dropped once their deadline passed, no more.

    NOTE: asyncio objects are created on first use inside the running loop (or by `start()`),
    and the batcher is then bound to that loop.
    """

    def __init__(
        self,
        run_batch: RunBatch,
        *,
        max_batch_size: int,
        max_wait_ms: float,
        max_queue_rows: int,
        executor: concurrent.futures.Executor | None = None,
        policy: str = "mixed",
        on_batch: OnBatch | None = None,
        wait_for_booked_only: bool = False,
        gather_booked: bool = False,
        clock: Callable[[], float] = time.monotonic,
        scheduler: str = "fair",
        weight: Callable[[str], float] = lambda tenant: 1.0,
        max_queued: Callable[[str], int | None] = lambda tenant: None,
        on_served: OnServed | None = None,
        shared_batch_size: int | None = None,
        light_batch_size: int | None = None,
        batch_seconds: Callable[[int], float] | None = None,
        claim: Callable[[], Callable[[], None]] | None = None,
        upper_batch_size: int | None = None,
    ) -> None:
        if not callable(run_batch):
            raise TypeError("run_batch must be callable")
        if not _is_int(max_batch_size) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not max_wait_ms >= 0:  # also rejects NaN
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        if not _is_int(max_queue_rows) or max_queue_rows < 1:
            raise ValueError(f"max_queue_rows must be an int >= 1, got {max_queue_rows!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, "
                             f"got {scheduler!r}")
        self._run_batch = run_batch
        self._claim = claim
        self._max_batch_size = max_batch_size
        self.sharing = Sharing(shared_batch_size, max_batch_size,  # `.shared`: the share
                               light=light_batch_size,
                               upper=upper_batch_size if policy == "mixed" else None)
        self.deadlines = Schedule(batch_seconds)  # admission, drops and picks by deadline
        self._max_wait_s = float(max_wait_ms) / 1000.0
        self._policy = policy
        self._on_batch = on_batch
        self._wait_for_booked_only = wait_for_booked_only
        self._gather_booked = gather_booked
        # gather_booked: when rows were last queued or a batch last finished (the decodes it
        # held up start again then).
        self._last_progress_s = -math.inf
        self._last_batch_rows = 0  # rows of the last batch run (gather_booked)
        self._on_served = on_served
        self._clock = clock
        self._own_executor = executor is None
        self._executor: concurrent.futures.Executor = executor or _single_thread_executor()

        self._queue = TenantQueue(scheduler, weight=weight)
        self._room = QueueRoom(self._queue, max_queue_rows=max_queue_rows,
                               max_batch_size=max_batch_size, max_queued=max_queued,
                               retry_after_s=self.retry_after_s, on_release=self.poke)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._close_task: asyncio.Task | None = None
        self._closing = False
        self._batches_run = 0
        self._rows_expired = 0
        self._run_s_avg: float | None = None  # moving average of run_s, for Retry-After

    # -- public state ---------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Rows waiting for a batch (not counting the running batch)."""
        return len(self._queue)

    @property
    def batches_run(self) -> int:
        """Batches handed to `run_batch` so far (including failed ones)."""
        return self._batches_run

    @property
    def rows_expired(self) -> int:
        """Rows dropped unrun because their deadline passed."""
        return self._rows_expired

    @property
    def closing(self) -> bool:
        """True once `close()` was called: submissions raise `ShuttingDown`."""
        return self._closing

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    def next_batch(self, now: float | None = None) -> tuple[int, int]:
        """(most rows the next batch takes, how many are queued): `Sharing.batch` (fair)."""
        if not self._queue.fair:
            return self._max_batch_size, len(self._queue)
        now = self._clock() if now is None else now
        return self.sharing.batch(now, self._queue.rows, self._room.tenant_booked, lambda n: (
            self.deadlines.leaves_room(self._queue, now, n, self._max_batch_size)))

    def expected_at(self, tenant: str, rows: int) -> Estimate | None:
        """`Schedule.expected_at` in batches of the next one's size; None without a profile."""
        now = self._clock()
        return self.deadlines.expected_at(self._queue, self._room.tenant_booked, tenant, rows,
                                          self.next_batch(now)[0], now)

    def _full(self, now: float) -> bool:
        size, ready = self.next_batch(now)
        return ready >= size

    policy = property(lambda self: self._policy)
    scheduler = property(lambda self: self._queue.scheduler)

    def tenant_state(self) -> dict[str, tuple[int, float]]:
        """{tenant: (rows queued, its fair counter)} of the tenants with queued rows or a
        counter (the counter is weighted trunk images served; 0 under fifo)."""
        q = self._queue
        return {t: (q.rows.get(t, 0), q.counter(t)) for t in {*q.rows, *q.counters}}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind to the running loop and start the batching task (submit does it lazily too)."""
        self._ensure_started()

    async def close(self, *, timeout_s: float | None = None) -> None:
        """Stop accepting (`ShuttingDown`), finish the queued rows (at once, no max_wait_ms),
        then stop the worker thread. With `timeout_s`, rows still queued when it passes fail
        with `ShuttingDown`; the batch in `run_batch` is always waited for (what it uses can
        be closed right after). Safe to call more than once and concurrently."""
        self._closing = True
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close(timeout_s))
        await asyncio.shield(self._close_task)

    # -- submitting -----------------------------------------------------------------------------

    def book(self, n: int, tenant: str = "", due: tuple[float, float] | None = None) -> Booking:
        """Holds room for `n` rows in the queue bound (the one room check, `QueueRoom.book`),
        counting the rows queued and booked. A caller that prepares rows before submitting
        them books first (admission before work) and passes the booking to `submit_many`.
        `due`: when admission expects the rows answered, alone and as things are
        (`schedule.Estimate`'s (alone, due): `schedule.Schedule` learns from it).

        Raises:
            ShuttingDown: `close()` was called.
            BadRequest: `n` exceeds `max_queue_rows` (they could never fit).
            QueueShareExceeded: `tenant` has rows queued and these would pass its share of
                the queue (fair) or its own max_queued.
            Overloaded: no room now (with the time the queue needs to drain, as Retry-After).
        """
        if self._closing:
            raise ShuttingDown("the service is shutting down and accepts no new requests")
        booking = self._room.book(n, tenant)  # its rows are booked now: counted in the backlog
        booking.made, booking.due = self._clock(), due
        booking.backlog = backlog(self._queue.fair, self._room.tenant_booked, booking.tenant, 0)
        return booking

    def poke(self) -> None:
        """Re-evaluate the waiting batch now (e.g. a clock moved, or rows booked will not
        come). Safe to call from the event loop at any time."""
        if self._wakeup is not None:
            self._wakeup.set()

    async def submit(self, payload: Any, *, group: str, deadline: float | None = None,
                     tenant: str = "", cost: float = 1.0) -> Any:
        """Queue one row and wait for its result.

        Raises:
            Overloaded: the queue is full (nothing was queued).
            ShuttingDown: `close()` was called.
            DeadlineExceeded: `deadline` (time.monotonic() based) passed before the row ran.
            Exception: whatever `run_batch` raised for the batch, or returned for this row.
        A caller cancelled (gone) before the row runs takes its row out of the queue.
        """
        (entry,) = self._enqueue((payload,), group, deadline, tenant=tenant, costs=(cost,))
        try:
            return await entry.future
        except asyncio.CancelledError:
            self._discard(entry)
            raise

    async def submit_many(
        self,
        payloads: Iterable[Any],
        *,
        group: str,
        deadline: float | None = None,
        return_exceptions: bool = False,
        booking: Booking | None = None,
        tenant: str = "",
        costs: Sequence[float] | None = None,
    ) -> list[Any]:
        """Queue several rows atomically (all or none: the queue bound never splits them).

        Returns the results in order. With `return_exceptions=False`, as soon as one row fails
        its exception is raised and the request's rows not yet run are withdrawn; with True,
        failed rows' exceptions are returned in their place (like `asyncio.gather`).
        Raises `BadRequest` if there are more rows than `max_queue_rows` (they could never fit),
        `Overloaded` if they do not fit now (see `book`), unless `booking` holds their room:
        the caller booked it before preparing them, so they fit (one check per request).
        The rows are `tenant`'s (a booking's own tenant wins), each costing `costs[i]`
        (default 1). Under the fair scheduler they may be pushed out of the queue for a tenant
        within its share: then QueueShareExceeded.
        """
        entries = self._enqueue(tuple(payloads), group, deadline, booking, tenant=tenant,
                                costs=costs)
        return await results(entries, return_exceptions, self._withdraw) if entries else []

    # -- internals: queue -----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._wakeup = asyncio.Event()
        elif self._loop is not loop:
            raise RuntimeError("this Batcher is bound to another event loop")
        if (self._task is None or self._task.done()) and not self._closing:
            # A finished task here means the batching loop died of a bug (logged in
            # _on_task_done); start a fresh one rather than hang every later request.
            self._task = loop.create_task(self._batch_loop(), name="multihead-batcher")
            self._task.add_done_callback(self._on_task_done)

    def _enqueue(self, payloads: Sequence[Any], group: str, deadline: float | None,
                 booking: Booking | None = None, *, tenant: str = "",
                 costs: Sequence[float] | None = None) -> list[Entry]:
        self._ensure_started()
        if self._closing:  # also for booked rows: close() may have begun since their booking
            if booking is not None:
                booking.release()
            raise ShuttingDown("the service is shutting down and accepts no new requests")
        n = len(payloads)
        if costs is not None and len(costs) != n:
            raise ValueError(f"{len(costs)} costs for {n} rows")
        made = None if booking is None else booking.made
        due = None if booking is None else booking.due
        if booking is None:
            if n == 0:
                return []
            booking = self.book(n, tenant)
        tenant = booking.tenant
        booking.use(self._room, n)
        if n == 0:
            return []
        now = self._clock()
        self._last_progress_s = now
        self.sharing.queued(tenant, now)
        if made is not None:  # booked before the rows were prepared: decoded since
            self.deadlines.queued_after(tenant, now - made, booking.backlog)
        if deadline is not None and deadline <= now:
            self.poke()  # the booked rows will not come
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        assert self._loop is not None and self._wakeup is not None
        was_empty = not self._queue
        entries = [
            Entry(Row(p, group, deadline, now, tenant, 1.0 if costs is None else costs[i], due),
                   self._loop.create_future())
            for i, p in enumerate(payloads)
        ]
        for e in entries:
            e.request = entries
        self._queue.push(entries)
        # Wake the batching task only when it may have something to do: the queue just became
        # non-empty (it may be idle), a batch may now be full, or the last booked rows came
        # (nothing more to wait for). Its timer covers the rest.
        if (was_empty or self._full(now)
                or (self._wait_for_booked_only and not self._room.booked)):
            self._wakeup.set()
        return entries

    def _discard(self, entry: Entry) -> None:
        """Remove a still-queued entry (its caller went away)."""
        if entry.queued:
            self._queue.remove(entry)
            entry.queued = False

    def _withdraw(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            if not e.future.done():
                e.future.cancel()
            self._discard(e)

    def retry_after_s(self) -> float:
        """Estimate of when the queue will have room: batches ahead x the recent batch time."""
        per_batch = self._run_s_avg if self._run_s_avg is not None else max(self._max_wait_s, 0.1)
        batches_ahead = math.ceil(len(self._queue) / self._max_batch_size) + 1
        return min(60.0, max(1.0, batches_ahead * per_batch))

    # -- internals: forming batches ------------------------------------------------------------

    def _ready_group(self, now: float) -> tuple[bool, str | None, float]:
        """Is a batch ready? Returns (ready, group or None for mixed, seconds until it will be)."""
        oldest = self._queue.oldest().row
        due_in = oldest.enqueued_s + self._max_wait_s - now
        if self._wait_for_booked_only and self._room.booked == 0:
            # Nobody else is on the way: waiting out max_wait_ms would only add latency.
            due_in = min(due_in, 0.0)
        if self._policy == "mixed":
            size, queued = self.next_batch(now)
            # A batch waits for more rows only while its rows' deadlines allow it.
            start_in, full = self.deadlines.start_in(self._queue, now, queued), queued >= size
            if self._queue.fair and self._gather_booked and not self._closing:
                # A light tenant the last batch answered may be on its way back.
                back_in = self.sharing.return_in(now, self._queue.rows, self._room.tenant_booked,
                                                 self.deadlines.seconds, start_in)
                if back_in > 0:
                    return False, None, back_in
            if self._gather_booked and not full and not self._closing and start_in > 0:
                if self._room.booked:
                    # Rows are being decoded and cannot be while the trunk runs: wait for them
                    # while they keep coming.
                    idle_in = self._last_progress_s + GATHER_IDLE_S - now
                    if idle_in > 0:
                        return False, None, min(max(due_in, idle_in), start_in)
                elif len(self._queue) < self._last_batch_rows:
                    # Fewer rows than the last batch had, whose callers were just answered: they
                    # may be on their way back; wait max_wait_ms after the last row for them.
                    back_in = self._last_progress_s + self._max_wait_s - now
                    if back_in > 0:
                        return False, None, min(back_in, start_in)
            return self._closing or min(due_in, start_in) <= 0 or full, None, min(due_in, start_in)
        # per_group: the oldest row's group when its time is up (or when closing); otherwise any
        # group that already has a full batch, oldest-first. The earliest timer of all groups is
        # the oldest row's, so `due_in` is the right sleep either way.
        groups = self._queue.groups
        if self._closing or due_in <= 0 or groups[oldest.group] >= self._max_batch_size:
            return True, oldest.group, due_in
        if any(count >= self._max_batch_size for count in groups.values()):
            for e in self._queue.entries:  # the full group whose first row is oldest
                if groups[e.row.group] >= self._max_batch_size:
                    return True, e.row.group, due_in
        return False, None, due_in

    def _take(self, group: str | None, now: float) -> list[Entry]:
        """Remove up to max_batch_size live rows (of `group`, if given) from the queue, in the
        scheduler's order (picked for deadlines: `Schedule.picker`), after failing those that
        can no longer be answered in time (`Schedule.drop_doomed`)."""
        self._rows_expired += self.deadlines.drop_doomed(self._queue, now)

        def live(e: Entry) -> bool:
            e.queued = False
            return not e.future.done()  # else cancelled by a caller not yet gone

        return self._queue.take(self.next_batch(now)[0], live, group,
                                pick=self.deadlines.picker(now))

    async def _next_batch(self) -> list[Entry] | None:
        """Wait until a batch is ready and take it; None when closing and nothing is left."""
        assert self._wakeup is not None
        while True:
            if not self._queue:
                if self._closing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            now = self._clock()
            ready, group, due_in = self._ready_group(now)
            if ready:
                return self._take(group, now)
            self._wakeup.clear()
            try:
                async with asyncio.timeout(due_in if math.isfinite(due_in) else None):
                    await self._wakeup.wait()
            except TimeoutError:
                pass

    # -- internals: running batches ------------------------------------------------------------

    async def _batch_loop(self) -> None:
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[Entry]) -> None:
        assert self._loop is not None
        rows = [e.row for e in batch]
        start = self._clock()
        queue_wait_s = [start - r.enqueued_s for r in rows]
        self._batches_run += 1
        self._last_batch_rows = len(rows)
        self.deadlines.running(start, len(rows))
        give_back = self._claim() if self._claim is not None else None
        ran = rows  # the rows not dropped as the trunk started (`run_batch`)
        try:
            results = await self._loop.run_in_executor(self._executor, self._run_batch, rows)
        except asyncio.CancelledError:
            # Only close(timeout_s=...) cancels this task.
            fail(batch, ShuttingDown("the service shut down before this request finished"))
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of run_batch fails this batch only
            log.warning("batch of %d rows failed: %r", len(rows), exc)
            fail(batch, exc)
        else:
            deliver(batch, results)
            ran = [r for r, res in zip(rows, results) if not isinstance(res, DeadlineExceeded)]
            self._rows_expired += len(rows) - len(ran)
        finally:
            if give_back is not None:
                give_back()
        end = self._clock()
        self.deadlines.ran(rows, end, ran)
        run_s = end - start
        self._last_progress_s = max(self._last_progress_s, end)
        self.sharing.ran((r.tenant for r in rows), end)
        self._run_s_avg = run_s if self._run_s_avg is None else 0.8 * self._run_s_avg + 0.2 * run_s
        if self._on_batch is not None:
            try:
                self._on_batch(len(rows), len({r.group for r in rows}), queue_wait_s, run_s)
            except Exception:  # noqa: BLE001 - stats must never break serving
                log.exception("on_batch hook failed")
        if self._on_served is not None:
            served = collections.Counter(r.tenant for r in rows if r.cost > 0)
            try:
                self._on_served(dict(served))
            except Exception:  # noqa: BLE001 - stats must never break serving
                log.exception("on_served hook failed")

    def _on_task_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a bug in this module: never leave callers hanging
            log.error("batching task died", exc_info=exc)
            self._fail_queued(BatchError("the batcher failed; please retry"))

    def _fail_queued(self, exc: BaseException) -> None:
        entries = self._queue.pop_all()
        for e in entries:
            e.queued = False
        fail(entries, exc)

    async def _close(self, timeout_s: float | None) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
        task = self._task
        if task is not None and not task.done():
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(task)
            except TimeoutError:
                self._fail_queued(ShuttingDown("the service shut down before this request ran"))
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - already logged by _on_task_done
                pass
        self._fail_queued(ShuttingDown("the service shut down before this request ran"))
        loop = asyncio.get_running_loop()
        if self._own_executor:
            # Joins the worker (after any batch still inside run_batch) off the event loop.
            await loop.run_in_executor(None, self._executor.shutdown, True)
        elif task is not None:
            # A no-op queued behind a batch still inside run_batch (one worker) to wait for it.
            await loop.run_in_executor(self._executor, lambda: None)


def _single_thread_executor() -> concurrent.futures.ThreadPoolExecutor:
    # NOTE: one worker = at most one batch in run_batch at a time (the trunk is one graph).
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="multihead-batch")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
