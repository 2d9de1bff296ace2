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


def test_sharing_counts_the_tenants_of_the_window_and_forgets_older_ones():
    sharing = Sharing(window_s=1.0)
    sharing.queued("a", 0.0)
    assert sharing.active(0.5) == 1
    sharing.queued("b", 0.6)
    assert sharing.active(0.9) == 2
    assert sharing.active(1.2) == 1  # a's last row is older than the window
    assert sharing.active(1.7) == 0


async def _batches(make_batcher, clock, rows_of):
    """Queues `rows_of` [(tenant, n)] in order while a first batch is held, then runs them:
    the sizes and tenants of the batches after the held one."""
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
    return [[r.tenant for r in call] for call in fake.calls[1:]], b


@pytest.fixture
def make_batcher():
    def make(fake, clock, **kwargs):
        # As the engine's: nothing booked, a batch runs with what waits (no max_wait_ms).
        return Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=64,
                       shared_batch_size=2, clock=clock, wait_for_booked_only=True, **kwargs)
    return make


async def test_one_tenant_alone_keeps_full_batches(make_batcher):
    batches, b = await _batches(make_batcher, FakeClock(), [("a", 8)])
    assert [len(x) for x in batches] == [8]


async def test_two_tenants_within_the_window_get_short_batches_in_fair_order(make_batcher):
    """A flood of a's 8 rows and one of b's: batches of 2, b's row in the first (fair order
    lifts b to a's counter; b was served least recently), every row run once."""
    batches, b = await _batches(make_batcher, FakeClock(), [("a", 8), ("b", 1)])
    assert [len(x) for x in batches] == [2, 2, 2, 2, 1]
    assert "b" in batches[0]
    assert sorted(t for x in batches for t in x) == ["a"] * 8 + ["b"]


async def test_full_batches_come_back_once_the_other_tenant_is_quiet_for_the_window(
        make_batcher):
    clock = FakeClock()
    fake = FakeRunBatch()
    b = make_batcher(fake, clock)
    await gather5(b.submit("b0", group="g", tenant="b"))
    clock.advance(SHARING_WINDOW_S / 2)
    assert b.batch_size() == 8  # b alone so far
    await gather5(b.submit("a0", group="g", tenant="a"))
    assert b.batch_size() == 2  # a and b within the window
    clock.advance(SHARING_WINDOW_S * 0.6)  # b's row is now older than the window
    assert b.batch_size() == 8
    await gather5(*(b.submit(i, group="g", tenant="a") for i in range(8)))
    assert [len(c) for c in fake.calls[-1:]] == [8]
    await asyncio.wait_for(b.close(), 5)


def test_invalid_shared_sizes_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="shared_batch_size"):
            Batcher(lambda rows: rows, max_batch_size=4, max_wait_ms=1, max_queue_rows=8,
                    shared_batch_size=bad)


@pytest.mark.parametrize("seed", range(20))
def test_short_batches_cut_the_fair_order_and_keep_its_bound(seed):
    """Cutting batches short only moves where one batch ends and the next begins: on random
    traces of two backlogged tenants of weights 1 and 3, the weighted images each was served
    stay within 2 x the batch size of each other after every batch, whatever the mix of
    shared and full batch sizes (`test_fair`'s bound)."""
    rng = random.Random(seed)
    weights = {"a": 1.0, "b": 3.0}
    queue = TenantQueue("fair", weight=weights.__getitem__)

    class E:
        def __init__(self, tenant, t):
            self.tenant, self.group, self.cost, self.enqueued_s = tenant, "g", 1.0, t

    t = 0
    for _ in range(40):
        for tenant in "ab":
            queue.push([E(tenant, (t := t + 1)) for _ in range(rng.randint(0, 6))])
        served = {"a": 0.0, "b": 0.0}
        while queue.rows.get("a") and queue.rows.get("b"):
            size = rng.choice((1, 2, 8))
            for e in queue.take(size, lambda e: True):
                served[e.tenant] += e.cost / weights[e.tenant]
            assert abs(served["a"] - served["b"]) <= 2 * 8
        queue.pop_all()
