"""What the batcher does with deadlines (issue 32, items 3 and 4; `service.core.schedule`):
`batch_pick` on random batches, the batcher picking a fair batch's rows for its earliest
deadline and dropping rows that cannot make theirs (fake clock, fake `run_batch`), admission's
estimate and the slack it learns. Fair order's bound with picks: tests/service/core/
test_sharing.py."""
from __future__ import annotations

import asyncio
import random

import pytest

from service.core.batcher import Batcher
from service.core.errors import DeadlineExceeded
from service.core.schedule import ANSWER_S, Schedule, batch_pick
from tests.service.core.test_batcher import LONG_MS, FakeRunBatch, gather5, settle, spawn
from tests.support.fakes import FakeClock

pytestmark = pytest.mark.timeout(30)


def linear(n: int) -> float:
    """A trunk that batches about linearly (OpenVINO bf16 on 2 Xeon cores): 20 ms + 13 ms an
    image."""
    return 0.007 + 0.013 * n


@pytest.mark.parametrize("seed", range(300))
def test_a_batch_runs_whole_or_its_most_urgent_rows_that_end_in_time(seed):
    """On random batches (deadlines or none, in the scheduler's order): every row when they
    all end before the earliest deadline; else the k most urgent (earliest deadline first,
    then the order's) for the largest k ending before it (one row when none does: the
    batcher drops such a row first); a shorter batch only when the whole one would miss."""
    rng = random.Random(seed)
    now = rng.uniform(0, 100)
    n = rng.randint(1, 16)
    deadlines = [None if rng.random() < 0.5 else now + rng.uniform(0.0, 0.3) for _ in range(n)]
    dated = [d for d in deadlines if d is not None]
    earliest = min(dated) if dated else None

    def ends_in_time(k: int) -> bool:
        return earliest is None or now + linear(k) <= earliest

    picked = batch_pick(deadlines, now, linear)
    assert picked == sorted(set(picked)) and picked and all(0 <= i < n for i in picked)
    k = len(picked)
    if ends_in_time(n):
        assert k == n
        return
    assert ends_in_time(k) or k == 1
    assert not any(ends_in_time(j) for j in range(k + 1, n + 1))  # the most that do

    def key(i: int):
        return (deadlines[i] is None, deadlines[i] or 0.0, i)

    left = set(range(n)) - set(picked)
    assert all(key(i) < key(j) for i in picked for j in left)  # the most urgent


def test_a_batch_without_deadlines_or_one_that_meets_them_is_whole():
    assert batch_pick([None] * 8, 0.0, linear) == list(range(8))
    assert batch_pick([None, 1.0, None], 0.0, linear) == [0, 1, 2]
    assert batch_pick([], 0.0, linear) == []
    # The urgent row last in the order runs first; the others wait for the next batch.
    assert batch_pick([None, 5.0, 0.04], 0.0, linear) == [1, 2]


async def holding(seconds, tenant: str):
    """A batcher of batch 8 (profile `seconds`, a fake clock) whose trunk holds a first batch
    of one row of `tenant`: (clock, the fake trunk, the batcher, the held row's task)."""
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    b = Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=64,
                wait_for_booked_only=True, clock=clock, batch_seconds=seconds)
    held = spawn(b.submit("held", group="g", tenant=tenant))
    await fake.entered()
    return clock, fake, b, held


async def test_the_batcher_picks_a_fair_batchs_rows_for_its_earliest_deadline():
    """b's row with 40 ms left beside a's 7 rows: fair order puts b's first, a batch of 8
    would end at 111 ms, so the batch holds the most urgent rows that end in time (b's and one
    of a's, 33 ms); a's rows run next, whole. Without a profile the batch is whole."""
    for seconds, expected in ((linear, [2, 6]), (None, [8])):
        clock, fake, b, held = await holding(seconds, "a")
        rows = [spawn(b.submit_many(range(7), group="g", tenant="a")),
                spawn(b.submit("quick", group="g", tenant="b", deadline=clock.now + 0.04))]
        await settle()
        fake.release()
        await gather5(held, *rows)
        await asyncio.wait_for(b.close(), 5)
        batches = [[r.tenant for r in call] for call in fake.calls[1:]]
        assert [len(x) for x in batches] == expected, batches
        assert "b" in batches[0]


async def test_a_row_that_cannot_be_answered_in_time_even_alone_is_dropped_before_the_trunk():
    """While the trunk holds a batch, b's row with less time left than a batch of one and the
    answer take (20 ms + ANSWER_S) and c's with more queue behind it: b's is dropped unrun,
    504 deadline_exceeded (counted in rows_expired), c's runs; without a profile a row runs
    until its deadline has passed."""
    from service.core.errors import DeadlineExceeded

    for seconds, dropped in ((linear, True), (None, False)):
        clock, fake, b, held = await holding(seconds, "a")
        late = spawn(b.submit("late", group="g", tenant="b",
                              deadline=clock.now + linear(1) + ANSWER_S - 0.001))
        fine = spawn(b.submit("fine", group="g", tenant="c",
                              deadline=clock.now + linear(1) + ANSWER_S + 0.001))
        await settle()
        fake.release()
        await gather5(held, fine)
        if dropped:
            with pytest.raises(DeadlineExceeded) as refused:
                await late
            assert str(refused.value) == ("the request's deadline would pass before its "
                                          "answer: dropped before the trunk")
        else:
            await late
        await asyncio.wait_for(b.close(), 5)
        ran = [r.payload for call in fake.calls[1:] for r in call]
        assert ("late" in ran) is not dropped and "fine" in ran
        assert b.rows_expired == int(dropped)


def test_the_expected_time_waits_for_the_running_batch_the_rows_ahead_or_decoding():
    """`Schedule.expected_s`: the running batch's rest, then the rows ahead and the new one in
    batches of the working size, plus ANSWER_S; when its rows would take longer to be
    decoded (its tenant's pace per row, learnt, x the rows decoded before them: `backlog`),
    that time and a batch of one."""
    from service.core.schedule import backlog

    plan = Schedule(linear)
    assert plan.expected_s(10.0, 0, 1, 8) == pytest.approx(linear(1) + ANSWER_S)
    assert plan.expected_s(10.0, 9, 1, 8) == pytest.approx(linear(8) + linear(2) + ANSWER_S)
    plan.running(9.99, 8)  # a batch of 8 started 10 ms ago
    assert plan.expected_s(10.0, 0, 1, 8) == pytest.approx(linear(8) - 0.01 + linear(1)
                                                            + ANSWER_S)
    plan.ran([], 10.0)
    for _ in range(200):
        plan.queued_after("t", 0.3, 10)  # 30 ms a row decoded before
    assert plan.pace("t") == pytest.approx(0.03) and plan.pace("u") == 0.0
    trunk = linear(8) + linear(2) + ANSWER_S
    assert plan.expected_s(10.0, 9, 1, 8, path_s=0.06) == pytest.approx(trunk)  # the trunk's
    assert plan.expected_s(10.0, 9, 1, 8, path_s=0.6) == pytest.approx(0.6 + linear(1)
                                                                       + ANSWER_S)
    # Decoded in the tenants' fair order: its own rows, and of each other tenant's as many at
    # most (a flood of another's counts no more); in arrival order, every row being decoded.
    assert backlog(True, {"t": 3, "u": 50, "v": 0, "w": 1}, "t", 2) == 3 + 2 + 5 + 1
    assert backlog(False, {"t": 3, "u": 50, "v": 0, "w": 1}, "t", 2) == 54 + 2


def row(deadline, due=None, tenant="t"):
    from service.core.rows import Row

    return Row(None, "g", deadline, 0.0, tenant, 1.0, due)


def test_the_slack_is_a_high_quantile_of_how_much_longer_tight_rows_waited():
    """`Schedule.slack`: 1 until SLACK_MIN rows were answered; then the SLACK_QUANTILE of the
    ratio (answered - alone) / (due - alone) (the wait over the expected wait, a batch of one
    at least) of the rows whose deadline left them a wait within SLACK_TIGHT x their expected
    one; rows with more time teach nothing; a dropped row counts as answered a batch of one
    after its drop; what was learnt more than SLACK_AGE_S ago is forgotten."""
    from service.core.schedule import SLACK_AGE_S, SLACK_KEPT, SLACK_MIN, SLACK_TIGHT

    plan = Schedule(linear)
    due = (0.05, 0.1)  # 50 ms alone, 50 ms more for the rows ahead
    rows = [row(deadline=0.15, due=due) for _ in range(SLACK_MIN - 1)]
    plan.ran(rows, 0.1 - ANSWER_S)  # answered as expected
    assert plan.slack("t", 1.0) == 1.0  # too few yet
    plan.ran([row(deadline=0.05 + SLACK_TIGHT * 0.05 + 0.01, due=due)] * 50, 1.0)  # loose
    assert plan.slack("t", 1.0) == 1.0
    plan.ran([row(deadline=0.15, due=due)], 0.15 - ANSWER_S)  # waited twice as long
    assert plan.slack("t", 1.0) == pytest.approx(2.0)  # the worst of 16 is above the rank
    plan.ran([row(deadline=0.15, due=due)] * (SLACK_KEPT - 1), 0.1 - ANSWER_S)
    assert plan.slack("t", 1.0) == pytest.approx(2.0)  # the worst of the last SLACK_KEPT
    plan.ran([row(deadline=0.15, due=due)], 0.1 - ANSWER_S)
    assert plan.slack("t", 1.0) == pytest.approx(1.0)  # it is out of them
    late = [row(deadline=0.15, due=due) for _ in range(20)]
    queue = TenantQueueOf(late)
    entries = list(queue.entries)
    assert plan.drop_doomed(queue, 0.14) == len(late) and not queue.entries
    assert all("would pass before its answer" in str(e.future.exc) for e in entries)
    assert plan.slack("t", 1.0) == pytest.approx((0.14 + linear(1) + ANSWER_S - 0.05) / 0.05)
    # An expected wait shorter than a batch of one counts as one; a row answered sooner than
    # alone waited nothing.
    short = Schedule(linear)
    short.ran([row(deadline=0.1, due=(0.05, 0.051))] * SLACK_MIN, 0.05 + linear(1) * 1.5)
    assert short.slack("t", 1.0) == pytest.approx((linear(1) * 1.5 + ANSWER_S) / linear(1))
    short.ran([row(deadline=0.1, due=(0.05, 0.051))] * 300, 0.0)
    assert short.slack("t", 1.0) == 1.0
    # Forgotten with age.
    assert plan.slack("t", 0.14 + SLACK_AGE_S - 0.01) > 2
    assert plan.slack("t", 0.2 + SLACK_AGE_S) == 1.0


def test_rows_the_order_takes_first_count_ahead_whatever_their_deadline():
    """A light tenant's 3 rows with 5 s to go, queued: the fair order takes them before a
    heavy tenant's new row with 150 ms (and a batch runs them with it whenever it still ends
    in time), so they count ahead of it; before, only rows with a deadline no later counted,
    and the estimate fell short by their batch (what the slack then had to learn)."""
    from service.core.fair import TenantQueue
    from service.core.rows import Entry

    queue = TenantQueue("fair")
    queue.counters["heavy"] = 10.0  # served much more
    queue.push([Entry(row(5.0, tenant="light"), None) for _ in range(3)])
    plan = Schedule(linear)
    est = plan.expected_at(queue, {}, "heavy", 1, 8, 0.0)
    assert est.due == pytest.approx(linear(4) + ANSWER_S)
    assert est.alone == pytest.approx(linear(1) + ANSWER_S)
    # The light tenant's own new row waits for its rows only.
    assert plan.expected_at(queue, {}, "light", 1, 8, 0.0).due == pytest.approx(
        linear(4) + ANSWER_S)
    # Under fifo, every row queued is ahead.
    fifo = TenantQueue("fifo")
    fifo.push([Entry(row(5.0, tenant="light"), None) for _ in range(3)])
    assert plan.expected_at(fifo, {}, "heavy", 1, 2, 0.0).due == pytest.approx(
        linear(2) + linear(2) + ANSWER_S)


def test_a_high_slack_refuses_only_requests_with_a_wait_and_never_one_with_nothing_ahead():
    """The slack multiplies the expected wait only (`Estimate.need_s`): a tenant whose rows
    waited 6 x longer than expected, with a deadline of 6 batches of one, is admitted when
    nothing is ahead of it (its time alone meets the deadline; before, its whole estimate
    times the slack was refused, and nothing admitted could teach the slack otherwise), and
    refused while 4 of its rows wait; the rest of a batch running counts as it is."""
    from service.core.fair import TenantQueue
    from service.core.schedule import SLACK_MIN

    plan = Schedule(linear)
    plan.ran([row(deadline=0.2, due=(0.05, 0.1))] * SLACK_MIN, 0.35 - ANSWER_S)
    assert plan.slack("t", 1.0) == pytest.approx(6.0)
    queue = TenantQueue("fair")
    deadline = 1.0 + 6 * (linear(1) + ANSWER_S)
    idle = plan.expected_at(queue, {}, "t", 1, 8, 1.0)
    assert idle.alone == idle.due == pytest.approx(1.0 + linear(1) + ANSWER_S)
    assert idle.slack == pytest.approx(6.0)
    assert idle.need_s(1.0) == pytest.approx(linear(1) + ANSWER_S)  # admitted
    busy = plan.expected_at(queue, {"t": 4}, "t", 1, 8, 1.0)  # 4 rows being decoded
    assert busy.due - busy.alone == pytest.approx(linear(5) - linear(1))
    assert busy.need_s(1.0) == pytest.approx(linear(1) + ANSWER_S + 6 * 4 * 0.013)
    assert 1.0 + busy.need_s(1.0) > deadline  # refused
    # The rest of a batch running is all but certain: part of the time alone, not multiplied.
    plan.running(0.99, 4)  # ends at 0.99 + linear(4)
    running = plan.expected_at(queue, {}, "t", 1, 8, 1.0)
    assert running.alone == running.due == pytest.approx(0.99 + linear(4) + linear(1)
                                                         + ANSWER_S)
    assert running.need_s(1.0) == pytest.approx(running.alone - 1.0)


def test_the_work_around_a_batchs_trunk_is_learnt_and_allowed_in_every_decision():
    """`Schedule.around_s`: ANSWER_S before any batch was learnt, and from batches whose trunk
    did not run (all features cached) nothing is; then the EWMA mean + 3 mean deviations of
    each batch's time less its trunk's, ANSWER_S at least. Admission's estimate, drops,
    picks and waits allow it."""
    from service.core.schedule import AROUND_DEVIATIONS

    plan = Schedule(linear)
    took: list[float | None] = [None]
    plan.trunk_took = lambda: took[0]
    plan.running(0.0, 1)
    plan.ran([], 0.5)  # no trunk: nothing learnt
    assert plan.around_s() == ANSWER_S
    took[0] = linear(1)
    for i in range(60):  # 12 ms around every trunk
        plan.running(float(i), 1)
        plan.ran([], i + linear(1) + 0.012)
    assert plan.around_s() == pytest.approx(0.012)
    assert plan.expected_s(100.0, 0, 1, 8) == pytest.approx(linear(1) + 0.012)
    deadline = 100.0 + linear(1) + 0.010  # time for the trunk and ANSWER_S, not for 12 ms
    assert plan.doomed(deadline, 100.0)
    assert plan.start_in(TenantQueueOf([row(deadline)]), 100.0, 1) < 0
    for i in range(60):  # 4 ms or 20 ms around, in turn: mean 12, deviation 8
        plan.running(float(i), 1)
        plan.ran([], i + linear(1) + (0.004 if i % 2 else 0.020))
    assert plan.around_s() == pytest.approx(0.012 + AROUND_DEVIATIONS * 0.008, rel=0.1)
    for i in range(200):  # 1 ms: never less than ANSWER_S
        plan.running(float(i), 1)
        plan.ran([], i + linear(1) + 0.001)
    assert plan.around_s() == ANSWER_S


def test_rows_answered_after_their_deadline_are_counted_per_tenant():
    plan = Schedule(linear)
    seen = []
    plan.on_late = seen.append
    plan.running(0.0, 3)
    plan.ran([row(0.05, tenant="a"), row(0.2, tenant="a"), row(None, tenant="b"),
              row(0.01, tenant="b")], 0.1)
    assert seen == [{"a": 1, "b": 1}]
    plan.ran([row(0.2)], 0.1)
    assert len(seen) == 1  # none late: no call
    dropped = row(0.01, tenant="a")  # dropped as the trunk started: no trunk image
    plan.ran([dropped, row(0.02, tenant="b")], 0.1, run=[])
    assert len(seen) == 1


def test_without_a_profile_rows_are_dropped_once_their_deadline_passed_and_nothing_is_planned():
    plan = Schedule(None)
    rows = [row(0.10), row(0.12), row(None)]
    queue = TenantQueueOf(rows)
    entries = list(queue.entries)
    assert plan.drop_doomed(queue, 0.11) == 1
    assert [e.row for e in queue.entries] == rows[1:]
    assert isinstance(entries[0].future.exc, DeadlineExceeded)
    assert "passed while it waited" in str(entries[0].future.exc)
    assert [e.future.exc for e in entries[1:]] == [None, None]
    assert plan.picker(0.11) is None
    assert plan.expected_at(queue, {}, "t", 1, 8, 0.11) is None


class _Future:
    """What `rows.fail` uses of an entry's future."""

    def __init__(self) -> None:
        self.exc: BaseException | None = None

    def done(self) -> bool:
        return self.exc is not None

    def set_exception(self, exc: BaseException) -> None:
        self.exc = exc


class TenantQueueOf:
    """A queue of entries over `rows` (what `drop_doomed` reads and changes)."""

    def __init__(self, rows) -> None:
        from types import SimpleNamespace

        self.entries = [SimpleNamespace(row=r, future=_Future(), queued=True) for r in rows]

    def remove_many(self, gone) -> None:
        ids = {id(e) for e in gone}
        self.entries = [e for e in self.entries if id(e) not in ids]


async def test_an_urgent_row_runs_before_rows_with_time_that_the_order_put_first():
    """a's request of 7 rows without a deadline, then a's request with 40 ms left: FIFO within
    a tenant puts the urgent row 8th, and a batch of 8 would end at 111 ms; no prefix of the
    order holding it ends in time, so the batch is the urgent row and the one row that fits
    beside it (33 ms), and the 6 others run next (the prefix rule ran all 8, the urgent row
    late)."""
    clock, fake, b, held = await holding(linear, "b")
    rows = [spawn(b.submit_many([f"a{i}" for i in range(7)], group="g", tenant="a"))]
    await settle()
    rows.append(spawn(b.submit("quick", group="g", tenant="a", deadline=clock.now + 0.04)))
    await settle()
    fake.release()
    await gather5(held, *rows)
    await asyncio.wait_for(b.close(), 5)
    batches = [[r.payload for r in call] for call in fake.calls[1:]]
    assert batches == [["a0", "quick"], ["a1", "a2", "a3", "a4", "a5", "a6"]], batches


def test_late_rows_reach_the_metrics_per_tenant():
    """The engine's hook: `Schedule.on_late` counts into multihead_tenant_rows_late_total."""
    from service.core.metrics import Metrics

    metrics = Metrics()
    plan = Schedule(linear)
    plan.on_late = metrics.observe_rows_late
    plan.running(0.0, 2)
    plan.ran([row(0.05, tenant="a"), row(0.05, tenant="a"), row(0.5, tenant="b")], 0.1)

    def late(tenant: str) -> float | None:
        return metrics.registry.get_sample_value("multihead_tenant_rows_late_total",
                                                 {"tenant": tenant})

    assert late("a") == 2.0 and late("b") is None


@pytest.mark.parametrize("deadline", [None, 0.04])
async def test_a_batch_waits_for_rows_being_decoded_only_within_its_deadlines(deadline):
    """A CPU trunk's batch waits for the rows being decoded (`gather_booked`, up to
    GATHER_IDLE_S without news); with a deadline 40 ms away it starts by the time a batch of
    one still ends in time (40 - 20 - ANSWER_S - START_LEAD_S ms), whatever is still being
    decoded."""
    from service.core.schedule import START_LEAD_S

    clock = FakeClock()
    fake = FakeRunBatch()
    b = Batcher(fake, max_batch_size=8, max_wait_ms=0, max_queue_rows=64,
                wait_for_booked_only=True, gather_booked=True, clock=clock,
                batch_seconds=linear)
    coming = b.book(2)
    first = spawn(b.submit("a", group="g", deadline=None if deadline is None
                           else clock.now + deadline))
    await settle()
    clock.advance(0.04 - linear(1) - ANSWER_S - START_LEAD_S - 0.002)
    b.poke()
    await settle()
    assert not first.done()  # both still wait for the rows being decoded
    clock.advance(0.003)  # past the moment to start for the deadline
    b.poke()
    if deadline is None:
        await settle()
        assert not first.done()
    else:  # NOTE: answered without the rows being decoded (its batch runs in a thread)
        await asyncio.wait_for(asyncio.shield(first), 5)
    coming.release()
    await gather5(first)
    assert fake.payloads() == [["a"]]
    await asyncio.wait_for(b.close(), 5)


def test_an_image_too_late_to_start_is_one_the_batch_after_the_running_one_would_miss():
    """The last check as an image's decode starts: with a batch of 4 running since 0 (59 ms
    by the profile) a row whose deadline is 60 ms away could be answered alone (25 ms) but
    not after that batch's rest and its own (84 ms): too late; 90 ms away, in time. With
    nothing running only a batch of one counts; no deadline or no profile: never."""
    plan = Schedule(linear)
    answered_alone = linear(1) + ANSWER_S
    plan.running(0.0, 4)
    assert plan.too_late_to_start(0.06, 0.0)
    assert not plan.too_late_to_start(0.09, 0.0)
    plan.ran([], linear(4))
    assert not plan.too_late_to_start(answered_alone + 0.001, 0.0)
    assert plan.too_late_to_start(answered_alone - 0.001, 0.0)
    assert not plan.too_late_to_start(None, 0.0)
    assert not Schedule(None).too_late_to_start(0.0, 1.0)


def test_a_refusal_as_a_decode_starts_is_learnt_as_answered_after_the_running_batch():
    """Refused at 0 behind a batch of 4 running since 0, a row admitted to be answered at 30 ms
    with nothing ahead and a deadline at 60 ms is learnt as answered when it could have been
    at the earliest: after that batch (59 ms) and its own (25 ms), 84 ms: its slack ratio is
    that over its expected wait (a batch of one at least)."""
    plan = Schedule(linear)
    plan.running(0.0, 4)
    plan.refused_at_start("t", (0.03, 0.03), 0.06, 0.0)
    (learnt_at, ratio), = plan._learnt["t"].ratios  # noqa: SLF001 - what was learnt
    answered = linear(4) + linear(1) + ANSWER_S
    assert learnt_at == pytest.approx(answered)
    assert ratio == pytest.approx((answered - 0.03) / linear(1))
