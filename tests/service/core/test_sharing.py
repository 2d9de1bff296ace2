"""Shared batches are short (`service.core.sharing`): the size from the profile, the sharing
window, and the batcher's batches on a fake clock (a fake `run_batch` held at a gate)."""
from __future__ import annotations

import asyncio
import random

import pytest

from service.core.batcher import Batcher
from service.core.fair import TenantQueue
from service.core.sharing import SHARING_WINDOW_S, Sharing, shared_batch_size
from tests.service.core.test_batcher import LONG_MS, FakeRunBatch, gather5, settle, spawn
from tests.support.fakes import FakeClock

pytestmark = pytest.mark.timeout(30)

# A trunk that batches about linearly, as OpenVINO bf16 on 2 Xeon cores (ms by size).
LINEAR = {1: 0.0197, 2: 0.0333, 4: 0.0601, 8: 0.1108, 16: 0.2275}
# One that batches well (a GPU's): a batch of 4 takes 1.3 x a batch of one.
GPU = {1: 0.010, 2: 0.011, 4: 0.013, 8: 0.018, 16: 0.030}


def seconds(table):
    def at(n: int) -> float:
        sizes = sorted(table)
        if n in table:
            return table[n]
        below = max(s for s in sizes if s < n)
        above = min(s for s in sizes if s > n)
        return table[below] + (table[above] - table[below]) * (n - below) / (above - below)
    return at


def test_the_shared_size_is_the_largest_batch_within_the_slice():
    assert shared_batch_size(seconds(LINEAR), 8, None) == 1  # 1.5 x 19.7 ms: a batch of 2 is 33
    assert shared_batch_size(seconds(GPU), 16, None) == 5  # 1.5 x 10 ms = 15: 5 at 14.25 ms
    assert shared_batch_size(seconds(LINEAR), 8, 61.0) == 4
    assert shared_batch_size(seconds(LINEAR), 2, 1000.0) == 2  # at most the batch size
    assert shared_batch_size(seconds(LINEAR), 8, 5.0) == 1  # at least one
    assert shared_batch_size(seconds(LINEAR), 8, 0) is None  # off
    assert shared_batch_size(None, 8, None) is None  # no profile: full batches


def test_the_cap_holds_while_a_light_tenant_shares_the_trunk():
    """A cap while more than one tenant queued rows within the window and one of them has at
    most `shared` rows queued (none: between two requests); heavy tenants alone, or one
    tenant alone, have none; a tenant older than the window is forgotten."""
    sharing = Sharing(window_s=1.0)
    sharing.queued("a", 0.0)
    assert sharing.cap(0.5, {"a": 8}, 2) is None  # one tenant
    sharing.queued("b", 0.6)
    assert sharing.cap(0.9, {"a": 8}, 2) == 2  # b is between two requests
    assert sharing.cap(0.9, {"a": 8, "b": 2}, 2) == 2  # b is light
    assert sharing.cap(0.9, {"a": 8, "b": 3}, 2) is None  # both heavy: full batches
    assert sharing.active(1.2) == ["b"]  # a's last row is older than the window
    assert sharing.cap(1.2, {"b": 0}, 2) is None
    assert sharing.active(1.7) == []


async def _batches(make_batcher, clock, rows_of):
    """Queues `rows_of` [(tenant, n)] in order while a first batch is held, then runs them:
    the tenants of each batch after the held one."""
    fake = FakeRunBatch(hold=True)
    b = make_batcher(fake, clock)
    held = spawn(b.submit("held", group="g", tenant=rows_of[0][0]))
    await fake.entered()
    tasks = [spawn(b.submit_many([f"{t}{i}" for i in range(n)], group="g", tenant=t))
             for t, n in rows_of]
    await settle()
    fake.release()
    await gather5(held, *tasks)
    await asyncio.wait_for(b.close(), 5)
    return [[r.tenant for r in call] for call in fake.calls[1:]]


@pytest.fixture
def make_batcher():
    def make(fake, clock, **kwargs):
        # As the engine's: nothing booked, a batch runs with what waits (no max_wait_ms).
        kwargs.setdefault("scheduler", "fair")
        return Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=64,
                       shared_batch_size=2, clock=clock, wait_for_booked_only=True, **kwargs)
    return make


async def test_one_tenant_alone_keeps_full_batches(make_batcher):
    batches = await _batches(make_batcher, FakeClock(), [("a", 8)])
    assert [len(x) for x in batches] == [8]


async def test_heavy_tenants_alone_keep_full_batches(make_batcher):
    batches = await _batches(make_batcher, FakeClock(), [("a", 5), ("b", 5)])
    assert [len(x) for x in batches] == [8, 2]


async def test_beside_a_light_tenant_each_tenant_puts_its_share_in_a_batch(make_batcher):
    """A flood of a's 8 rows and one row each of the light b and c: batches of at most 2 of
    each tenant's rows, the light ones' in the first; every row run once."""
    batches = await _batches(make_batcher, FakeClock(), [("a", 8), ("b", 1), ("c", 1)])
    assert all(x.count(t) <= 2 for x in batches for t in "abc")
    assert sorted(batches[0]) == ["a", "a", "b", "c"]
    assert [len(x) for x in batches] == [4, 2, 2, 2]
    assert sorted(t for x in batches for t in x) == ["a"] * 8 + ["b", "c"]


async def test_fifo_keeps_the_arrival_order_in_full_batches(make_batcher):
    """Shares are the fair scheduler's: fifo, kept for comparison, takes what waits in
    arrival order up to the batch size."""
    batches = await _batches(lambda fake, clock: make_batcher(fake, clock, scheduler="fifo"),
                             FakeClock(), [("a", 8), ("b", 1), ("c", 1)])
    assert batches == [["a"] * 8, ["b", "c"]]


async def test_a_tenant_between_requests_keeps_the_cap_for_the_window(make_batcher):
    """b's closed loop between two requests (nothing queued) still caps a's batches, until
    its last row is older than the window."""
    clock = FakeClock()
    fake = FakeRunBatch()
    b = make_batcher(fake, clock)
    await gather5(b.submit("b0", group="g", tenant="b"))
    clock.advance(SHARING_WINDOW_S / 2)
    await gather5(*(b.submit_many(range(6), group="g", tenant="a") for _ in range(1)))
    assert [len(c) for c in fake.calls[1:]] == [2, 2, 2]
    clock.advance(SHARING_WINDOW_S * 0.6)  # b's row is now older than the window
    assert b.per_tenant() is None
    await gather5(b.submit_many(range(8), group="g", tenant="a"))
    assert [len(c) for c in fake.calls[-1:]] == [8]
    await asyncio.wait_for(b.close(), 5)


def test_invalid_shared_sizes_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="shared_batch_size"):
            Batcher(lambda rows: rows, max_batch_size=4, max_wait_ms=1, max_queue_rows=8,
                    shared_batch_size=bad)


@pytest.mark.parametrize("seed", range(30))
def test_shares_of_a_batch_keep_the_fair_orders_bound(seed):
    """A per-tenant share only leaves a tenant's later rows for the next batches: on random
    traces of three tenants (weights 1, 2, 3) with random arrivals, batch sizes and shares,
    any two tenants backlogged over a stretch receive weighted images within 2 x the batch
    size of each other over it (`test_fair`'s bound), and no row is lost or run twice."""
    rng = random.Random(seed)
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    queue = TenantQueue("fair", weight=weights.__getitem__)

    class E:
        def __init__(self, tenant, t):
            self.tenant, self.group, self.cost, self.enqueued_s = tenant, "g", 1.0, t

    t, pushed, taken = 0, 0, 0
    served = dict.fromkeys(weights, 0.0)
    since: dict[tuple[str, str], dict[str, float]] = {}  # a pair's stretch: served at its start
    pairs = [("a", "b"), ("a", "c"), ("b", "c")]
    for _ in range(300):
        for tenant in weights:
            n = rng.choice((0, 0, 1, 3))
            queue.push([E(tenant, (t := t + 1)) for _ in range(n)])
            pushed += n
        for x, y in pairs:  # both backlogged as the batch is taken: the stretch goes on
            if queue.rows.get(x) and queue.rows.get(y):
                since.setdefault((x, y), dict(served))
            else:
                since.pop((x, y), None)
        batch = queue.take(8, lambda e: True, per_tenant=rng.choice((None, 1, 2)))
        taken += len(batch)
        for e in batch:
            served[e.tenant] += e.cost / weights[e.tenant]
        for (x, y), start in since.items():
            gap = (served[x] - start[x]) - (served[y] - start[y])
            assert abs(gap) <= 2 * 8, (x, y, gap)
    assert taken + len(queue) == pushed
