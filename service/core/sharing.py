"""Short shares of a batch while the trunk is shared with a light tenant.

A trunk batch cannot be stopped once it runs, so its length is all the isolation there is
between tenants' latencies: a quiet tenant's request that arrives while another tenant's batch
of 8 runs waits for it, then shares the next batch with the other's rows. Measured on 2 cores
(Xeon, OpenVINO bf16, a batch of one 20 ms, of four 60 ms): a tenant flooding at its quota of 4
images a second took a quiet tenant's p99 from 24 to 81 ms.

So under the fair scheduler (fifo, kept for comparison, is the arrival order in full batches),
while the trunk is shared with a light tenant (`Sharing.cap`: more than one tenant queued rows
within the last SHARING_WINDOW_S, and one of them has at most a share waiting, queued or being
decoded, none maybe: a closed-loop client between two requests), a batch takes a share
(`shared_batch_size`: the largest batch the trunk's profile runs within a short slice,
`--shared-batch-ms`; unset, SHARED_SLICE_FACTOR x a batch of one) for each tenant with rows
waiting (a batch short of its queued shares waits for the rows being decoded: the batcher's
gathering), in fair order. A heavy tenant alone then runs short batches, and the quiet tenant
that arrives waits for one and runs in the next beside about a share of each other tenant's
rows; many tenants waiting still fill a batch. The batch is a prefix of the fair order, so the
order's bounds hold (weights included: tests/service/core/test_sharing.py). The price is the
throughput a heavy tenant's longer batches would have bought while light ones are about;
heavy tenants alone (every recent tenant with more than a share waiting) keep full batches,
and so does one tenant alone.

A light tenant's rows waiting (queued or being decoded) make the batch that carries them longer
(`light_batch_size`: what the profile runs within LIGHT_SLICE_FACTOR x the share's slice):
that batch holds the light rows (first in the fair order) and the heavy tenants' rows up to it.
Only a batch started while the light tenant has nothing waiting must be short, as its next
request waits for it; the one it is in costs its latency once either way. So a heavy tenant's
throughput beside a closed-loop light client is that of a short and a longer batch in turn,
not of short ones only (measured on 2 Xeon cores, OpenVINO bf16: `multihead bench --sections
deadlines`, docs/performance.md#deadlines). And after a batch that answered a tenant which now
has nothing waiting, the next batch waits up to RETURN_WAIT x a batch of one for its next
request (`return_in`, the batcher's gathering): a closed-loop light client back within it
rides in the next batch, a longer one, instead of waiting for a short batch of the others.

At saturation with no light tenant (no share bound) a batch may be longer than the working size
(`upper`: --max-batch-size): when more rows wait (queued, or being decoded: the batcher's
gathering waits for those, as on a CPU trunk only a few are decoded between two batches) than
the working size takes, it takes them up to `upper`, while no deadline waiting is close
(`batch`'s `room_for`: the earliest would still be met after that batch and one of the working
size). The working size (the smallest within 5 % of the profile's best images/s) keeps batches
short below saturation, where a longer one would cost every waiting request its length; at
saturation the queue waits either way, and longer batches drain it faster. Measured on 2 Xeon
cores (OpenVINO bf16, one tenant's 48 clients): working batches of 4 ran 0.903 x the images/s
of full batches of 16, of 8 0.945 and 0.961 (`multihead bench --sections deadlines`); with the
longer batches a working size of 4 ran 1.05 x (batches of 15.7), and in a probe a working size
of 8 ran batches of 16 (docs/performance.md#deadlines). The price: a tenant that sent nothing
within SHARING_WINDOW_S is not known as light yet, and its first request waits for such a
batch, as it did before the profile.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

# The tenants that queued rows this recently share the trunk.
SHARING_WINDOW_S = 1.0
# --shared-batch-ms unset: a tenant's share of a shared batch runs within this many times a
# batch of one.
SHARED_SLICE_FACTOR = 1.5
# A batch carrying a light tenant's rows runs within this many times the share's slice.
LIGHT_SLICE_FACTOR = 2.0
# The batch after one that answered a light tenant waits for its next request up to this many
# times a batch of one (the batcher's `batch_seconds(1)`; none without a profile).
RETURN_WAIT = 0.25


def shared_batch_size(batch_seconds: Callable[[int], float] | None, batch_size: int,
                      slice_ms: float | None) -> int | None:
    """The most images of one tenant a batch takes while the trunk is shared with a light
    tenant: the largest size up to `batch_size` that the profile (`batch_seconds(n)`, seconds
    alone) runs within `slice_ms` (unset: SHARED_SLICE_FACTOR x its batch of one), at least 1.
    None (no such bound) with `slice_ms` 0 or without a profile."""
    return _within(batch_seconds, batch_size, slice_ms, 1.0)


def light_batch_size(batch_seconds: Callable[[int], float] | None, batch_size: int,
                     slice_ms: float | None) -> int | None:
    """The most images of a batch that carries a light tenant's rows: the largest size up to
    `batch_size` that the profile runs within LIGHT_SLICE_FACTOR x the share's slice (see
    `shared_batch_size`); None where shares are off."""
    return _within(batch_seconds, batch_size, slice_ms, LIGHT_SLICE_FACTOR)


def _within(batch_seconds: Callable[[int], float] | None, batch_size: int,
            slice_ms: float | None, factor: float) -> int | None:
    """The largest size up to `batch_size` that runs within `factor` x the share's slice, at
    least 1; None with `slice_ms` 0 or without a profile."""
    if batch_seconds is None or slice_ms == 0:
        return None
    slice_s = SHARED_SLICE_FACTOR * batch_seconds(1) if slice_ms is None else slice_ms / 1000.0
    fits = [n for n in range(1, batch_size + 1) if batch_seconds(n) <= factor * slice_s]
    return max(fits, default=1)


class Sharing:
    """When each tenant last queued rows, and the bound on a tenant's rows in the next batch
    (`cap`). Bounded: a tenant older than the window is forgotten at the next `cap`. Event
    loop only (the batcher's).

    Args:
        shared: a tenant's share of a batch while the trunk is shared with a light tenant
            (an int >= 1; None, or at least `batch_size`: no such bound).
        batch_size: the batcher's batch size.
        light: the most rows of a batch that carries a light tenant's rows (an int >= 1, at
            least a share; None: a share for each tenant waiting, as any shared batch).
        upper: the most rows of a batch at saturation (see the module doc; None, or at most
            `batch_size`: `batch_size`).
    """

    def __init__(self, shared: int | None, batch_size: int,
                 window_s: float = SHARING_WINDOW_S, light: int | None = None,
                 upper: int | None = None) -> None:
        shared = batch_size if shared is None else shared
        for name, value in (("shared_batch_size", shared), ("light_batch_size", light)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.shared = min(shared, batch_size)
        self.light = max(self.shared, min(light or 1, batch_size))  # at least a share
        self.max_batch_size = batch_size
        self.upper = max(batch_size, upper or batch_size)
        self._bounded = self.shared < batch_size
        self.window_s = window_s
        self._last: dict[str, float] = {}
        self._ran: tuple[frozenset[str], float] = (frozenset(), -math.inf)  # the last batch

    def queued(self, tenant: str, now: float) -> None:
        self._last[tenant] = now

    def active(self, now: float) -> list[str]:
        """The tenants that queued rows within the window before `now`."""
        since = now - self.window_s
        for tenant in [t for t, when in self._last.items() if when < since]:
            del self._last[tenant]
        return list(self._last)

    def cap(self, now: float, waiting: Mapping[str, int]) -> int | None:
        """`shared` while more than one tenant queued rows within the window and one of them
        has at most `shared` rows waiting now (`waiting`: rows queued or being prepared, by
        tenant), else None."""
        if not self._bounded:
            return None
        active = self.active(now)
        if len(active) > 1 and any(waiting.get(t, 0) <= self.shared for t in active):
            return self.shared
        return None

    def ran(self, tenants: Iterable[str], end: float) -> None:
        """A batch of rows of `tenants` ended at `end` (the batcher's)."""
        self._ran = (frozenset(tenants), end)

    def return_in(self, now: float, queued: Mapping[str, int], booked: Mapping[str, int],
                  batch_seconds: Callable[[int], float] | None, start_in: float) -> float:
        """Seconds left to wait for a tenant the last batch answered, which may be on its way
        back: while `cap` holds, one of its tenants has nothing waiting (queued or being
        prepared), a closed-loop client between its answer and its next request; up to
        RETURN_WAIT x a batch of one (`batch_seconds(1)`) after that batch ended, and only
        while the earliest deadline waiting (`start_in`: seconds until a batch must start
        for it) would still leave a batch of one to spare. <= 0: no such wait (nor without
        a profile)."""
        if batch_seconds is None:
            return -math.inf
        tenants, end = self._ran
        one = batch_seconds(1)
        left = end + RETURN_WAIT * one - now
        if not 0 < left <= start_in - one:
            return -math.inf
        waiting = _waiting(queued, booked)
        if self.cap(now, waiting) is None:
            return -math.inf
        returning = any(waiting.get(t, 0) == 0 for t in tenants if t in self._last)
        return left if returning else -math.inf

    def batch(self, now: float, queued: Mapping[str, int], booked: Mapping[str, int],
              room_for: Callable[[int], bool] | None = None) -> tuple[int, int]:
        """(the most rows the next batch takes, how many of them are queued now), from the
        rows queued and being prepared (`booked`), by tenant: while `cap` holds, a share for
        each tenant with rows waiting, at most the batch size, of which each tenant's queued
        rows up to its share (a batch short of that waits for the rows being prepared, the
        batcher's gathering); when a light tenant (at most a share waiting) has rows
        waiting, at least `light` rows (at most the rows waiting): all the light tenants'
        and the others' up to it (again: queued, or the batch waits for them); else the
        batch size and the rows queued, or with more rows waiting than that (queued or being
        prepared), up to `upper` of them while `room_for(n)` (deadlines: a batch of n leaves
        room)."""
        waiting = _waiting(queued, booked)
        share = self.cap(now, waiting)
        if share is None:
            ready = sum(queued.values())
            longer = min(self.upper, sum(waiting.values()))
            if longer > self.max_batch_size and room_for is not None and room_for(longer):
                return longer, ready
            return self.max_batch_size, ready
        tenants = sum(1 for n in waiting.values() if n > 0)
        size = min(self.max_batch_size, share * max(1, tenants))
        light = [t for t, n in waiting.items() if 0 < n <= share]
        longer = min(self.light, sum(waiting.values()))  # no longer than the rows waiting
        if light and longer > size:
            size = longer
            light_waiting = sum(waiting[t] for t in light)
            light_queued = sum(queued.get(t, 0) for t in light)
            heavy_queued = sum(n for t, n in queued.items() if t not in light)
            return size, min(size, light_queued + min(heavy_queued, max(0, size - light_waiting)))
        return size, min(size, sum(min(n, share) for n in queued.values()))


def _waiting(queued: Mapping[str, int], booked: Mapping[str, int]) -> dict[str, int]:
    """Rows queued or being prepared, by tenant."""
    return {t: queued.get(t, 0) + booked.get(t, 0) for t in {*queued, *booked}}
