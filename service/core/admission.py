"""Admission before work: a server-wide budget of request bytes in flight.

A transport asks the budget before it reads a body: a request whose declared length does not
fit is refused (Overloaded: 503 + Retry-After) while its bytes are still on the wire; a
chunked body is counted as it streams. What was admitted is released when the request's answer
is done, so memory is bounded by the budget, not by what clients send. No web framework here.
"""
from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable

from service.core.errors import BadRequest, Overloaded, PayloadTooLarge
from service.core.memory import TRIM_AFTER_BYTES

# What a refused client is told to wait: a body admitted is usually served within a second.
RETRY_AFTER_S = 1.0


class ByteBudget:
    """Bytes reserved by requests in flight, at most `limit_bytes`. Thread-safe.

    Args:
      on_burst_end: called (outside the lock) when a release leaves the bytes in flight at
        least `burst_bytes` below their peak since the last call and at most half of it: a
        burst of large bodies is over (`service.core.memory.Trimmer` gives their memory back).
    """

    def __init__(self, limit_bytes: int, *, on_burst_end: Callable[[], object] | None = None,
                 burst_bytes: int = TRIM_AFTER_BYTES) -> None:
        if limit_bytes < 1:
            raise ValueError("limit_bytes must be >= 1")
        self.limit_bytes = int(limit_bytes)
        self._used = 0
        self._peak = 0  # since the last burst end
        self._on_burst_end = on_burst_end
        self._burst_bytes = burst_bytes
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def reserve(self, n: int) -> None:
        """Takes `n` bytes, or raises Overloaded (nothing taken)."""
        with self._lock:
            if self._used + n > self.limit_bytes:
                raise Overloaded(RETRY_AFTER_S, f"server busy: {self._used} of "
                                 f"{self.limit_bytes} request bytes in flight; retry after "
                                 f"{RETRY_AFTER_S:.0f} s")
            self._used += n
            self._peak = max(self._peak, self._used)

    def release(self, n: int) -> None:
        with self._lock:
            self._used -= n
            assert self._used >= 0, "released more than reserved"
            ended = (self._on_burst_end is not None
                     and self._peak - self._used >= self._burst_bytes
                     and 2 * self._used <= self._peak)
            if ended:
                self._peak = self._used
        if ended:
            self._on_burst_end()


class Reservation:
    """The bytes one request holds; `take` adds to them, `close` gives them all back."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.bytes = 0

    def take(self, n: int) -> None:
        self._budget.reserve(n)
        self.bytes += n

    def close(self) -> None:
        if self.bytes:
            self._budget.release(self.bytes)
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
    arrives and the body is cut at `limit` (413).
    """
    if length is not None:
        body = bytearray(length)
        view, filled = memoryview(body), 0
        async for chunk in chunks:
            if filled + len(chunk) > length:
                view.release()
                raise BadRequest(f"body longer than its Content-Length of {length}")
            view[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
        view.release()
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
