"""Shared batches are short (`service.core.sharing`): the size from the profile, the sharing
window, and the batcher's batches on a fake clock (a fake `run_batch` held at a gate)."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.core.batcher import Batcher
from service.core.sharing import (
    RETURN_WAIT,
    SHARING_WINDOW_S,
    Sharing,
    light_batch_size,
    shared_batch_size,
)
from tests.service.core.test_batcher import LONG_MS, FakeRunBatch, gather5, settle, spawn
from tests.service.core.test_fair import SETTINGS, simulate, traces, worst_gap
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


def test_a_batch_carrying_a_light_tenants_rows_runs_within_twice_the_slice():
    assert light_batch_size(seconds(LINEAR), 8, None) == 3  # 2 x 29.6 ms: 3 at 46.7, 4 at 60.1
    assert light_batch_size(seconds(GPU), 16, None) == 16  # 30 ms: all of them
    assert light_batch_size(seconds(LINEAR), 8, 31.0) == 4  # 62 ms
    assert light_batch_size(seconds(LINEAR), 8, 5.0) == 1  # at least one
    assert light_batch_size(seconds(LINEAR), 8, 0) is None  # shares off
    assert light_batch_size(None, 8, None) is None


def test_a_light_tenants_rows_waiting_make_their_batch_longer_and_it_waits_for_them():
    """(most rows, rows queued of them): with b light and recent, a batch while b has rows
    waiting holds `light` rows (b's, then a's up to it); while b's row is being decoded, the
    batch is not full without it (the batcher gathers it); while b has none, a alone gets
    its share: the batch b's next request will wait for is short."""
    sharing = Sharing(1, 8, window_s=1.0, light=4)
    sharing.queued("a", 0.0)
    sharing.queued("b", 0.1)
    assert sharing.batch(0.2, {"a": 8, "b": 1}, {}) == (4, 4)
    assert sharing.batch(0.2, {"a": 8}, {"b": 1}) == (4, 3)  # b's row not queued yet
    # No longer than the rows waiting: full with them, it runs now.
    assert sharing.batch(0.2, {"a": 2, "b": 1}, {}) == (3, 3)
    assert sharing.batch(0.2, {"a": 1, "b": 1}, {}) == (2, 2)  # both light
    assert sharing.batch(0.2, {"a": 1}, {"a": 2, "b": 1}) == (4, 1)  # a's rows being decoded
    assert sharing.batch(0.2, {"a": 8}, {}) == (1, 1)  # b between two requests
    assert sharing.batch(0.2, {"a": 8, "b": 2}, {}) == (8, 10)  # b heavy now: no cap
    # Never shorter than a share for each tenant waiting (many light tenants).
    many = Sharing(1, 8, window_s=1.0, light=2)
    for t in "abc":
        many.queued(t, 0.0)
    assert many.batch(0.1, {"a": 5, "b": 1, "c": 1}, {}) == (3, 3)
    with pytest.raises(ValueError, match="light_batch_size"):
        Sharing(1, 8, light=0)


def test_the_cap_holds_while_a_light_tenant_shares_the_trunk():
    """A cap while more than one tenant queued rows within the window and one of them has at
    most `shared` rows queued (none: between two requests); heavy tenants alone, or one
    tenant alone, have none; a tenant older than the window is forgotten."""
    sharing = Sharing(2, 8, window_s=1.0)
    sharing.queued("a", 0.0)
    assert sharing.cap(0.5, {"a": 8}) is None  # one tenant
    sharing.queued("b", 0.6)
    assert sharing.cap(0.9, {"a": 8}) == 2  # b is between two requests
    assert sharing.cap(0.9, {"a": 8, "b": 2}) == 2  # b is light
    assert sharing.cap(0.9, {"a": 8, "b": 3}) is None  # both heavy: full batches
    # (most rows, rows queued of them): a share per tenant waiting, queued or being decoded
    assert sharing.batch(0.9, {"a": 8}, {"b": 1}) == (4, 2)
    assert sharing.batch(0.9, {"a": 8, "b": 1}, {}) == (4, 3)
    assert sharing.batch(0.9, {"a": 5}, {"b": 5}) == (8, 5)  # both heavy
    assert sharing.active(1.2) == ["b"]  # a's last row is older than the window
    assert sharing.cap(1.2, {"b": 0}) is None
    assert sharing.active(1.7) == []


def test_at_saturation_a_batch_takes_up_to_the_upper_size_while_deadlines_leave_room():
    """No share bound (one tenant, or heavy ones only) and more rows queued than the working
    size: up to `upper` of them while `room_for` says the deadlines leave room; never with a
    light tenant about, nor without `room_for` (no profile), nor with no more rows than the
    working size."""
    sharing = Sharing(2, 4, window_s=1.0, upper=16)
    sharing.queued("a", 0.0)
    yes, no = (lambda n: True), (lambda n: False)
    assert sharing.batch(0.1, {"a": 10}, {}, yes) == (10, 10)
    assert sharing.batch(0.1, {"a": 20}, {}, yes) == (16, 20)
    assert sharing.batch(0.1, {"a": 10}, {}, no) == (4, 10)
    assert sharing.batch(0.1, {"a": 10}, {}) == (4, 10)
    assert sharing.batch(0.1, {"a": 3}, {}, yes) == (4, 3)
    assert sharing.batch(0.1, {"a": 3}, {"a": 9}, yes) == (12, 3)  # gathers those decoding
    asked: list[int] = []
    assert sharing.batch(0.1, {"a": 12}, {}, lambda n: asked.append(n) or True) == (12, 12)
    assert asked == [12]  # the deadlines are asked about the longer batch itself
    sharing.queued("b", 0.2)  # a light tenant: shares, not longer batches
    assert sharing.batch(0.3, {"a": 10, "b": 1}, {}, yes) == (4, 3)
    assert Sharing(None, 4).upper == 4 and Sharing(None, 8, upper=4).upper == 8


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
        kwargs.setdefault("shared_batch_size", 2)
        return Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=64,
                       clock=clock, wait_for_booked_only=True, **kwargs)
    return make


async def test_one_tenant_alone_keeps_full_batches(make_batcher):
    batches = await _batches(make_batcher, FakeClock(), [("a", 8)])
    assert [len(x) for x in batches] == [8]


async def test_heavy_tenants_alone_keep_full_batches(make_batcher):
    batches = await _batches(make_batcher, FakeClock(), [("a", 5), ("b", 5)])
    assert [len(x) for x in batches] == [8, 2]


async def test_beside_a_light_tenant_a_batch_takes_a_share_for_each_tenant_waiting(
        make_batcher):
    """A flood of a's 8 rows and one row each of the light b and c: the first batch takes 2
    rows for each of the 3 tenants waiting, in fair order (b's and c's first), then a alone
    runs batches of 2 while b and c are recent; every row runs once."""
    batches = await _batches(make_batcher, FakeClock(), [("a", 8), ("b", 1), ("c", 1)])
    assert batches[0][:2] == ["b", "c"] and batches[0][2:] == ["a"] * 4
    assert [len(x) for x in batches] == [6, 2, 2]
    assert sorted(t for x in batches for t in x) == ["a"] * 8 + ["b", "c"]


async def test_beside_a_light_tenant_its_batch_is_longer_and_the_others_short(make_batcher):
    """As above with a batch carrying a light row of at most 4 and a share of 1: the first
    batch holds b's row and 3 of a's (fair order: b first); a then runs batches of its share
    while b, recent, has nothing waiting; every row runs once."""
    batches = await _batches(lambda fake, clock: make_batcher(
        fake, clock, shared_batch_size=1, light_batch_size=4), FakeClock(), [("a", 8), ("b", 1)])
    assert batches[0] == ["b", "a", "a", "a"]
    assert [len(x) for x in batches] == [4, 1, 1, 1, 1, 1]


async def test_fifo_keeps_the_arrival_order_in_full_batches(make_batcher):
    """Shares are the fair scheduler's: fifo, kept for comparison, takes what waits in
    arrival order up to the batch size."""
    batches = await _batches(lambda fake, clock: make_batcher(fake, clock, scheduler="fifo"),
                             FakeClock(), [("a", 8), ("b", 1), ("c", 1)])
    assert batches == [["a"] * 8, ["b", "c"]]


@pytest.mark.parametrize("deadline_s, sizes", [
    (10.0, [12]),  # far: one longer batch of all 12
    (0.2, [8, 4]),  # a batch of 12 then one of 8 would miss it: the working size
    (None, [12]),  # no deadline at all
])
async def test_at_saturation_the_batch_grows_past_the_working_size_unless_a_deadline_is_close(
        make_batcher, deadline_s, sizes):
    """A fair batcher with the working size 8 and --max-batch-size 16 on a profile (the
    linear trunk's): 12 rows of one tenant queued behind a running batch."""
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    b = make_batcher(fake, clock, upper_batch_size=16, batch_seconds=seconds(LINEAR))
    held = spawn(b.submit("held", group="g", tenant="a"))
    await fake.entered()
    deadline = None if deadline_s is None else clock() + deadline_s
    rows = spawn(b.submit_many(range(12), group="g", tenant="a", deadline=deadline))
    await settle()
    fake.release()
    await gather5(held, rows)
    assert [len(c) for c in fake.calls[1:]] == sizes
    await asyncio.wait_for(b.close(), 5)


async def test_without_a_profile_or_under_fifo_batches_keep_the_working_size(make_batcher):
    for kwargs in ({"upper_batch_size": 16},
                   {"upper_batch_size": 16, "batch_seconds": seconds(LINEAR),
                    "scheduler": "fifo"}):
        batches = await _batches(lambda fake, clock, kw=kwargs: make_batcher(fake, clock, **kw),
                                 FakeClock(), [("a", 12)])
        assert [len(x) for x in batches] == [8, 4], kwargs


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
    assert b.next_batch()[0] == 8
    await gather5(b.submit_many(range(8), group="g", tenant="a"))
    assert [len(c) for c in fake.calls[-1:]] == [8]
    await asyncio.wait_for(b.close(), 5)


def test_invalid_shared_sizes_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="shared_batch_size"):
            Batcher(lambda rows: rows, max_batch_size=4, max_wait_ms=1, max_queue_rows=8,
                    shared_batch_size=bad)


@SETTINGS
@given(traces(), st.randoms(use_true_random=False))
def test_batches_shortened_or_picked_keep_the_fair_orders_bound(case, rng):
    """A batch shortened to its tenants' shares is a prefix of the fair order, and one picked
    for a deadline any rows of the batch the order gives (`TenantQueue.take`'s `pick`,
    `schedule.batch_pick`): on `test_fair`'s random traces, with every batch a random
    non-empty subset of the order's batch, two tenants backlogged over a stretch still receive
    weighted images within 2 x the batch size of each other (`test_fair`'s bound)."""
    batch_size, weights, arrivals = case

    def pick(order: list) -> list[int]:
        return sorted(rng.sample(range(len(order)), rng.randint(1, len(order)))) if order else []

    trace = simulate(arrivals, weights, batch_size, pick=pick)
    assert worst_gap(trace) <= 2 * batch_size


async def test_a_shared_batch_full_at_its_shares_does_not_wait_for_rows_being_decoded():
    """On a CPU trunk the batcher gathers the rows being decoded into a batch that is not
    full (`gather_booked`); a batch full at its tenants' shares is full: it runs at once,
    however many of the heavy tenant's rows are still being decoded."""
    clock = FakeClock()
    fake = FakeRunBatch()
    b = Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=64,
                shared_batch_size=1, clock=clock, wait_for_booked_only=True,
                gather_booked=True)
    await gather5(b.submit("b0", group="g", tenant="b"))  # b: light, recent
    decoding = b.book(4, "a")  # another request of a: its 4 rows being decoded
    assert await asyncio.wait_for(b.submit("a0", group="g", tenant="a"), 5) == ("ok", "a0")
    assert [[r.payload for r in call] for call in fake.calls] == [["b0"], ["a0"]]
    decoding.release()
    await asyncio.wait_for(b.close(), 5)


async def test_a_light_tenants_row_being_decoded_is_gathered_into_the_shared_batch():
    """b's row is being decoded (booked) while a's rows wait: the batch, a share for each of
    the two tenants, is not full with a's rows alone, so it waits for b's (the gathering of a
    CPU trunk) and takes it; before, a batch full of a's rows left without it and b's
    row waited for the next (fair order: b, served b0 already, after a)."""
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    b = Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=64,
                shared_batch_size=1, clock=clock, wait_for_booked_only=True,
                gather_booked=True)
    held = spawn(b.submit("b0", group="g", tenant="b"))  # b: light, recent
    await fake.entered()
    a_rows = spawn(b.submit_many(["a0", "a1", "a2"], group="g", tenant="a"))
    decoding = b.book(1, "b")  # b's next row, being decoded
    await settle()
    fake.release()
    await gather5(held)
    await settle()
    assert len(fake.calls) == 1  # waiting for b's row (the fake clock does not move)
    b_row = spawn(b.submit_many(["b1"], group="g", booking=decoding))
    await gather5(a_rows, b_row)
    assert [[r.payload for r in call] for call in fake.calls][:2] == [["b0"], ["a0", "b1"]]
    await asyncio.wait_for(b.close(), 5)


async def test_after_a_light_tenants_batch_the_next_waits_briefly_for_its_next_request():
    """b (light) was answered by the last batch and has nothing waiting: the next batch waits
    up to RETURN_WAIT x a batch of one (on the fake clock, until it moves) for b's next
    request, which then rides in a longer batch beside a's rows, not after a short batch of
    a's; once the wait is over without b, a runs its share."""
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    b = Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=64,
                shared_batch_size=1, light_batch_size=4, batch_seconds=lambda n: 0.02 * n,
                clock=clock, wait_for_booked_only=True, gather_booked=True)
    held = spawn(b.submit("a-held", group="g", tenant="a"))
    await fake.entered()
    a_rows = [spawn(b.submit(f"a{i}", group="g", tenant="a")) for i in range(8)]
    b0 = spawn(b.submit("b0", group="g", tenant="b"))
    await settle()
    fake.release()
    await gather5(held, b0)
    assert fake.payloads()[1] == ["b0", "a0", "a1", "a2"]  # b light: the longer batch
    await asyncio.sleep(0.05)
    assert len(fake.calls) == 2  # waiting for b: the fake clock has not moved
    await gather5(b.submit("b1", group="g", tenant="b"))
    assert fake.payloads()[2] == ["b1", "a3", "a4", "a5"]
    clock.advance(RETURN_WAIT * 0.02 * 1.01)  # b did not come back within the wait
    b.poke()
    await gather5(*a_rows)
    assert [len(c) for c in fake.calls[3:]] == [1, 1]  # a alone beside b: its share
    await asyncio.wait_for(b.close(), 5)


async def test_no_wait_for_a_light_tenants_return_when_a_deadline_waiting_is_close():
    """As above, but a's rows have a deadline that a batch started after the wait would meet
    with less than a batch of one to spare: the next batch, a's share, runs at once (the fake
    clock unmoved) instead of waiting for b."""
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    # max_wait_ms 0: no other wait (fewer rows than the last batch's wait max_wait_ms too).
    b = Batcher(fake, max_batch_size=8, max_wait_ms=0, max_queue_rows=64,
                shared_batch_size=1, light_batch_size=4, batch_seconds=lambda n: 0.02 * n,
                clock=clock, wait_for_booked_only=True, gather_booked=True)
    held = spawn(b.submit("a-held", group="g", tenant="a"))
    await fake.entered()
    # a3's deadline is 44 ms away: a batch of one ends 25 ms after it starts (20 + ANSWER_S),
    # so one started after a 5 ms wait would leave less than a batch of one (20 ms) to spare.
    rows = [spawn(b.submit(f"a{i}", group="g", tenant="a",
                           deadline=clock.now + (0.044 if i == 3 else 1.0))) for i in range(4)]
    b0 = spawn(b.submit("b0", group="g", tenant="b"))
    await settle()
    fake.release()
    await gather5(held, b0, *rows)  # no wait: the fake clock never moved
    assert fake.payloads()[1:] == [["b0", "a0", "a1", "a2"], ["a3"]]
    await asyncio.wait_for(b.close(), 5)
