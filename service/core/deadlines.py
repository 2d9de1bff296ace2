"""Per-request deadlines (issue 32, item 2): how long a client gives its request, on every
protocol, and the one place the request's deadline is kept while it runs.

A request's deadline is the earliest of:
- the serve-wide `--request-timeout-s` (always);
- the header `X-Multihead-Deadline-Ms` (HTTP and gRPC metadata alike): milliseconds from when
  the request arrived, a number in (0, MAX_MS]; without it, its tenant's default (`multihead
  tenants set --deadline-ms`, else `--tenant-deadline-ms`; `request_ms`);
- the gRPC call's own deadline (`grpc-timeout`), given as that header by the gRPC transport
  when the client set no header of its own;
- OIP's `parameters.deadline_ms` in the inference request's body (REST and gRPC).

The pipeline reads the header once the caller is known (a malformed value is 400
`invalid_deadline`, INVALID_ARGUMENT on gRPC) and keeps the deadline for the request's task
(`scope`, a context variable: the tasks it starts see it too); a codec that reads a deadline
from the body tightens it (`tighten`); `Inference.deadline` reads it (`earliest`).

What a deadline does once the request's rows reach the batcher (admission, drops, the order
of a batch's rows): `service.core.schedule`.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import time
from collections.abc import Iterator, Mapping

from service.core.errors import InvalidDeadline

HEADER = "x-multihead-deadline-ms"
# The longest deadline a request may ask for: one hour, in ms.
MAX_MS = 3_600_000.0

# The deadline of the request running in this context (`time.monotonic` seconds), or None.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline",
                                                                        default=None)


def parse_ms(value: object, where: str) -> float:
    """A deadline in ms as a client gave it (a header's text, a JSON number), checked: a
    finite number in (0, MAX_MS], else InvalidDeadline naming `where`."""
    if isinstance(value, bool):
        value = None  # JSON true is not a number of ms
    try:
        ms = float(value.strip()) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        ms = math.nan
    if not (math.isfinite(ms) and 0 < ms <= MAX_MS):
        shown = repr(value)[:40]
        raise InvalidDeadline(f"{where} must be a number of milliseconds in (0, {MAX_MS:.0f}]; "
                              f"got {shown}")
    return ms


def header_ms(headers: Mapping[str, str]) -> float | None:
    """The ms a request's headers (or gRPC metadata) give it, checked (`parse_ms`); None
    without the header."""
    value = headers.get(HEADER)
    return None if value is None else parse_ms(value, "X-Multihead-Deadline-Ms")


def request_ms(headers: Mapping[str, str], default_ms: float | None = None) -> float | None:
    """The ms a request is given: its header's (`header_ms`), else `default_ms` (its
    tenant's default deadline; None: none)."""
    ms = header_ms(headers)
    return default_ms if ms is None else ms


def from_headers(headers: Mapping[str, str], start: float | None = None,
                 default_ms: float | None = None) -> float | None:
    """The deadline a request's headers (or gRPC metadata) ask for, else `default_ms` after
    its arrival, as `time.monotonic` seconds counted from `start` (default: now); None
    without either."""
    ms = request_ms(headers, default_ms)
    if ms is None:
        return None
    return (time.monotonic() if start is None else start) + ms / 1000.0


@contextlib.contextmanager
def scope(deadline: float | None) -> Iterator[None]:
    """`deadline` (None: none) is the request's for the block."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def tighten(ms: float) -> None:
    """The request's deadline becomes `ms` from now, if that is earlier (OIP's
    `parameters.deadline_ms`, read from the body after the headers)."""
    deadline = time.monotonic() + ms / 1000.0
    current = _DEADLINE.get()
    if current is None or deadline < current:
        _DEADLINE.set(deadline)


def earliest(default: float) -> float:
    """The request's deadline, or `default` when it has none or a later one."""
    current = _DEADLINE.get()
    return default if current is None else min(default, current)


__all__ = ["HEADER", "MAX_MS", "earliest", "from_headers", "header_ms", "parse_ms", "request_ms",
           "scope", "tighten"]
