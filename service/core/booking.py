"""Room in the batcher's queue: the one room check (`QueueRoom.book`) and the `Booking` it gives.

A caller that prepares its rows before queueing them (decoding images) books their room first
(admission before work) and hands the `Booking` to `Batcher.submit_many`, which queues the booked
rows without checking again; `Batcher.submit` and a `submit_many` without a booking book and
queue at once. The room counts the rows queued and the rows booked, against:

- `max_queue_rows` for all (503 `Overloaded` beyond it, with the time the queue needs to drain
  as Retry-After);
- a tenant's own `max_queued`, under either scheduler, and under `fair` its weighted share of
  the queue (`service.core.fair.TenantQueue.share`): 429 `QueueShareExceeded` beyond them, once
  the tenant has rows waiting;
- a tenant within its share is never refused for another's flood: when the queue is full, the
  newest requests of the tenants most over their shares are pushed out instead (`push_out`):
  a request still decoding (its booking: newer than its tenant's queued rows) first, then the
  queued ones. A booking pushed out gives its room back at once and fails its request with
  QueueShareExceeded when it would queue (`Booking.use`); its decodes not started yet are
  cancelled (`Booking.on_push`).

No asyncio here beyond failing the futures of the rows pushed out; the `Batcher` says when a
booking released may let a waiting batch go (`on_release`).
"""
from __future__ import annotations

import collections
from collections.abc import Callable

from service.core.errors import BadRequest, Overloaded, QueueShareExceeded
from service.core.fair import TenantQueue
from service.core.rows import fail


class Booking:
    """Room for `rows` rows in the queue bound, held from `Batcher.book` until the rows are
    queued (`Batcher.submit_many(..., booking=)`) or the booking is released (leaving its
    `with` block, or `release()`). Released twice or after use: nothing happens."""

    __slots__ = ("rows", "tenant", "_room", "pushed", "on_push", "made", "due", "backlog")

    def __init__(self, room: QueueRoom, rows: int, tenant: str = "") -> None:
        self.rows = rows
        self.tenant = tenant
        self._room: QueueRoom | None = room
        # Set when pushed out to make room for a tenant within its share: what `use` raises.
        self.pushed: QueueShareExceeded | None = None
        # Called when pushed out (the holder cancels the work not started yet).
        self.on_push: Callable[[], object] | None = None
        self.made: float | None = None  # when `Batcher.book` made it (its clock)
        # When admission expects its rows answered: (with nothing queued ahead, as things are).
        self.due: tuple[float, float] | None = None
        self.backlog = 0  # rows to prepare before its last one when made (`schedule.backlog`)

    @property
    def held(self) -> bool:
        return self._room is not None

    def release(self) -> None:
        """Gives the room back (the rows will not come) and lets a waiting batch re-evaluate."""
        room, self._room = self._room, None
        if room is not None:
            room.unbook(self, self.rows, self.tenant)
            room.on_release()

    def push(self, error: QueueShareExceeded) -> None:
        """Pushed out: the room goes back now, `use` raises `error`. For the room only."""
        room, self._room = self._room, None
        self.pushed = error
        if room is not None:
            room.unbook(self, self.rows, self.tenant)
        if self.on_push is not None:
            self.on_push()

    def use(self, room: QueueRoom, rows: int) -> None:
        """The booked rows are being queued now: the room passes from the booking to the
        queue (no await between this and the rows entering the queue). For the batcher only.

        Raises:
            QueueShareExceeded: the booking was pushed out (`push`).
            RuntimeError: the booking was released or used, or is another batcher's; or more
                rows than booked are queued.
        """
        if self.pushed is not None:
            raise self.pushed
        if self._room is not room:
            raise RuntimeError("this booking was released, used, or is another batcher's")
        if rows > self.rows:
            raise RuntimeError(f"{rows} rows queued on a booking of {self.rows}")
        self._room = None
        room.unbook(self, self.rows, self.tenant)

    def __enter__(self) -> Booking:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class QueueRoom:
    """The room of one batcher's queue: the rows booked, and the check that gives a booking.

    Args:
        queue: the batcher's queue (its rows, per tenant, and their shares).
        max_queue_rows: most rows queued and booked together.
        max_batch_size: the batch size (no tenant's share is below one batch).
        max_queued: `max_queued(tenant) -> int | None`: a tenant's own cap on queued and
            booked rows (None: none).
        retry_after_s: `retry_after_s() -> float`, the Retry-After of a refusal.
        on_release: called when a booking is released unused (the rows will not come: a
            batch waiting for them may go).
    """

    def __init__(self, queue: TenantQueue, *, max_queue_rows: int, max_batch_size: int,
                 max_queued: Callable[[str], int | None], retry_after_s: Callable[[], float],
                 on_release: Callable[[], None]) -> None:
        self.queue = queue
        self.max_queue_rows = max_queue_rows
        self.max_batch_size = max_batch_size
        self.on_release = on_release
        self.booked = 0  # rows of the bookings held
        self.tenant_booked: collections.Counter[str] = collections.Counter()
        self._bookings: dict[Booking, None] = {}  # the bookings held, oldest first
        self._max_queued = max_queued
        self._retry_after_s = retry_after_s

    def book(self, n: int, tenant: str = "") -> Booking:
        """Holds room for `n` rows of `tenant`: the one room check (see the module doc).

        Raises:
            BadRequest: `n` exceeds `max_queue_rows` (they could never fit).
            QueueShareExceeded: `tenant` has rows queued and these would pass its share of
                the queue (fair) or its own max_queued.
            Overloaded: no room now (with the time the queue needs to drain, as Retry-After).
        """
        if n > self.max_queue_rows:
            raise BadRequest(
                f"{n} images in one request exceed the queue bound "
                f"max_queue_rows={self.max_queue_rows}"
            )
        q = self.queue
        mine = q.rows.get(tenant, 0) + self.tenant_booked.get(tenant, 0)
        cap = self._max_queued(tenant)
        if mine and cap is not None and mine + n > cap:
            raise QueueShareExceeded(self._retry_after_s(), (
                f"tenant '{tenant}' has {mine} images waiting, its max_queued is {cap}; "
                "retry when they are served"))
        share = None
        if q.fair:
            share = q.share(tenant, self.max_queue_rows, self.max_batch_size,
                            self.tenant_booked)
            # A tenant alone has the whole queue as its share: full, the server is (503 below).
            if mine and mine + n > share and share < self.max_queue_rows:
                raise QueueShareExceeded(self._retry_after_s(), (
                    f"tenant '{tenant}' has {mine} images waiting, its share of the queue is "
                    f"{share} now; retry when they are served"))
        if len(q) + self.booked + n > self.max_queue_rows and share is not None:
            self.push_out(tenant, len(q) + self.booked + n - self.max_queue_rows)
        if len(q) + self.booked + n > self.max_queue_rows:
            raise Overloaded(retry_after_s=self._retry_after_s())
        self.booked += n
        self.tenant_booked[tenant] += n
        booking = Booking(self, n, tenant)
        self._bookings[booking] = None
        return booking

    def unbook(self, booking: Booking, n: int, tenant: str = "") -> None:
        """Gives back the room of `booking`'s `n` rows of `tenant` (used, released, pushed)."""
        self._bookings.pop(booking, None)
        self.booked -= n
        self.tenant_booked[tenant] -= n
        if self.tenant_booked[tenant] <= 0:
            del self.tenant_booked[tenant]

    def push_out(self, tenant: str, need: int) -> None:
        """Makes room for `need` rows of `tenant` (within its share) by failing the newest
        requests of the tenants most over their shares, with QueueShareExceeded: a tenant's
        booking (decoding, its newest) before its queued requests."""
        q = self.queue
        while need > 0:
            victims = q.victims(tenant, self.max_queue_rows, self.max_batch_size,
                                self.tenant_booked)
            for victim in victims:
                booking = next((b for b in reversed(self._bookings) if b.tenant == victim),
                               None)
                newest = q.newest_of(victim) if booking is None else None
                if booking is not None or newest is not None:
                    break
            else:
                return
            error = QueueShareExceeded(self._retry_after_s(), (
                f"tenant '{victim}' is over its share of the queue: its newest images "
                "made room for a tenant within its share; retry later"))
            if booking is not None:
                need -= booking.rows
                booking.push(error)
                continue
            request = [e for e in newest.request if e.queued]
            q.remove_many(request)
            for e in request:
                e.queued = False
            fail(request, error)
            need -= len(request)
