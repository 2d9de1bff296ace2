"""Fair sharing of the trunk: the queue's order and shares on random arrival traces (as VTC's
authors test their scheduler: a simulated clock, one batch per tick), then the same rules
through a real `Batcher` on a fake clock."""
from __future__ import annotations

import asyncio
import collections
import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.core.batcher import Batcher
from service.core.errors import Overloaded, QueueShareExceeded
from service.core.fair import TenantQueue, safe_weight
from tests.support.fakes import FakeClock

pytestmark = pytest.mark.timeout(120)


@dataclass(eq=False)
class Entry:
    tenant: str
    enqueued_s: float
    group: str = "bot"
    cost: float = 1.0
    dead: bool = False  # cancelled or past its deadline: leaves unserved
    served_at: int | None = None


@dataclass
class Trace:
    """A run of the queue: per batch (tick), who had live rows queued at its start and what it
    took."""

    batch_size: int
    weights: dict[str, float]
    backlogged: list[set[str]] = field(default_factory=list)  # live rows queued at the start
    still_backlogged: list[set[str]] = field(default_factory=list)  # ... and after the take
    served: list[collections.Counter] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # live rows queued at each batch's start
    taken: list[int] = field(default_factory=list)


def simulate(arrivals, weights, batch_size, *, scheduler="fair", ticks=None,
             pick=None) -> Trace:
    """`arrivals[t]` = [(tenant, rows, dead_mask)] arriving before batch t; one batch per tick,
    until every row left or `ticks` (default: 20 after the last arrival); `pick` is the
    queue's (the rows of a batch, `TenantQueue.take`)."""
    ticks = len(arrivals) + 20 if ticks is None else ticks
    queue = TenantQueue(scheduler, weight=weights.__getitem__)
    trace = Trace(batch_size, weights)
    t = 0
    while t < len(arrivals) or queue:
        for tenant, rows, dead in (arrivals[t] if t < len(arrivals) else ()):
            queue.push([Entry(tenant, float(t), dead=dead >> i & 1 == 1) for i in range(rows)])
        live_rows = [e for e in queue.entries if not e.dead]
        trace.backlogged.append({e.tenant for e in live_rows})
        trace.waiting.append(len(live_rows))
        batch = queue.take(batch_size, lambda e: not e.dead, pick=pick)
        assert all(not e.dead for e in batch)
        for e in batch:
            e.served_at = t
        trace.still_backlogged.append({e.tenant for e in queue.entries if not e.dead})
        trace.served.append(collections.Counter(e.tenant for e in batch))
        trace.taken.append(len(batch))
        t += 1
        if t >= ticks:
            break
    return trace


def worst_gap(trace: Trace) -> float:
    """The largest difference in weighted trunk images served to two tenants over any stretch
    of batches during which both were backlogged: with live rows queued before and after each
    batch of the stretch (a tenant whose last row a batch took was served all it asked for).

    Over a run of such batches, with D(t) the running sum of (served_i / w_i - served_j / w_j)
    from the run's start (D = 0 before it), the worst stretch is max(D) - min(D)."""
    worst = 0.0
    tenants = sorted(trace.weights)
    for i in tenants:
        for j in tenants:
            if i >= j:
                continue
            d = low = high = 0.0
            for t, backlogged in enumerate(trace.still_backlogged):
                if not {i, j} <= backlogged:
                    d = low = high = 0.0
                    continue
                d += (trace.served[t][i] / trace.weights[i]
                      - trace.served[t][j] / trace.weights[j])
                low, high = min(low, d), max(high, d)
                worst = max(worst, high - low)
    return worst


def longest_wait(trace: Trace) -> int:
    """The most consecutive batches a tenant with live rows queued got none of its rows into."""
    longest = 0
    for tenant in trace.weights:
        run = 0
        for t in range(len(trace.served)):
            if tenant in trace.backlogged[t] and not trace.served[t][tenant]:
                run += 1
                longest = max(longest, run)
            else:
                run = 0
    return longest


def test_a_tenant_served_all_it_asked_for_is_not_backlogged():
    """b sends one row before each batch while a floods: b gets its row every batch (it is
    never left waiting), a the rest; no stretch counts b as backlogged."""
    arrivals = [[("a", 40, 0)]] + [[("b", 1, 0)]] * 8
    trace = simulate(arrivals, {"a": 1.0, "b": 1.0}, 4)
    assert [served["b"] for served in trace.served[1:9]] == [1] * 8
    assert worst_gap(trace) == 0.0
    assert worst_gap(simulate([[("a", 40, 0), ("b", 40, 0)]], {"a": 1.0, "b": 1.0}, 4,
                              scheduler="fifo")) == 36.0  # fifo: b waits out a


@st.composite
def traces(draw):
    batch_size = draw(st.integers(1, 8))
    n_tenants = draw(st.integers(1, 8))
    names = [f"t{i}" for i in range(n_tenants)]
    # Weights within a ratio of the batch size (the condition of the wait bound).
    weights = {t: draw(st.floats(1.0, float(batch_size))) for t in names}
    ticks = draw(st.integers(1, 40))
    arrivals = [
        [(t, draw(st.integers(1, 3 * batch_size)), 0) for t in names if draw(st.booleans())]
        for _ in range(ticks)]
    return batch_size, weights, arrivals


@st.composite
def traces_with_dead_rows(draw):
    batch_size, weights, arrivals = draw(traces())
    arrivals = [[(t, rows, draw(st.integers(0, 2**rows - 1)) if draw(st.booleans()) else 0)
                 for t, rows, _ in tick] for tick in arrivals]
    return batch_size, weights, arrivals


# `make fuzz` runs them with many more examples.
SETTINGS = settings(max_examples=int(os.environ.get("MULTIHEAD_FAIR_EXAMPLES", "100")),
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(traces())
def test_backlogged_tenants_get_weighted_images_within_two_batches(case):
    batch_size, weights, arrivals = case
    trace = simulate(arrivals, weights, batch_size)
    assert worst_gap(trace) <= 2 * batch_size


@SETTINGS
@given(traces())
def test_no_tenant_with_queued_rows_waits_more_batches_than_there_are_tenants(case):
    batch_size, weights, arrivals = case
    trace = simulate(arrivals, weights, batch_size)
    assert longest_wait(trace) <= len(weights)


@SETTINGS
@given(traces_with_dead_rows(), st.sampled_from(["fair", "fifo"]))
def test_a_batch_takes_whatever_waits_up_to_its_size(case, scheduler):
    batch_size, weights, arrivals = case
    trace = simulate(arrivals, weights, batch_size, scheduler=scheduler)
    for waiting, taken in zip(trace.waiting, trace.taken):
        assert taken == min(batch_size, waiting)


@SETTINGS
@given(traces())
def test_fifo_within_a_tenant(case):
    batch_size, weights, arrivals = case
    queue = TenantQueue("fair", weight=weights.__getitem__)
    order = collections.defaultdict(list)
    for t in range(len(arrivals) + 20):
        for tenant, rows, _ in (arrivals[t] if t < len(arrivals) else ()):
            queue.push([Entry(tenant, float(t)) for _ in range(rows)])
        for e in queue.take(batch_size, lambda e: True):
            order[e.tenant].append(e.enqueued_s)
    assert all(times == sorted(times) for times in order.values())


def test_fifo_scheduler_is_arrival_order_and_fair_is_not():
    """The flood case: 32 rows of one tenant, then 1 row of each of three quiet ones."""
    def first_batch(scheduler):
        queue = TenantQueue(scheduler)
        queue.push([Entry("noisy", 0.0) for _ in range(32)])
        queue.push([Entry(q, 1.0) for q in ("q1", "q2", "q3")])
        return [e.tenant for e in queue.take(8, lambda e: True)]

    assert first_batch("fifo") == ["noisy"] * 8
    assert sorted(first_batch("fair")) == sorted(["noisy"] * 5 + ["q1", "q2", "q3"])


def test_a_tenant_back_from_idle_cannot_spend_banked_credit():
    """VTC's lift: b was idle while a was served 40 images; back, it starts at a's counter,
    so the next batches alternate instead of giving b the next 40."""
    queue = TenantQueue("fair")
    queue.push([Entry("a", 0.0) for _ in range(40)])
    for _ in range(10):
        queue.take(4, lambda e: True)
    queue.push([Entry("a", 1.0) for _ in range(40)])
    queue.push([Entry("b", 1.0) for _ in range(40)])
    taken = collections.Counter(e.tenant for e in queue.take(8, lambda e: True))
    assert taken == {"a": 4, "b": 4}


def test_weights_divide_the_trunk():
    queue = TenantQueue("fair", weight={"gold": 3.0, "basic": 1.0}.__getitem__)
    queue.push([Entry("gold", 0.0) for _ in range(100)])
    queue.push([Entry("basic", 0.0) for _ in range(100)])
    served = collections.Counter()
    for _ in range(10):
        served.update(e.tenant for e in queue.take(8, lambda e: True))
    assert served == {"gold": 60, "basic": 20}


def test_rows_that_cost_nothing_do_not_move_the_counter():
    queue = TenantQueue("fair")
    queue.push([Entry("cached", 0.0, cost=0.0) for _ in range(4)])
    queue.take(4, lambda e: True)
    assert queue.counter("cached") == 0.0


def test_weight_lookups_that_fail_count_as_one():
    def broken(tenant):
        raise RuntimeError("store down")

    assert safe_weight(broken, "a") == 1.0
    assert [safe_weight(lambda t, w=w: w, "a") for w in (float("nan"), -1, 0, 2.5)] == [
        1.0, 1.0, 1.0, 2.5]


def test_counters_of_idle_tenants_are_forgotten():
    """Thousands of tenants passing through leave no unbounded state behind."""
    queue = TenantQueue("fair")
    for i in range(2000):
        queue.push([Entry(f"t{i}", float(i))])
        queue.take(1, lambda e: True)
    assert len(queue.counters) <= 64 + 4 and not queue.rows


def test_shares_are_weighted_and_never_below_one_batch():
    queue = TenantQueue("fair", weight={"a": 1.0, "b": 3.0, "c": 1.0}.__getitem__)
    queue.push([Entry("a", 0.0)])
    assert queue.share("b", 100, 16) == 75
    assert queue.share("a", 100, 16) == 100  # alone: b has nothing queued
    queue.push([Entry("b", 0.0)])
    assert queue.share("a", 100, 16) == 25
    assert queue.share("c", 100, 30) == 30  # 100 * 1/5 = 20 < one batch


# -- through a real Batcher, on a fake clock ----------------------------------------------------

class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def __call__(self, rows):
        self.batches.append([r.tenant for r in rows])
        return [r.payload for r in rows]


async def _flood_then_quiet(scheduler: str) -> list[str]:
    """A noisy tenant queues 12 rows while a batch is held; then three quiet tenants one row
    each. Returns the tenants of the batch after the held one."""
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    recorder = Recorder()
    started = asyncio.Event()

    def run_batch(rows):
        loop.call_soon_threadsafe(started.set)
        if not recorder.batches:
            asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
        return recorder(rows)

    clock = FakeClock()
    b = Batcher(run_batch, max_batch_size=4, max_wait_ms=0, max_queue_rows=64,
                scheduler=scheduler, clock=clock)
    first = asyncio.ensure_future(b.submit("x", group="g", tenant="noisy"))
    await asyncio.wait_for(started.wait(), 10)
    flood = asyncio.ensure_future(b.submit_many(range(12), group="g", tenant="noisy"))
    await asyncio.sleep(0)
    quiet = [asyncio.ensure_future(b.submit(q, group="g", tenant=q)) for q in ("q1", "q2", "q3")]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, flood, *quiet), 10)
    await b.close()
    return recorder.batches[1]


async def test_the_batcher_serves_quiet_tenants_in_the_next_batch_under_fair_only():
    assert sorted(await _flood_then_quiet("fair")) == ["noisy", "q1", "q2", "q3"]
    assert await _flood_then_quiet("fifo") == ["noisy"] * 4


async def test_a_flooder_over_its_share_gets_429_and_its_booked_rows_make_room_for_another():
    b = Batcher(lambda rows: [r.payload for r in rows], max_batch_size=2, max_wait_ms=60_000,
                max_queue_rows=8)
    await b.start()
    alone = b.book(8, "noisy")
    with pytest.raises(Overloaded) as refused:  # alone, its share is the queue: the server is full
        b.book(1, "noisy")
    assert type(refused.value) is Overloaded
    alone.release()
    older = b.book(2, "noisy")
    noisy = b.book(4, "noisy")
    quiet = b.book(1, "quiet")  # now two tenants with images waiting: shares of 4 each
    with pytest.raises(QueueShareExceeded, match="noisy"):
        b.book(1, "noisy")
    quiet_more = b.book(1, "quiet")  # within its share: the last slot
    cancelled = []
    noisy.on_push = lambda: cancelled.append("noisy")
    # The whole queue is booked (being decoded): quiet, within its share, pushes out the
    # newest booking of noisy (over its share): its room comes back at once, its decodes not
    # started are cancelled, and it fails with 429 when it would queue; noisy's older booking
    # stays.
    last = b.book(1, "quiet")
    assert cancelled == ["noisy"] and noisy.pushed is not None and older.pushed is None
    with pytest.raises(QueueShareExceeded, match="noisy"):
        await b.submit_many(range(4), group="g", booking=noisy, tenant="noisy")
    noisy.release()  # pushed: nothing to give back twice
    assert b._room.booked == 2 + 3
    for booking in (older, quiet, quiet_more, last):
        booking.release()
    assert b._room.booked == 0
    await b.close()


async def test_a_tenant_within_its_share_pushes_the_flooders_newest_request_out():
    clock = FakeClock()
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()

    def run_batch(rows):
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
        return [r.payload for r in rows]

    b = Batcher(run_batch, max_batch_size=2, max_wait_ms=0, max_queue_rows=8, clock=clock)
    running = asyncio.ensure_future(b.submit_many(range(2), group="g", tenant="noisy"))
    await asyncio.sleep(0.05)  # the first batch is now inside run_batch, held
    old = asyncio.ensure_future(b.submit_many(range(4), group="g", tenant="noisy"))
    new = asyncio.ensure_future(b.submit_many(range(4), group="g", tenant="noisy"))
    await asyncio.sleep(0)
    assert b.queue_depth == 8  # full, all the flooder's (alone, its share is the queue)
    quiet = asyncio.ensure_future(b.submit_many(range(2), group="g", tenant="quiet"))
    await asyncio.sleep(0)
    with pytest.raises(QueueShareExceeded, match="noisy"):
        await asyncio.wait_for(new, 5)  # its newest request made room
    assert b.queue_depth == 6 and not old.done()
    gate.set()
    assert await asyncio.wait_for(quiet, 10) == [0, 1]
    assert await asyncio.wait_for(old, 10) == [0, 1, 2, 3]
    await running
    await b.close()


async def test_max_queued_caps_a_tenant_under_either_scheduler():
    for scheduler in ("fair", "fifo"):
        b = Batcher(lambda rows: [r.payload for r in rows], max_batch_size=4,
                    max_wait_ms=60_000, max_queue_rows=64, scheduler=scheduler,
                    max_queued={"capped": 3}.get)
        await b.start()
        first = b.book(2, "capped")
        with pytest.raises(QueueShareExceeded, match="max_queued is 3"):
            b.book(2, "capped")
        b.book(2, "other").release()
        first.release()
        await b.close()


async def test_tenant_state_reports_queued_rows_and_counters():
    clock = FakeClock()
    b = Batcher(lambda rows: [r.payload for r in rows], max_batch_size=2, max_wait_ms=0,
                max_queue_rows=64, clock=clock, weight={"a": 2.0}.get)
    served = []
    b._on_served = served.append
    await b.submit_many(range(2), group="g", tenant="a")
    assert b.tenant_state() == {"a": (0, 1.0)}  # 2 images / weight 2
    assert served == [{"a": 2}]
    await b.close()


@st.composite
def queue_states(draw):
    """A queue after random arrivals and batches (counters apart), and a tenant's new rows."""
    batch_size, weights, arrivals = draw(traces())
    queue = TenantQueue(draw(st.sampled_from(["fair", "fifo"])), weight=weights.__getitem__)
    for t, tick in enumerate(arrivals):
        for tenant, rows, _ in tick:
            queue.push([Entry(tenant, float(t)) for _ in range(rows)])
        if draw(st.booleans()):
            queue.take(batch_size, lambda e: True)
    booked = {t: draw(st.integers(0, 3)) for t in [*weights, "late"] if draw(st.booleans())}
    return queue, draw(st.sampled_from([*weights, "new"])), draw(st.integers(1, 4)), booked


@SETTINGS
@given(queue_states())
def test_ahead_counts_the_rows_the_order_takes_before_a_new_requests_last_row(case):
    """`ahead` (admission's estimate, `schedule.Schedule.expected_at`) against the order itself:
    the new rows queued, everything taken; the last new row's place is `ahead`, give or take
    one row per other tenant (ties of equal counters). Rows booked (being decoded) count as
    if queued: they are queued first, then the new ones."""
    queue, tenant, rows, booked = case
    others = len((set(queue.rows) | {t for t, n in booked.items() if n}) - {tenant})
    estimate = queue.ahead(tenant, rows, collections.Counter(queue.rows) + collections.Counter(
        booked))
    for t, n in booked.items():
        queue.push([Entry(t, 1e8) for _ in range(n)])
    new = [Entry(tenant, 1e9) for _ in range(rows)]
    queue.push(new)
    order = queue.take(len(queue), lambda e: True)
    actual = order.index(new[-1])
    assert abs(estimate - actual) <= (others if queue.fair else 0), (estimate, actual)
