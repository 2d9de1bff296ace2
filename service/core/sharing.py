"""Shared batches are short: the batch size while tenants share the trunk.

A trunk batch cannot be stopped once it runs, so its length is all the isolation there is
between tenants' latencies: a quiet tenant's request that arrives while another tenant's batch
of 8 runs waits for it, then runs in the next batch, which fair order (`service.core.fair`)
fills with the other's rows too. Measured on 2 cores (Xeon, OpenVINO bf16, batch of one 20 ms,
of four 60 ms): a tenant flooding at its quota of 4 images a second took a quiet tenant's p99
from 24 to 81 ms.

So while more than one tenant queued rows within the last SHARING_WINDOW_S (`Sharing`), a
batch takes at most `shared_batch_size` rows: the largest size the trunk's profile runs within
a short slice (`--shared-batch-ms`; unset, SHARED_SLICE_FACTOR x a batch of one). The quiet
tenant then waits for one short batch and runs in one. The price is the throughput larger
batches would have bought while tenants share; one tenant alone (and `--auth none`, where every
request is one tenant's) keeps full batches. The batch is still a prefix of the scheduler's
order: fair order's bounds are unchanged (tests/service/core/test_batcher_sharing.py).
"""
from __future__ import annotations

from collections.abc import Callable

# The tenants that queued rows this recently share the trunk.
SHARING_WINDOW_S = 1.0
# --shared-batch-ms unset: a shared batch runs within this many times a batch of one.
SHARED_SLICE_FACTOR = 1.5


def shared_batch_size(batch_seconds: Callable[[int], float] | None, batch_size: int,
                      slice_ms: float | None) -> int | None:
    """The most images a batch takes while tenants share the trunk: the largest size up to
    `batch_size` that the profile (`batch_seconds(n)`, seconds alone) runs within `slice_ms`
    (unset: SHARED_SLICE_FACTOR x its batch of one), at least 1. None (full batches always)
    with `slice_ms` 0 or without a profile."""
    if batch_seconds is None or slice_ms == 0:
        return None
    slice_s = SHARED_SLICE_FACTOR * batch_seconds(1) if slice_ms is None else slice_ms / 1000.0
    fits = [n for n in range(1, batch_size + 1) if batch_seconds(n) <= slice_s]
    return max(fits, default=1)


class Sharing:
    """When each tenant last queued rows, and whether more than one did within the window.
    Bounded: a tenant older than the window is forgotten at the next `active`. Event loop
    only (the batcher's)."""

    def __init__(self, window_s: float = SHARING_WINDOW_S) -> None:
        self.window_s = window_s
        self._last: dict[str, float] = {}

    def queued(self, tenant: str, now: float) -> None:
        self._last[tenant] = now

    def active(self, now: float) -> int:
        """The tenants that queued rows within the window before `now`."""
        since = now - self.window_s
        for tenant in [t for t, when in self._last.items() if when < since]:
            del self._last[tenant]
        return len(self._last)
