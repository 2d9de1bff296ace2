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
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

# The tenants that queued rows this recently share the trunk.
SHARING_WINDOW_S = 1.0
# --shared-batch-ms unset: a tenant's share of a shared batch runs within this many times a
# batch of one.
SHARED_SLICE_FACTOR = 1.5


def shared_batch_size(batch_seconds: Callable[[int], float] | None, batch_size: int,
                      slice_ms: float | None) -> int | None:
    """The most images of one tenant a batch takes while the trunk is shared with a light
    tenant: the largest size up to `batch_size` that the profile (`batch_seconds(n)`, seconds
    alone) runs within `slice_ms` (unset: SHARED_SLICE_FACTOR x its batch of one), at least 1.
    None (no such bound) with `slice_ms` 0 or without a profile."""
    if batch_seconds is None or slice_ms == 0:
        return None
    slice_s = SHARED_SLICE_FACTOR * batch_seconds(1) if slice_ms is None else slice_ms / 1000.0
    fits = [n for n in range(1, batch_size + 1) if batch_seconds(n) <= slice_s]
    return max(fits, default=1)


class Sharing:
    """When each tenant last queued rows, and the bound on a tenant's rows in the next batch
    (`cap`). Bounded: a tenant older than the window is forgotten at the next `cap`. Event
    loop only (the batcher's).

    Args:
        shared: a tenant's share of a batch while the trunk is shared with a light tenant
            (an int >= 1; None, or at least `batch_size`: no such bound).
        batch_size: the batcher's batch size.
    """

    def __init__(self, shared: int | None, batch_size: int,
                 window_s: float = SHARING_WINDOW_S) -> None:
        shared = batch_size if shared is None else shared
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 1:
            raise ValueError(f"shared_batch_size must be an int >= 1, got {shared!r}")
        self.shared = min(shared, batch_size)
        self.max_batch_size = batch_size
        self._bounded = self.shared < batch_size
        self.window_s = window_s
        self._last: dict[str, float] = {}

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

    def batch(self, now: float, queued: Mapping[str, int],
              booked: Mapping[str, int]) -> tuple[int, int]:
        """(the most rows the next batch takes, how many of them are queued now), from the
        rows queued and being prepared (`booked`), by tenant: while `cap` holds, a share for
        each tenant with rows waiting, at most the batch size, of which each tenant's queued
        rows up to its share (a batch short of that waits for the rows being prepared, the
        batcher's gathering); else the batch size and the rows queued."""
        waiting = {t: queued.get(t, 0) + booked.get(t, 0) for t in {*queued, *booked}}
        share = self.cap(now, waiting)
        if share is None:
            return self.max_batch_size, sum(queued.values())
        tenants = sum(1 for n in waiting.values() if n > 0)
        size = min(self.max_batch_size, share * max(1, tenants))
        return size, min(size, sum(min(n, share) for n in queued.values()))
