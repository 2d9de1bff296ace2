"""What the batcher queues: a `Row` (one image, as `run_batch` sees it) and its `Entry` (the row,
the future its caller awaits, and the other entries queued by the same call); and how entries
are finished: `deliver` a batch's results, `fail` entries, a future's `outcome`, and how a
call that queued several waits for them (`results`).

`service.core.fair.TenantQueue` holds entries and decides which ones a batch takes;
`service.core.booking` gives and takes the queue's room; `service.core.batcher` runs the batches.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from service.core.errors import BatchError, copy_for_waiter


@dataclass(frozen=True, slots=True)
class Row:
    """One queued row, as `run_batch` sees it.

    Attributes:
        payload: the caller's opaque object (e.g. a [299, 299, 3] float32 image and its head).
        group: the bot id the row belongs to.
        deadline: `time.monotonic()` time after which the row is dropped unrun, or None.
        enqueued_s: `time.monotonic()` time at which the row was queued.
        tenant: whom the row is charged to (fair order, queue shares, quotas).
        cost: what the row costs its tenant's counter: 1 for a trunk image, 0 for a row
            whose features are already known.
        due: (when admission expected it answered with nothing queued ahead, when as things
            were): `schedule.Schedule`'s record of its estimate (`Estimate`), or None.
    """

    payload: Any
    group: str
    deadline: float | None
    enqueued_s: float
    tenant: str = ""
    cost: float = 1.0
    due: tuple[float, float] | None = None


class Entry:
    """A row and its future. Identity equality (no dataclass `__eq__`), for `deque.remove`.

    Attributes:
        row: the row.
        future: what the caller awaits: the row's result or exception.
        queued: True exactly while the entry is in the batcher's queue.
        request: the entries queued with it by one call (itself included): a request pushed
            out of the queue leaves it whole.
    """

    __slots__ = ("row", "future", "queued", "request")

    def __init__(self, row: Row, future: asyncio.Future) -> None:
        self.row = row
        self.future = future
        self.queued = True
        self.request: list[Entry] = [self]

    # what `TenantQueue` reads
    @property
    def tenant(self) -> str:
        return self.row.tenant

    @property
    def group(self) -> str:
        return self.row.group

    @property
    def cost(self) -> float:
        return self.row.cost

    @property
    def enqueued_s(self) -> float:
        return self.row.enqueued_s


def deliver(batch: list[Entry], results: Any) -> None:
    """Finishes each entry of `batch` with its result (`results`: one per entry, in order); a
    result that is an exception fails its entry only. A wrong number of results, or no
    sequence at all, fails the whole batch with `BatchError`. Entries already done (their
    client went away while their row ran) are skipped."""
    try:
        n = len(results)
    except TypeError:
        n = None
    if n != len(batch):
        got = "a non-sequence" if n is None else f"{n} results"
        error = BatchError(f"run_batch returned {got} for a batch of {len(batch)} rows")
        fail(batch, error)
        return
    for e, result in zip(batch, results):
        if e.future.done():  # the client went away while its row ran
            continue
        try:
            if isinstance(result, BaseException):
                # score() hands one head's exception to each of its rows: copy it per row.
                e.future.set_exception(copy_for_waiter(result))
            else:
                e.future.set_result(result)
        except Exception as exc:  # noqa: BLE001 - e.g. set_exception(StopIteration())
            e.future.set_exception(BatchError(f"cannot deliver this row's result: {exc!r}"))


def fail(entries: Iterable[Entry], exc: BaseException) -> None:
    """Fails every entry not done yet with its own copy of `exc`."""
    for e in entries:
        if not e.future.done():
            e.future.set_exception(copy_for_waiter(exc))


def outcome(future: asyncio.Future) -> Any:
    """A done future's result, its exception, or `CancelledError()` when it was cancelled."""
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception() or future.result()


async def results(entries: Sequence[Entry], return_exceptions: bool,
                  withdraw: Callable[[Sequence[Entry]], None]) -> list[Any]:
    """The results of one call's entries, in order, once all are done; with
    `return_exceptions` False the first failure is raised as soon as it happens and the
    entries not yet run are withdrawn (`withdraw`), as they are when the caller is cancelled;
    with True, failed rows' exceptions are returned in their place (like `asyncio.gather`)."""
    futures = [e.future for e in entries]
    try:
        await asyncio.wait(
            futures,
            return_when=asyncio.ALL_COMPLETED if return_exceptions else asyncio.FIRST_EXCEPTION,
        )
    except asyncio.CancelledError:
        withdraw(entries)
        raise
    if return_exceptions:
        return [outcome(f) for f in futures]
    failed = next(
        (f for f in futures if f.done() and not f.cancelled() and f.exception() is not None),
        None,
    )
    if failed is None:
        return [f.result() for f in futures]
    withdraw(entries)
    for f in futures:  # mark every exception as retrieved: no "never retrieved" warnings
        if f.done() and not f.cancelled():
            f.exception()
    raise failed.exception()
