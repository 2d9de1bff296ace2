"""Deadline-aware batching inside the fair order (issue 32, item 4): `deadlines.batch_cut` on
random batches, and the batcher cutting a fair batch for its earliest deadline (fake clock,
fake `run_batch`). Fair order's bound with cuts: tests/service/core/test_sharing.py."""
from __future__ import annotations

import asyncio
import random

import pytest

from service.core.batcher import Batcher
from service.core.deadlines import batch_cut
from tests.service.core.test_batcher import LONG_MS, FakeRunBatch, gather5, settle, spawn
from tests.support.fakes import FakeClock

pytestmark = pytest.mark.timeout(30)


def linear(n: int) -> float:
    """A trunk that batches about linearly (OpenVINO bf16 on 2 Xeon cores): 20 ms + 13 ms an
    image."""
    return 0.007 + 0.013 * n


@pytest.mark.parametrize("seed", range(300))
def test_a_batch_is_cut_only_for_a_deadline_the_full_one_misses_and_the_cut_one_meets(seed):
    """On random batches (deadlines or none, in the scheduler's order): the cut is a prefix of
    1..n rows; shorter than n only when the whole batch would end after a deadline among its
    rows, and then the longest prefix that holds the earliest deadline's row and ends before
    every deadline in it; the whole batch when no such prefix exists."""
    rng = random.Random(seed)
    now = rng.uniform(0, 100)
    n = rng.randint(1, 16)
    deadlines = [None if rng.random() < 0.5 else now + rng.uniform(0.0, 0.3) for _ in range(n)]

    def meets(k: int) -> bool:
        return all(d is None or now + linear(k) <= d for d in deadlines[:k])

    k = batch_cut(deadlines, now, linear)
    assert 1 <= k <= n or n == 0
    dated = [i for i, d in enumerate(deadlines) if d is not None]
    if k < n:
        assert not meets(n)
        first = min(dated, key=lambda i: deadlines[i])
        assert k > first and meets(k)  # it holds the earliest deadline's row, which it meets
        assert not any(meets(j) for j in range(k + 1, n))  # the longest such
    elif not meets(n):
        first = min(dated, key=lambda i: deadlines[i])
        assert not any(meets(j) for j in range(first + 1, n))


def test_a_batch_without_deadlines_or_one_that_meets_them_is_whole():
    assert batch_cut([None] * 8, 0.0, linear) == 8
    assert batch_cut([None, 1.0, None], 0.0, linear) == 3
    assert batch_cut([], 0.0, linear) == 0


async def test_the_batcher_cuts_a_fair_batch_for_its_earliest_deadline():
    """b's row with 40 ms left beside a's 7 rows: fair order puts b's first, a batch of 8
    would end at 111 ms, so the batch is the longest prefix ending in time (2 rows, 33 ms);
    a's rows run next, whole. Without a profile (no batch_seconds) the batch is whole."""
    for seconds, expected in ((linear, [2, 6]), (None, [8])):
        clock = FakeClock()
        fake = FakeRunBatch(hold=True)
        b = Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=64,
                    wait_for_booked_only=True, clock=clock, batch_seconds=seconds)
        held = spawn(b.submit("held", group="g", tenant="a"))
        await fake.entered()
        rows = [spawn(b.submit_many(range(7), group="g", tenant="a")),
                spawn(b.submit("quick", group="g", tenant="b", deadline=clock.now + 0.04))]
        await settle()
        fake.release()
        await gather5(held, *rows)
        await asyncio.wait_for(b.close(), 5)
        batches = [[r.tenant for r in call] for call in fake.calls[1:]]
        assert [len(x) for x in batches] == expected, batches
        assert "b" in batches[0]
