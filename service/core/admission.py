"""Admission before work: a process-wide budget of request bytes in flight, shared by tenants.

A transport asks the budget before it reads a body: a request whose declared length does not
fit is refused while its bytes are still on the wire; a chunked body is counted as it streams.
What was admitted is released when the request's answer is done, so memory is bounded by the
budget, not by what clients send. No web framework here.

The budget (`max_inflight_bytes`) is divided like the queue and the sockets
(`service.core.shares.Shares`): a tenant holding bytes may hold at most its weighted share
(`Tenancy.weight`) among the tenants holding bytes and itself (alone: all of it); beyond it it
is refused with 429 `inflight_share` (InflightShareExceeded, Retry-After). A tenant within its
share that finds the budget full makes room by pushing out the newest pushable reservation of
the tenant most over its share: a request whose body is not read yet (from its admission to
the end of `read_body`: it fails with the 429 at its next chunk, and HTTP closes its
connection) or an open WebSocket (closed with 1013, `inflight_share`). A request whose body is
read holds bytes that are in memory until its answer: it is not pushed out; when only such
holders are over their shares, the newcomer gets 503 `overloaded`. A tenant alone that would
pass the whole budget is refused with 429 `inflight_share` too: what fills it is its own; only
requests without a tenant find the server full (503 `overloaded`). NOTE: a reservation pushed
out gives its bytes back at once, while the buffer of a declared length lives until its next
chunk arrives (or the body's rate limit ends it).
Requests without a tenant (the operator's, anyone's with --auth none) count under "".
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from service.core.errors import BadRequest, InflightShareExceeded, Overloaded, PayloadTooLarge
from service.core.memory import TRIM_AFTER_BYTES
from service.core.shares import Shares

# What a refused client is told to wait: a body admitted is usually served within a second.
RETRY_AFTER_S = 1.0


class ByteBudget:
    """Bytes reserved by requests in flight, at most `limit_bytes`, shared by tenants
    (`service.core.shares.Shares`: see the module doc). Thread-safe.

    Args:
      weight: a tenant's weight (`Tenancy.weight`); None: every tenant weighs the same.
      on_burst_end: called (outside the lock) when a release leaves the bytes in flight at
        least `burst_bytes` below their peak since the last call and at most half of it: a
        burst of large bodies is over (`service.core.memory.Trimmer` gives their memory back).
    """

    def __init__(self, limit_bytes: int, *, weight: Callable[[str], float] | None = None,
                 on_burst_end: Callable[[], object] | None = None,
                 burst_bytes: int = TRIM_AFTER_BYTES) -> None:
        if limit_bytes < 1:
            raise ValueError("limit_bytes must be >= 1")
        self.limit_bytes = int(limit_bytes)
        self._shares = Shares(self.limit_bytes, weight or (lambda tenant: 1.0),
                              over_share=_over_share, full=self._full,
                              alone_over_share=bool)
        self._peak = 0  # since the last burst end
        self._on_burst_end = on_burst_end
        self._burst_bytes = burst_bytes
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._shares.used

    def held(self, tenant: str) -> int:
        """The bytes `tenant` holds now."""
        with self._lock:
            return self._shares.held(tenant)

    def _full(self) -> Overloaded:
        return Overloaded(RETRY_AFTER_S, f"server busy: {self._shares.used} of "
                          f"{self.limit_bytes} request bytes in flight; retry after "
                          f"{RETRY_AFTER_S:.0f} s")

    def reserve(self, n: int, tenant: str = "", holder: object = None) -> None:
        """Takes `n` bytes for `holder` of `tenant`, or raises (nothing taken): the tenant's
        share (InflightShareExceeded), the budget (Overloaded). The holders pushed out to make
        room are told (`Reservation.push_out`), outside the lock."""
        with self._lock:
            pushed = self._shares.take(tenant, holder, n)
            self._peak = max(self._peak, self._shares.used)
        for push in pushed:
            push()

    def pushable(self, tenant: str, holder: object, push: Callable[[], object] | None) -> None:
        """`holder` may be pushed out from now on, by `push` (None: no longer)."""
        with self._lock:
            self._shares.pushable(tenant, holder, push)

    def release(self, n: int | None = None, tenant: str = "", holder: object = None) -> None:
        """Gives back `n` bytes of `holder` (None: all it holds; nothing once pushed out)."""
        with self._lock:
            self._shares.release(tenant, holder, n)
            used = self._shares.used
            ended = (self._on_burst_end is not None
                     and self._peak - used >= self._burst_bytes
                     and 2 * used <= self._peak)
            if ended:
                self._peak = used
        if ended:
            self._on_burst_end()


def _over_share(tenant: str, held: int, share: int) -> InflightShareExceeded:
    return InflightShareExceeded(RETRY_AFTER_S, (
        f"tenant '{tenant}' has {held} request bytes in flight, its share is {share} now; "
        f"retry after {RETRY_AFTER_S:.0f} s"))


class Reservation:
    """The bytes one request holds for its tenant; `take` adds to them, `close` gives them all
    back. While `pushable` (a body being read, an open WebSocket) it may be pushed out to make
    room for a tenant within its share: its bytes are given back at once, and its next `take`
    or `check` raises InflightShareExceeded."""

    def __init__(self, budget: ByteBudget, tenant: str = "") -> None:
        self._budget = budget
        self.tenant = tenant
        self.bytes = 0
        self.pushed: InflightShareExceeded | None = None
        self._on_push: Callable[[], object] | None = None

    def take(self, n: int) -> None:
        self.check()
        self._budget.reserve(n, self.tenant, self)
        self.bytes += n

    def check(self) -> None:
        """Raises InflightShareExceeded once pushed out."""
        if self.pushed is not None:
            raise self.pushed

    def allow_push(self, on_push: Callable[[], object] | None = None) -> None:
        """From now on the reservation may be pushed out; `on_push` is then called (on the
        thread that made the room: e.g. to close a WebSocket)."""
        self._on_push = on_push
        self._budget.pushable(self.tenant, self, self.push_out)

    def forbid_push(self) -> None:
        """No longer pushed out (its bytes are in memory until the answer)."""
        self._budget.pushable(self.tenant, self, None)
        self._on_push = None

    @contextlib.contextmanager
    def pushable(self, on_push: Callable[[], object] | None = None) -> Iterator[None]:
        """`allow_push` within it."""
        self.allow_push(on_push)
        try:
            yield
        finally:
            self.forbid_push()

    def push_out(self) -> None:
        """Pushed out (the budget has forgotten its bytes already)."""
        self.bytes = 0
        self.pushed = InflightShareExceeded(RETRY_AFTER_S, (
            f"tenant '{self.tenant}' is over its share of the request bytes in flight: this "
            "request made room for a tenant within its share; retry later"))
        if self._on_push is not None:
            self._on_push()

    def close(self) -> None:
        if self.bytes:
            self._budget.release(None, self.tenant, self)
            self.bytes = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body over the limit of {limit} bytes")


def admit(length: int | None, limit: int, held: Reservation) -> None:
    """Admission before the body is read: a declared length over the per-request `limit` is
    PayloadTooLarge (413), one that does not fit the budget Overloaded (503 + Retry-After)."""
    if length:
        if length > limit:
            raise too_large(limit)
        held.take(length)


async def read_body(chunks: AsyncIterator[bytes], length: int | None, limit: int,
                    held: Reservation) -> bytes | bytearray:
    """The whole body from a transport's chunks, within the admission rules.

    With a declared `length` (already admitted by `admit`) the chunks fill ONE buffer of that
    size in place (growing a buffer and copying it peaks at about 3x the body); a different
    length is BadRequest. Without one (chunked), each chunk is counted against the budget as it
    arrives and the body is cut at `limit` (413). Until it has read the body, the reservation
    may be pushed out (from its admission: `Reservation.allow_push`): the next chunk is then
    InflightShareExceeded.
    """
    held.allow_push()
    try:
        held.check()
        return await _read(chunks, length, limit, held)
    finally:
        held.forbid_push()


async def _read(chunks: AsyncIterator[bytes], length: int | None, limit: int,
                held: Reservation) -> bytes | bytearray:
    if length is not None:
        body = bytearray(length)
        filled = 0
        with memoryview(body) as view:
            async for chunk in chunks:
                if filled + len(chunk) > length:
                    raise BadRequest(f"body longer than its Content-Length of {length}")
                held.check()
                view[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
        if filled != length:
            raise BadRequest(f"body of {filled} bytes, its Content-Length says {length}")
        return body
    parts, total = [], 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise too_large(limit)
        held.take(len(chunk))
        parts.append(chunk)
    return b"".join(parts)


# The longest a 429 is held before it is answered (seconds), how long a refusal of what a tenant
# sent (400, 404, 409, 413) is held, and how many of one tenant's refusals are held at once
# (beyond: answered at once).
PACE_MAX_S = 1.0
PACE_SENT_S = 0.1
PACE_MAX_HELD = 64
# A tenant with this many refusals held already is flooding: its next ones are held
# PACE_FLOOD_S (30 clients sending 10 MB bodies refused: held 1 s, they cost 371 MB of loopback
# and 1.4 s of the attacker's client CPU in 10 s and took a quiet tenant's p99 from 39 to
# 69 ms on 2 cores; held 2 s, 226 MB, 0.8 s and 48 ms).
PACE_FLOOD_HELD = 8
PACE_FLOOD_S = 2.0
# The refusals of what a tenant sent that are held PACE_SENT_S: not 401 (no tenant is known),
# 403 (a key's scope), 405 nor 408 (its connection is closed anyway).
_SENT = frozenset({400, 404, 409, 413})


def refusal_pace_s(status: int, retry_after_s: float | None) -> float:
    """How long a keyed tenant's refusal of `status` is held before it is answered: a 429 its
    Retry-After (at most PACE_MAX_S), a refusal of what it sent PACE_SENT_S, else 0."""
    if status == 429:
        return min(PACE_MAX_S, PACE_SENT_S if retry_after_s is None else retry_after_s)
    return PACE_SENT_S if status in _SENT else 0.0


class RefusalPacer:
    """A tenant's refusals answered late (`refusal_pace_s`): a 429 (its quota, registrations,
    shares) after min(Retry-After, PACE_MAX_S), a refusal of what it sent (an unknown bot, a
    bad image or label, an answer too large) after PACE_SENT_S. A client that honours
    Retry-After loses nothing (it would not have sent before then), an honest mistake costs a
    tenth of a second; a client that floods is paced by its own concurrency instead of taking
    the event loop from the other tenants with refusals (measured on 2 cores: a closed-loop
    flood of refusals answered at once reached 1,400 a second and tripled another tenant's
    p50). A tenant that already has `flood_held` refusals held is flooding, whatever each
    one's Retry-After: its next refusals are held `flood_s` (30 clients sending 10 MB bodies
    refused with a Retry-After of 0.25 s came back 115 times a second). At most `max_held`
    refusals of a tenant are held at once; a request without a tenant is never held. On the
    event loop only.

    Args:
        sleep: `await sleep(seconds)` (tests pass their own).
    """

    def __init__(self, *, max_s: float = PACE_MAX_S, max_held: int = PACE_MAX_HELD,
                 flood_held: int = PACE_FLOOD_HELD, flood_s: float = PACE_FLOOD_S,
                 sleep: Callable[[float], Awaitable[object]] | None = None) -> None:
        self.max_s = max_s
        self.flood_s = flood_s
        self.max_held = max_held
        self.flood_held = flood_held
        self._sleep = sleep or asyncio.sleep
        self.held: dict[str, int] = {}

    async def pace(self, tenant: str, seconds: float) -> None:
        """Waits `seconds` (at most `max_s`) before `tenant`'s refusal is answered (see the
        class doc)."""
        held = self.held.get(tenant, 0)
        if not tenant or seconds <= 0 or held >= self.max_held:
            return
        self.held[tenant] = held + 1
        try:
            await self._sleep(self.flood_s if held >= self.flood_held
                              else min(seconds, self.max_s))
        finally:
            self.held[tenant] -= 1
            if not self.held[tenant]:
                del self.held[tenant]
