"""The batcher's logic with a fake `run_batch` (the subject is timing, grouping and failure
isolation, not the trunk). Concurrency is gated with events; tests assert which tasks are done,
never how long things took beyond generous bounds."""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time

import pytest

from service.core.batcher import GATHER_IDLE_S, Batcher
from service.core.errors import BadRequest, BatchError, DeadlineExceeded, Overloaded, ShuttingDown
from service.core.rows import Row
from tests.support.fakes import FakeClock

pytestmark = pytest.mark.timeout(30)

LONG_MS = 60_000.0  # a max_wait_ms no test may wait for: only size/close can flush


class FakeRunBatch:
    """`run_batch` stand-in: records each batch and its thread, can be held at a gate, and maps
    rows to `("ok", payload)` unless given another `fn(rows, call_index)`."""

    def __init__(self, fn=None, *, hold: bool = False) -> None:
        self.fn = fn or (lambda rows, i: [("ok", r.payload) for r in rows])
        self.calls: list[list[Row]] = []
        self.threads: list[threading.Thread] = []
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self._loop = asyncio.get_running_loop()
        self._entered: asyncio.Queue[int] = asyncio.Queue()

    def __call__(self, rows: list[Row]):
        index = len(self.calls)
        self.calls.append(list(rows))
        self.threads.append(threading.current_thread())
        self._loop.call_soon_threadsafe(self._entered.put_nowait, index)
        assert self.gate.wait(10), "test never released the gate"
        return self.fn(rows, index)

    async def entered(self) -> int:
        """Wait until a batch has entered run_batch; returns its index."""
        return await asyncio.wait_for(self._entered.get(), 5)

    def release(self) -> None:
        self.gate.set()

    def payloads(self) -> list[list]:
        return [[r.payload for r in call] for call in self.calls]

    def groups(self) -> list[set[str]]:
        return [{r.group for r in call} for call in self.calls]


@pytest.fixture
async def make():
    """`make(fake, **kwargs) -> Batcher`; every batcher is released and closed at teardown."""
    made: list[tuple[Batcher, FakeRunBatch]] = []

    def _make(fake: FakeRunBatch, **kwargs) -> Batcher:
        kwargs.setdefault("max_batch_size", 4)
        kwargs.setdefault("max_wait_ms", LONG_MS)
        kwargs.setdefault("max_queue_rows", 64)
        b = Batcher(fake, **kwargs)
        made.append((b, fake))
        return b

    yield _make
    for b, fake in made:
        fake.release()
        await asyncio.wait_for(b.close(), 10)


async def settle() -> None:
    """Let every ready task run up to its next real wait."""
    for _ in range(5):
        await asyncio.sleep(0)


def spawn(coro) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(coro)


async def gather5(*aws, **kw):
    return await asyncio.wait_for(asyncio.gather(*aws, **kw), 5)


async def running_and_queued(b: Batcher, fake: FakeRunBatch) -> tuple[asyncio.Task, asyncio.Task]:
    """Row "p0" inside the held `run_batch`, row "p1" queued behind it (max_batch_size 1)."""
    running = spawn(b.submit("p0", group="a"))
    await fake.entered()
    queued = spawn(b.submit("p1", group="a"))
    await settle()
    return running, queued


# -- flushing -------------------------------------------------------------------------------------


async def test_flushes_as_soon_as_max_batch_size_rows_wait(make):
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=4, max_wait_ms=LONG_MS)
    results = await gather5(*(b.submit(i, group="a") for i in range(4)))
    assert results == [("ok", i) for i in range(4)]
    assert fake.payloads() == [[0, 1, 2, 3]]
    assert b.batches_run == 1


async def test_flushes_after_max_wait_ms_with_fewer_rows(make):
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=16, max_wait_ms=20)
    t0 = time.monotonic()
    results = await gather5(*(b.submit(i, group="a") for i in range(3)))
    elapsed = time.monotonic() - t0
    assert results == [("ok", 0), ("ok", 1), ("ok", 2)]
    assert fake.payloads() == [[0, 1, 2]]
    assert elapsed >= 0.018  # it did wait for more rows (bound generous on the other side)


async def test_rows_queued_while_a_batch_runs_form_the_next_batch(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=8, max_wait_ms=LONG_MS)
    first = [spawn(b.submit(i, group="a")) for i in range(8)]
    await fake.entered()
    later = [spawn(b.submit(i, group="a")) for i in range(8, 11)]
    await settle()
    assert b.queue_depth == 3
    fake.release()
    # Not a full batch and max_wait_ms is a minute away: they stay queued until close flushes.
    await gather5(*first)
    await settle()
    assert not any(t.done() for t in later)
    await asyncio.wait_for(b.close(), 5)
    assert [t.result() for t in later] == [("ok", i) for i in range(8, 11)]
    assert fake.payloads() == [list(range(8)), [8, 9, 10]]


# -- grouping -------------------------------------------------------------------------------------


async def test_mixed_policy_puts_rows_of_several_bots_in_one_batch(make):
    fake = FakeRunBatch()
    seen = []
    b = make(fake, max_batch_size=6, on_batch=lambda *a: seen.append(a))
    groups = ["a", "b", "c"] * 2
    results = await gather5(*(b.submit(i, group=g) for i, g in enumerate(groups)))
    assert results == [("ok", i) for i in range(6)]
    assert fake.groups() == [{"a", "b", "c"}]
    assert [r.group for r in fake.calls[0]] == groups  # FIFO order kept
    (size, n_groups, waits, run_s), = seen
    assert (size, n_groups, len(waits)) == (6, 3, 6)
    assert all(w >= 0 for w in waits) and run_s >= 0


async def test_per_group_policy_never_mixes_bots_in_a_batch(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=3, max_wait_ms=5, policy="per_group")
    blocker = spawn(b.submit("z0", group="z"))
    await fake.entered()
    order = ["a", "b", "a", "c", "b", "a", "a", "c"]
    tasks = [spawn(b.submit(f"{g}{i}", group=g)) for i, g in enumerate(order)]
    await settle()
    fake.release()
    results = await gather5(blocker, *tasks)
    assert [r[1] for r in results[1:]] == [f"{g}{i}" for i, g in enumerate(order)]
    assert all(len(gs) == 1 for gs in fake.groups()), fake.groups()
    assert fake.groups()[1] == {"a"}  # the oldest waiting row's group goes first
    delivered = sorted(p for call in fake.payloads()[1:] for p in call)
    assert delivered == sorted(f"{g}{i}" for i, g in enumerate(order))  # each row exactly once


async def test_per_group_full_group_runs_without_waiting_for_an_older_partial_group(make):
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=2, max_wait_ms=LONG_MS, policy="per_group")
    lonely = spawn(b.submit("a0", group="a"))
    await settle()
    full = await gather5(b.submit("b0", group="b"), b.submit("b1", group="b"))
    assert full == [("ok", "b0"), ("ok", "b1")]
    assert not lonely.done() and b.queue_depth == 1
    await asyncio.wait_for(b.close(), 5)  # close flushes the partial batch at once
    assert lonely.result() == ("ok", "a0")
    assert fake.groups() == [{"b"}, {"a"}]


# -- failure isolation ------------------------------------------------------------------------


def _short_by_one(rows, i):
    out = [("ok", r.payload) for r in rows]
    return out[:-1] if i == 0 else out


def _raise_first(rows, i):
    if i == 0:
        raise RuntimeError("trunk exploded")
    return [("ok", r.payload) for r in rows]


@pytest.mark.parametrize(
    "fn, error, message",
    [(_short_by_one, BatchError, "returned 1 results for a batch of 2 rows"),
     (_raise_first, RuntimeError, "trunk exploded")],
    ids=["result-count-mismatch", "exception-in-run-batch"],
)
async def test_failed_batch_fails_only_its_own_rows_and_the_next_batch_runs(
    make, fn, error, message
):
    fake = FakeRunBatch(fn, hold=True)
    b = make(fake, max_batch_size=2)
    doomed = [spawn(b.submit(i, group="a")) for i in range(2)]
    await fake.entered()
    fine = [spawn(b.submit(i, group="b")) for i in range(2, 4)]
    await settle()
    fake.release()
    outcomes = await gather5(*doomed, return_exceptions=True)
    assert all(isinstance(o, error) and message in str(o) for o in outcomes), outcomes
    assert await gather5(*fine) == [("ok", 2), ("ok", 3)]
    assert await gather5(b.submit(8, group="c"), b.submit(9, group="c")) == [("ok", 8), ("ok", 9)]
    assert b.batches_run >= 2


async def test_claim_is_taken_as_a_batch_is_taken_and_given_back_once_it_is_done(make):
    """`claim` (the engine's: the cores for the trunk) is called on the event loop before the
    batch reaches its thread, and what it returned once the batch is done, failed or not."""
    log: list[str] = []

    def fn(rows, i):
        log.append(f"run {i}")
        if i == 1:
            raise RuntimeError("the trunk failed")
        return [("ok", r.payload) for r in rows]

    def claim():
        log.append(f"claim on the loop: {threading.current_thread() is threading.main_thread()}")
        return lambda: log.append("given back")

    fake = FakeRunBatch(fn)
    b = make(fake, max_batch_size=1, claim=claim)
    assert await b.submit("a", group="g") == ("ok", "a")
    with pytest.raises(RuntimeError, match="the trunk failed"):
        await b.submit("b", group="g")
    assert log == ["claim on the loop: True", "run 0", "given back",
                   "claim on the loop: True", "run 1", "given back"]


async def test_exception_result_fails_only_that_row(make):
    def fn(rows, i):
        return [ValueError(f"head of {r.group} failed") if r.payload == 1 else ("ok", r.payload)
                for r in rows]

    fake = FakeRunBatch(fn)
    b = make(fake, max_batch_size=3)
    outcomes = await gather5(*(b.submit(i, group=g) for i, g in enumerate("xyz")),
                             return_exceptions=True)
    assert outcomes[0] == ("ok", 0) and outcomes[2] == ("ok", 2)
    assert isinstance(outcomes[1], ValueError) and "head of y failed" in str(outcomes[1])
    assert fake.payloads() == [[0, 1, 2]]


async def test_client_disconnect_while_its_batch_runs_does_not_break_delivery_to_others(make):
    # The race: a client goes away while its row is inside run_batch; setting a result on its
    # cancelled future raised InvalidStateError and killed the batching loop (Ray, MLServer).
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=3)
    tasks = [spawn(b.submit(i, group="a")) for i in range(3)]
    await fake.entered()
    tasks[1].cancel()
    await settle()
    fake.release()
    assert await gather5(tasks[0], tasks[2]) == [("ok", 0), ("ok", 2)]
    assert tasks[1].cancelled()
    more = await gather5(*(b.submit(i, group="a") for i in range(3, 6)))  # still alive
    assert more == [("ok", 3), ("ok", 4), ("ok", 5)]


async def test_client_disconnect_before_its_batch_runs_removes_its_row(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=2, max_wait_ms=1)
    running = spawn(b.submit("p0", group="a"))
    await fake.entered()
    gone = spawn(b.submit("p1", group="a"))
    stays = spawn(b.submit("p2", group="a"))
    await settle()
    assert b.queue_depth == 2
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert b.queue_depth == 1
    fake.release()
    assert await gather5(running, stays) == [("ok", "p0"), ("ok", "p2")]
    assert "p1" not in [p for call in fake.payloads() for p in call]


async def test_cancelled_submit_many_withdraws_all_its_rows(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=8, max_wait_ms=1)
    running = spawn(b.submit("p0", group="a"))
    await fake.entered()
    many = spawn(b.submit_many(["m0", "m1", "m2"], group="b"))
    await settle()
    assert b.queue_depth == 3
    many.cancel()
    with pytest.raises(asyncio.CancelledError):
        await many
    assert b.queue_depth == 0
    fake.release()
    await gather5(running)
    assert fake.payloads() == [["p0"]]


# -- deadlines, bounds, shutdown ----------------------------------------------------------------


async def test_rows_whose_deadline_passed_are_dropped_before_run(make):
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=4, max_wait_ms=1, clock=clock)
    running = spawn(b.submit("p0", group="a"))
    await settle()
    clock.advance(0.001)  # p0 has waited max_wait_ms
    b.poke()
    await fake.entered()
    late = spawn(b.submit("late", group="a", deadline=clock.now + 0.01))
    fine = spawn(b.submit("fine", group="a", deadline=clock.now + 60))
    await settle()
    clock.advance(0.03)  # late's deadline passes while the batch ahead of it still runs
    fake.release()
    assert await gather5(running, fine) == [("ok", "p0"), ("ok", "fine")]
    with pytest.raises(DeadlineExceeded):
        await late
    assert "late" not in [p for call in fake.payloads() for p in call]
    assert b.rows_expired == 1


async def test_submit_with_a_past_deadline_is_refused_without_queueing(make):
    fake = FakeRunBatch()
    b = make(fake)
    with pytest.raises(DeadlineExceeded):
        await b.submit("x", group="a", deadline=time.monotonic() - 1)
    assert b.queue_depth == 0 and fake.calls == []


async def test_full_queue_raises_overloaded_at_once_without_losing_queued_rows(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=2, max_queue_rows=4)
    running = [spawn(b.submit(i, group="a")) for i in range(2)]
    await fake.entered()
    queued = [spawn(b.submit(i, group="b")) for i in range(2, 6)]
    await settle()
    assert b.queue_depth == 4
    with pytest.raises(Overloaded) as info:
        await asyncio.wait_for(b.submit(99, group="c"), 1)  # never blocks
    assert info.value.retry_after_s >= 1
    with pytest.raises(Overloaded):
        await asyncio.wait_for(b.submit_many([97, 98], group="c"), 1)
    assert b.queue_depth == 4
    fake.release()
    assert await gather5(*running, *queued) == [("ok", i) for i in range(6)]
    assert 99 not in [p for call in fake.payloads() for p in call]


async def test_submit_many_is_all_or_nothing_against_the_queue_bound(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=1, max_queue_rows=4)
    running = spawn(b.submit("p0", group="a"))
    await fake.entered()
    two = spawn(b.submit_many(["q0", "q1"], group="a"))
    await settle()
    with pytest.raises(Overloaded):
        await b.submit_many(["r0", "r1", "r2"], group="b")
    assert b.queue_depth == 2  # nothing of the refused request was queued
    with pytest.raises(BadRequest, match="max_queue_rows=4"):
        await b.submit_many(list(range(5)), group="b")  # can never fit
    fake.release()
    assert await gather5(running, two) == [("ok", "p0"), [("ok", "q0"), ("ok", "q1")]]


async def test_submit_many_returns_results_in_order_or_raises_the_failed_row(make):
    def fn(rows, i):
        return [KeyError(r.payload) if r.payload == "bad" else ("ok", r.payload) for r in rows]

    fake = FakeRunBatch(fn)
    b = make(fake, max_batch_size=3)
    assert await gather5(b.submit_many(["a", "b", "c"], group="g")) == [
        [("ok", "a"), ("ok", "b"), ("ok", "c")]]
    with pytest.raises(KeyError):
        await asyncio.wait_for(b.submit_many(["a", "bad", "c"], group="g"), 5)
    out = await asyncio.wait_for(
        b.submit_many(["a", "bad", "c"], group="g", return_exceptions=True), 5)
    assert out[0] == ("ok", "a") and isinstance(out[1], KeyError) and out[2] == ("ok", "c")
    assert await b.submit_many([], group="g") == []


async def test_close_finishes_queued_rows_then_refuses_new_ones(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=2, max_wait_ms=LONG_MS)
    running = [spawn(b.submit(i, group="a")) for i in range(2)]
    await fake.entered()
    queued = [spawn(b.submit(i, group="a")) for i in range(2, 5)]
    await settle()
    closing = spawn(b.close())
    await settle()
    assert not closing.done()
    with pytest.raises(ShuttingDown):
        await b.submit(99, group="a")
    fake.release()
    await asyncio.wait_for(closing, 5)
    assert [t.result() for t in running + queued] == [("ok", i) for i in range(5)]
    assert fake.payloads() == [[0, 1], [2, 3], [4]]  # the last, partial batch did not wait
    await asyncio.wait_for(b.close(), 5)  # twice is fine
    assert b.closing


async def test_close_with_timeout_fails_queued_rows_but_waits_for_the_running_batch(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=1)
    running, queued = await running_and_queued(b, fake)
    closing = spawn(b.close(timeout_s=0.01))
    outcomes = await gather5(running, queued, return_exceptions=True)
    assert all(isinstance(o, ShuttingDown) for o in outcomes)
    assert [str(o) for o in outcomes] == [  # each names what was lost
        "the service shut down before this request finished",
        "the service shut down before this request ran"]
    with pytest.raises(ShuttingDown) as info:
        await b.submit("p2", group="a")
    assert str(info.value) == "the service is shutting down and accepts no new requests"
    await settle()
    assert not closing.done()  # run_batch is still inside the worker: close waits for it
    fake.release()
    await asyncio.wait_for(closing, 5)
    assert fake.payloads() == [["p0"]]


async def test_close_before_any_submit(make):
    b = make(FakeRunBatch())
    await asyncio.wait_for(b.close(), 5)
    with pytest.raises(ShuttingDown):
        await b.submit(1, group="a")


# -- threads, hooks, arguments ------------------------------------------------------------------


async def test_run_batch_runs_in_one_dedicated_thread_off_the_event_loop(make):
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=2)
    for i in range(3):
        await gather5(b.submit(i, group="a"), b.submit(i, group="b"))
    assert len(fake.threads) == 3
    assert all(t is not threading.current_thread() for t in fake.threads)
    assert len({t.ident for t in fake.threads}) == 1
    assert fake.threads[0].name.startswith("multihead-batch")


async def test_a_passed_executor_is_used_and_left_running(make):
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="given")
    try:
        fake = FakeRunBatch()
        b = make(fake, max_batch_size=1, executor=executor)
        assert await b.submit(1, group="a") == ("ok", 1)
        await b.close()
        assert fake.threads[0].name.startswith("given")
        assert executor.submit(lambda: 42).result(5) == 42
    finally:
        executor.shutdown()


async def test_a_failing_on_batch_hook_never_breaks_serving(make):
    def hook(*args):
        raise RuntimeError("stats backend down")

    b = make(FakeRunBatch(), max_batch_size=1, on_batch=hook)
    assert await asyncio.wait_for(b.submit(1, group="a"), 5) == ("ok", 1)
    assert await asyncio.wait_for(b.submit(2, group="a"), 5) == ("ok", 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"max_batch_size": 0}, "max_batch_size"),
     ({"max_wait_ms": -1}, "max_wait_ms"),
     ({"max_queue_rows": 0}, "max_queue_rows"),
     ({"policy": "per_bot"}, "policy")],
)
def test_invalid_arguments_are_refused_at_construction(kwargs, message):
    args = {"max_batch_size": 4, "max_wait_ms": 5, "max_queue_rows": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        Batcher(lambda rows: rows, **args)


async def test_with_wait_for_booked_only_a_batch_waits_only_for_rows_booked():
    """With nothing booked, a lone row runs at once; while rows are booked (being prepared)
    it waits for them (up to max_wait_ms) and they share its batch; releasing an unused
    booking lets the waiting batch go."""
    fake = FakeRunBatch()
    batcher = Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=16,
                      wait_for_booked_only=True)
    try:
        alone = await asyncio.wait_for(batcher.submit("a", group="g"), timeout=10)
        assert alone == ("ok", "a") and len(fake.calls) == 1

        coming = batcher.book(1)  # another row is being decoded
        first = asyncio.ensure_future(batcher.submit("b", group="g"))
        await asyncio.sleep(0.05)
        assert not first.done() and len(fake.calls) == 1  # it waits for the booked row
        second = asyncio.ensure_future(batcher.submit_many(["c"], group="h", booking=coming))
        assert await asyncio.wait_for(asyncio.gather(first, second), timeout=10) == [
            ("ok", "b"), [("ok", "c")]]
        assert [len(call) for call in fake.calls] == [1, 2]

        never = batcher.book(2)
        third = asyncio.ensure_future(batcher.submit("d", group="g"))
        await asyncio.sleep(0.05)
        assert not third.done()
        never.release()  # the booked rows will not come (their decoding failed, say)
        assert await asyncio.wait_for(third, timeout=10) == ("ok", "d")
    finally:
        await batcher.close()


async def test_booked_room_counts_against_the_queue_bound_until_used_or_released():
    fake = FakeRunBatch()
    batcher = Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=4)
    try:
        held = batcher.book(3)
        with pytest.raises(Overloaded):
            batcher.book(2)  # 3 booked + 2 > 4
        with pytest.raises(Overloaded):
            await batcher.submit_many(["x", "y"], group="g")  # unbooked rows check too
        with batcher.book(1):
            with pytest.raises(Overloaded):
                batcher.book(1)
        batcher.book(1).release()  # released: room again
        queued = asyncio.ensure_future(batcher.submit_many(["a", "b", "c"], group="g",
                                                           booking=held))
        await asyncio.sleep(0)
        assert batcher.queue_depth == 3 and not held.held
        with pytest.raises(RuntimeError, match="released, used"):
            await batcher.submit_many(["again"], group="g", booking=held)  # used already
        with pytest.raises(Overloaded):
            batcher.book(2)  # the rows queued on the booking hold the room now
        with pytest.raises(RuntimeError, match="2 rows queued on a booking of 1"):
            await batcher.submit_many(["p", "q"], group="g", booking=batcher.book(1))
        await batcher.close()
        assert await queued == [("ok", "a"), ("ok", "b"), ("ok", "c")]
    finally:
        await batcher.close()


# -- a controlled clock: waits, deadlines and batch times without sleeping -------------------------


async def test_rows_that_waited_through_a_running_batch_go_at_once_after_it(make):
    # Guards the timer being restarted after each batch: the wait counts from a row's arrival,
    # so a row that waited out max_wait_ms behind a running batch must not wait again.
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=2, max_wait_ms=1000, clock=clock)
    first = [spawn(b.submit(i, group="a")) for i in range(2)]  # full: runs at once
    await fake.entered()
    late = spawn(b.submit("late", group="b"))
    await settle()
    clock.advance(1.5)  # its max_wait_ms passes while the first batch still runs
    fake.release()
    await gather5(*first)
    assert await asyncio.wait_for(late, 5) == ("ok", "late")
    assert fake.payloads() == [[0, 1], ["late"]]


@pytest.mark.parametrize("policy", ["mixed", "per_group"])
async def test_max_wait_ms_counts_on_the_clock_from_the_first_row(make, policy):
    clock = FakeClock()
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=8, max_wait_ms=1000, policy=policy, clock=clock)
    first = spawn(b.submit(0, group="a"))
    await settle()
    clock.advance(0.5)
    second = spawn(b.submit(1, group="a"))
    await settle()
    clock.advance(0.4995)
    b.poke()
    await settle()
    assert not first.done() and fake.calls == []  # 999.5 ms: not yet
    clock.advance(0.0005)  # exactly max_wait_ms after the FIRST row, not the second
    b.poke()
    assert await gather5(first, second) == [("ok", 0), ("ok", 1)]
    assert fake.payloads() == [[0, 1]]


async def test_retry_after_is_batches_ahead_times_the_recent_batch_time(make):
    # Guards a constant Retry-After: the estimate follows the queue and the measured batch time.
    clock = FakeClock()
    run_s = {0: 4.0, 1: 9.0}

    def timed(rows, i):
        clock.advance(run_s.get(i, 0.0))
        return [("ok", r.payload) for r in rows]

    fake = FakeRunBatch(timed)
    b = make(fake, max_batch_size=2, max_wait_ms=5000, max_queue_rows=8, clock=clock)
    assert b.retry_after_s() == 5.0  # nothing measured yet: one batch of max_wait_ms
    await gather5(b.submit(0, group="a"), b.submit(1, group="a"))  # batch 0 takes 4 s
    assert b.retry_after_s() == 4.0
    fake.gate.clear()
    running = [spawn(b.submit(i, group="a")) for i in (2, 3)]  # batch 1, held, takes 9 s
    await fake.entered()
    await fake.entered()
    queued = [spawn(b.submit(i, group="b")) for i in range(10, 13)]
    await settle()
    assert b.queue_depth == 3 and b.retry_after_s() == 12.0  # (ceil(3/2) + 1) x 4 s
    queued += [spawn(b.submit(i, group="b")) for i in range(13, 18)]
    await settle()
    with pytest.raises(Overloaded) as info:
        await b.submit(99, group="c")
    assert info.value.retry_after_s == 20.0  # (8/2 + 1) batches x 4 s
    fake.release()
    await gather5(*running, *queued)
    # Batch times 4, 9, 0, 0, 0, 0: a moving average 0.8 old + 0.2 new.
    assert b.retry_after_s() == pytest.approx(max(1.0, 5.0 * 0.8 ** 4))
    assert b.batches_run == 6


@pytest.mark.parametrize("max_wait_ms, queued, want", [
    (0.0, 30, 3.1),       # no estimate yet: 0.1 s a batch at least, 31 batches
    (0.0, 0, 1.0),        # never under 1 s
    (5000.0, 30, 60.0),   # never over 60 s
])
async def test_retry_after_bounds_before_any_batch(make, max_wait_ms, queued, want):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=1, max_wait_ms=max_wait_ms, max_queue_rows=64,
             clock=FakeClock())
    if queued:
        tasks = [spawn(b.submit(i, group="a")) for i in range(queued + 1)]  # 1 runs, rest wait
        await fake.entered()
        await settle()
        assert b.queue_depth == queued
    assert b.retry_after_s() == pytest.approx(want)
    fake.release()
    if queued:
        await gather5(*tasks)


async def test_a_crashed_batching_task_fails_its_rows_and_the_next_submit_starts_a_fresh_one(
        make, caplog):
    # Guards the recovery of a dead batching task: without it every later request would hang.
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=1)
    original = b._ready_group
    crashes = [RuntimeError("a bug in the batcher")]

    def buggy(now):
        if crashes:
            raise crashes.pop()
        return original(now)

    b._ready_group = buggy
    with pytest.raises(BatchError) as info:
        await asyncio.wait_for(b.submit("lost", group="a"), 5)
    assert str(info.value) == "the batcher failed; please retry"
    assert "batching task died" in caplog.text
    assert await asyncio.wait_for(b.submit("next", group="a"), 5) == ("ok", "next")
    assert any(t.get_name() == "multihead-batcher" for t in asyncio.all_tasks())
    assert fake.payloads() == [["next"]]


async def test_per_group_takes_the_oldest_full_group_first(make):
    # Guards taking the newest full group: b's first row is older than c's, so b goes first.
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=2, policy="per_group")
    blocker = [spawn(b.submit(f"z{i}", group="z")) for i in range(2)]
    await fake.entered()
    order = [("a", "a0"), ("b", "b0"), ("c", "c0"), ("b", "b1"), ("c", "c1")]
    tasks = {p: spawn(b.submit(p, group=g)) for g, p in order}
    await settle()
    fake.release()
    await gather5(*blocker, tasks["b0"], tasks["b1"], tasks["c0"], tasks["c1"])
    assert fake.payloads() == [["z0", "z1"], ["b0", "b1"], ["c0", "c1"]]
    assert not tasks["a0"].done()  # a partial group waits for its max_wait_ms (or close)


async def test_per_group_counts_rows_per_group_across_batches(make):
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=2, policy="per_group")
    blocker = [spawn(b.submit(f"z{i}", group="z")) for i in range(2)]
    await fake.entered()
    three = [spawn(b.submit(f"a{i}", group="a")) for i in range(3)]
    await settle()
    fake.release()
    await gather5(*blocker, *three[:2])
    await settle()
    assert not three[2].done()  # one "a" row left: not a full group
    fourth = spawn(b.submit("a3", group="a"))  # now two: full again, runs at once
    assert await gather5(three[2], fourth) == [("ok", "a2"), ("ok", "a3")]
    assert fake.payloads() == [["z0", "z1"], ["a0", "a1"], ["a2", "a3"]]


async def test_an_idle_batcher_wakes_for_a_lone_row_and_for_a_batch_filled_later(make):
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=3, max_wait_ms=0)
    assert await gather5(b.submit(0, group="a")) == [("ok", 0)]
    await settle()  # the batching task is now idle, waiting for rows
    assert await gather5(b.submit(1, group="a")) == [("ok", 1)]
    slow = make(FakeRunBatch(), max_batch_size=3)  # max_wait_ms: a minute
    first = spawn(slow.submit(0, group="a"))
    await settle()  # waiting on its timer with one row
    rest = [spawn(slow.submit(i, group="a")) for i in (1, 2)]  # the third row fills the batch
    assert await gather5(first, *rest) == [("ok", 0), ("ok", 1), ("ok", 2)]


async def test_deadlines_are_checked_on_the_clock_and_every_expired_row_is_counted(make):
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=4, clock=clock)
    running = spawn(b.submit_many(["p0", "p1", "p2", "p3"], group="a"))  # a full batch
    await fake.entered()
    closing_soon = [
        spawn(b.submit("a", group="a")),
        spawn(b.submit("late1", group="a", deadline=clock.now + 1)),
        spawn(b.submit("late2", group="a", deadline=clock.now + 2)),
        spawn(b.submit("b", group="a", deadline=clock.now + 60)),
    ]
    await settle()
    with pytest.raises(DeadlineExceeded) as refused:
        await b.submit("now", group="a", deadline=clock.now)  # a deadline of now has passed
    assert str(refused.value) == "the request's deadline passed before it was queued"
    clock.advance(2)  # exactly late2's deadline
    fake.release()
    assert await gather5(running) == [[("ok", f"p{i}") for i in range(4)]]
    outcomes = await gather5(*closing_soon, return_exceptions=True)
    assert outcomes[0] == ("ok", "a") and outcomes[3] == ("ok", "b")
    for late in outcomes[1:3]:
        assert isinstance(late, DeadlineExceeded)
        assert str(late) == "the request's deadline passed while it waited for the trunk"
    assert b.rows_expired == 2
    assert fake.payloads() == [["p0", "p1", "p2", "p3"], ["a", "b"]]  # live rows after an
    # expired one still go in the same batch


async def test_on_batch_reports_queue_waits_and_run_time_on_the_clock(make):
    clock = FakeClock()

    def slow(rows, i):
        clock.advance(2.5)
        return [("ok", r.payload) for r in rows]

    seen = []
    fake = FakeRunBatch(slow)
    b = make(fake, max_batch_size=2, clock=clock, on_batch=lambda *a: seen.append(a))
    first = spawn(b.submit(0, group="a"))
    await settle()
    clock.advance(0.75)
    await gather5(first, b.submit(1, group="b"))
    assert seen == [(2, 2, [0.75, 0.0], 2.5)]


async def test_submit_many_raises_the_first_failure_at_once_and_withdraws_the_rest(make):
    later = threading.Event()

    def fn(rows, i):
        if i > 0:
            assert later.wait(10)
        return [KeyError(r.payload) if r.payload == "bad" else ("ok", r.payload) for r in rows]

    fake = FakeRunBatch(fn)
    b = make(fake, max_batch_size=1)
    many = spawn(b.submit_many(["bad", "x", "y"], group="g"))
    await fake.entered()
    await fake.entered()  # "x" is inside run_batch, "y" still queued
    with pytest.raises(KeyError):
        await asyncio.wait_for(many, 5)  # without waiting for "x"
    assert b.queue_depth == 0  # "y" was withdrawn
    later.set()
    assert await gather5(b.submit("z", group="g")) == [("ok", "z")]
    assert fake.payloads() == [["bad"], ["x"], ["z"]]
    assert [r.group for call in fake.calls for r in call] == ["g"] * 3


async def test_submit_many_with_return_exceptions_waits_for_every_row(make):
    def fn(rows, i):
        return [KeyError(r.payload) if r.payload == "bad" else ("ok", r.payload) for r in rows]

    fake = FakeRunBatch(fn)
    b = make(fake, max_batch_size=1)
    out = await asyncio.wait_for(
        b.submit_many(["bad", "x", "y"], group="g", return_exceptions=True), 5)
    assert isinstance(out[0], KeyError) and out[1:] == [("ok", "x"), ("ok", "y")]
    with pytest.raises(DeadlineExceeded):
        await b.submit_many(["p"], group="g", deadline=time.monotonic() - 1)


async def test_submit_many_of_exactly_max_queue_rows_fits(make):
    b = make(FakeRunBatch(), max_batch_size=2, max_queue_rows=4)
    assert await asyncio.wait_for(b.submit_many(range(4), group="g"), 5) == [
        ("ok", i) for i in range(4)]


@pytest.mark.parametrize("returned, message", [
    (None, "run_batch returned a non-sequence for a batch of 2 rows"),
    ([("ok", 0)], "run_batch returned 1 results for a batch of 2 rows"),
])
async def test_a_broken_run_batch_contract_is_a_batch_error_naming_it(make, returned, message):
    b = make(FakeRunBatch(lambda rows, i: returned), max_batch_size=2)
    outcomes = await gather5(b.submit(0, group="a"), b.submit(1, group="a"),
                             return_exceptions=True)
    assert [type(o) for o in outcomes] == [BatchError, BatchError]
    assert [str(o) for o in outcomes] == [message, message]


async def test_a_result_that_cannot_be_delivered_fails_that_row_only(make):
    b = make(FakeRunBatch(lambda rows, i: [StopIteration(), ("ok", 1)]), max_batch_size=2)
    outcomes = await gather5(b.submit(0, group="a"), b.submit(1, group="a"),
                             return_exceptions=True)
    assert isinstance(outcomes[0], BatchError) and outcomes[1] == ("ok", 1)
    assert str(outcomes[0]).startswith("cannot deliver this row's result: TypeError")


async def test_close_waits_for_a_batch_inside_a_passed_executor(make):
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        fake = FakeRunBatch(hold=True)
        b = make(fake, max_batch_size=1, executor=executor)
        running = spawn(b.submit("p0", group="a"))
        await fake.entered()
        closing = spawn(b.close(timeout_s=0.01))
        with pytest.raises(ShuttingDown):
            await asyncio.wait_for(running, 5)
        await settle()
        await asyncio.sleep(0.05)  # a real wait: close must still be waiting for the worker
        assert not closing.done()
        fake.release()
        await asyncio.wait_for(closing, 5)
    finally:
        executor.shutdown()


async def test_close_joins_its_own_worker_thread(make):
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=1)
    assert await b.submit(1, group="a") == ("ok", 1)
    await asyncio.wait_for(b.close(), 5)
    assert not fake.threads[0].is_alive()


async def test_a_batcher_is_bound_to_one_event_loop(make):
    b = make(FakeRunBatch(), max_batch_size=1)
    await b.start()

    def elsewhere():
        async def go():
            await b.submit(1, group="a")
        return asyncio.run(go())

    with pytest.raises(RuntimeError) as info:
        await asyncio.get_running_loop().run_in_executor(None, elsewhere)
    assert str(info.value) == "this Batcher is bound to another event loop"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch_size": True}, "max_batch_size must be an int >= 1, got True"),
    ({"max_batch_size": 2.5}, "max_batch_size must be an int >= 1, got 2.5"),
    ({"max_wait_ms": float("nan")}, "max_wait_ms must be >= 0, got nan"),
    ({"max_queue_rows": 1.5}, "max_queue_rows must be an int >= 1, got 1.5"),
    ({"policy": "per_bot"}, "policy must be one of mixed, per_group, got 'per_bot'"),
])
def test_invalid_arguments_messages_name_the_value(kwargs, message):
    args = {"max_batch_size": 4, "max_wait_ms": 5, "max_queue_rows": 8, **kwargs}
    with pytest.raises(ValueError) as info:
        Batcher(lambda rows: rows, **args)
    assert str(info.value) == message


def test_smallest_valid_arguments_are_accepted_and_run_batch_must_be_callable():
    b = Batcher(lambda rows: rows, max_batch_size=1, max_wait_ms=0, max_queue_rows=1)
    assert b.max_batch_size == 1 and b.policy == "mixed" and not b.closing
    with pytest.raises(TypeError) as info:
        Batcher(None, max_batch_size=1, max_wait_ms=0, max_queue_rows=1)
    assert str(info.value) == "run_batch must be callable"


# -- rows across several batches, rows withdrawn as their batch forms or runs ------------------


async def test_per_group_full_batches_of_one_group_run_back_to_back(make):
    # Four rows of one bot queued behind a running batch, two per batch: both batches run
    # without waiting for max_wait_ms (a minute), so the count left after the first is right.
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=2, max_wait_ms=LONG_MS, policy="per_group")
    blocker = [spawn(b.submit(f"z{i}", group="z")) for i in range(2)]
    await fake.entered()
    rows = [spawn(b.submit(f"a{i}", group="a")) for i in range(4)]
    await settle()
    fake.release()
    assert await gather5(*blocker, *rows) == [("ok", p) for p in
                                              ("z0", "z1", "a0", "a1", "a2", "a3")]
    assert fake.payloads() == [["z0", "z1"], ["a0", "a1"], ["a2", "a3"]]


async def test_a_row_cancelled_as_its_batch_forms_does_not_split_the_batch(make):
    clock = FakeClock()
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=4, max_wait_ms=1000, clock=clock)
    tasks = [spawn(b.submit(p, group="g")) for p in ("a", "gone", "c")]
    await settle()  # three rows wait for max_wait_ms
    clock.advance(1.0)
    b.poke()  # the batcher runs before the cancelled caller gets to withdraw its row
    tasks[1].cancel()
    assert await gather5(tasks[0], tasks[2]) == [("ok", "a"), ("ok", "c")]
    assert tasks[1].cancelled()
    assert fake.payloads() == [["a", "c"]]


async def test_rows_withdrawn_while_their_batch_runs_leave_no_unretrieved_error(make, caplog):
    # submit_many raises the first failure and gives up on its other rows; one of them is
    # inside run_batch and fails later: nobody awaits it, and nothing may be logged about it.
    second_may_finish = threading.Event()

    def fn(rows, i):
        if rows[0].payload == "second":
            assert second_may_finish.wait(10)
        return [KeyError(r.payload) for r in rows]

    fake = FakeRunBatch(fn)
    b = make(fake, max_batch_size=1)
    many = spawn(b.submit_many(["first", "second"], group="g"))
    await fake.entered()  # "first" runs and fails
    await fake.entered()  # "second" is inside run_batch when submit_many gives up on it
    try:
        await asyncio.wait_for(many, 5)
    except KeyError as exc:
        assert exc.args == ("first",)
    else:
        pytest.fail("submit_many did not raise the first row's error")
    second_may_finish.set()
    await asyncio.wait_for(b.close(), 5)  # "second" has failed by now
    del many  # the task (and the traceback it keeps) is the last holder of the rows' futures
    with caplog.at_level(logging.ERROR):
        gc.collect()
        await settle()
    assert "never retrieved" not in caplog.text
    assert fake.payloads() == [["first"], ["second"]]


async def test_close_after_the_batching_task_was_cancelled_fails_the_rows_left_queued(make):
    # The event loop cancels every task when it shuts down; rows queued at that moment must
    # still be answered when the batcher is closed, not left hanging.
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=1)
    running, queued = await running_and_queued(b, fake)
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "multihead-batcher"]
    task.cancel()
    await settle()
    assert task.cancelled() and b.queue_depth == 1
    fake.release()
    await asyncio.wait_for(b.close(), 5)
    outcomes = await gather5(running, queued, return_exceptions=True)
    assert [(type(o).__name__, str(o)) for o in outcomes] == [
        ("ShuttingDown", "the service shut down before this request finished"),
        ("ShuttingDown", "the service shut down before this request ran")]


# -- gather_booked: the trunk runs alone, decodes between batches (service.core.cores) -----------


@pytest.mark.parametrize("gather", [False, True])
async def test_gather_booked_waits_past_max_wait_for_rows_being_decoded(make, gather):
    """With gather_booked a batch waits for the rows booked (being decoded) while they keep
    coming, past max_wait_ms; without it, it leaves at max_wait_ms and they make a second one."""
    clock = FakeClock()
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=8, max_wait_ms=0, wait_for_booked_only=True,
             gather_booked=gather, clock=clock)
    coming = b.book(2)
    first = spawn(b.submit("a", group="g"))
    await settle()
    clock.advance(GATHER_IDLE_S / 2)  # past max_wait_ms, within the idle bound
    b.poke()
    await settle()
    if gather:
        assert not first.done()  # still waiting for the rows being decoded
    else:
        await asyncio.wait_for(first, 5)  # left alone at max_wait_ms
    rest = spawn(b.submit_many(["b", "c"], group="g", booking=coming))
    await gather5(first, rest)
    assert fake.payloads() == ([["a", "b", "c"]] if gather else [["a"], ["b", "c"]])


async def test_gather_booked_stops_waiting_when_no_row_came_for_the_idle_bound(make):
    clock = FakeClock()
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=8, max_wait_ms=0, wait_for_booked_only=True,
             gather_booked=True, clock=clock)
    stuck = b.book(1)  # a decode that takes long (a huge image)
    first = spawn(b.submit("a", group="g"))
    await settle()
    assert not first.done()
    clock.advance(GATHER_IDLE_S * 1.01)
    b.poke()
    assert await asyncio.wait_for(first, 5) == ("ok", "a")
    stuck.release()
    assert fake.payloads() == [["a"]]


async def test_gather_booked_runs_a_full_batch_at_once(make):
    clock = FakeClock()
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=2, max_wait_ms=LONG_MS, wait_for_booked_only=True,
             gather_booked=True, clock=clock)
    b.book(3)  # more are coming, but the batch is full
    assert await gather5(b.submit("a", group="g"), b.submit("b", group="g")) == [
        ("ok", "a"), ("ok", "b")]


async def test_gather_booked_counts_the_idle_bound_from_the_last_batch_end(make):
    """Rows booked while a batch runs are decoded only after it (the trunk holds the cores):
    the next batch waits for them even though the rows queued before it are old."""
    clock = FakeClock()
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=8, max_wait_ms=0, wait_for_booked_only=True,
             gather_booked=True, clock=clock)
    running = spawn(b.submit("running", group="g"))
    await fake.entered()
    waiting = spawn(b.submit("queued", group="g"))
    coming = b.book(1)  # its decode waits for the running batch
    await settle()
    clock.advance(1.0)  # a long batch: far more than the idle bound
    fake.release()
    await gather5(running)
    await settle()
    assert not waiting.done()  # waits for the row being decoded now
    late = spawn(b.submit_many(["decoded"], group="g", booking=coming))
    await gather5(waiting, late)
    assert fake.payloads() == [["running"], ["queued", "decoded"]]


async def test_gather_booked_waits_max_wait_for_the_last_batchs_callers_to_come_back(make):
    """With nothing booked, a batch with fewer rows than the last one waits max_wait_ms after
    the last row (those callers were just answered: a closed loop's are coming back) rather
    than leaving at once and letting them arrive during the trunk's batch."""
    clock = FakeClock()
    fake = FakeRunBatch()
    b = make(fake, max_batch_size=8, max_wait_ms=10, wait_for_booked_only=True,
             gather_booked=True, clock=clock)
    assert await asyncio.wait_for(b.submit("alone", group="g"), 5) == ("ok", "alone")
    await gather5(b.submit("a", group="g"), b.submit("b", group="g"))  # a batch of 2 ...
    clock.advance(1.0)
    first = spawn(b.submit("c", group="g"))  # ... so 1 row waits for another
    await settle()
    assert not first.done()
    clock.advance(0.005)
    second = spawn(b.submit("d", group="g"))
    await settle()
    clock.advance(0.011)  # max_wait_ms after the last row
    b.poke()
    await gather5(first, second)
    assert fake.payloads() == [["alone"], ["a", "b"], ["c", "d"]]
    alone = spawn(b.submit("e", group="g"))  # the last batch had 2: this one waits too
    await settle()
    assert not alone.done()
    clock.advance(0.011)
    b.poke()
    assert await asyncio.wait_for(alone, 5) == ("ok", "e")
    assert await asyncio.wait_for(b.submit("f", group="g"), 5) == ("ok", "f")  # last had 1
