"""The batcher's logic with a fake `run_batch` (the subject is timing, grouping and failure
isolation, not the trunk). Concurrency is gated with events; tests assert which tasks are done,
never how long things took beyond generous bounds."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from service.batcher import Batcher, Row
from service.errors import BadRequest, BatchError, DeadlineExceeded, Overloaded, ShuttingDown

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
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=4, max_wait_ms=1)
    running = spawn(b.submit("p0", group="a"))
    await fake.entered()
    late = spawn(b.submit("late", group="a", deadline=time.monotonic() + 0.01))
    fine = spawn(b.submit("fine", group="a", deadline=time.monotonic() + 60))
    await asyncio.sleep(0.03)
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
    running = spawn(b.submit("p0", group="a"))
    await fake.entered()
    queued = spawn(b.submit("p1", group="a"))
    await settle()
    closing = spawn(b.close(timeout_s=0.01))
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(queued, 5)
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(running, 5)
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


async def test_incoming_hint_skips_the_wait_when_nobody_else_is_coming():
    """With nothing on the way, a lone row runs at once; while rows are being prepared it
    waits for them (up to max_wait_ms) and they share its batch."""
    incoming = [0]
    fake = FakeRunBatch()
    batcher = Batcher(fake, max_batch_size=8, max_wait_ms=LONG_MS, max_queue_rows=16,
                      incoming=lambda: incoming[0])
    try:
        alone = await asyncio.wait_for(batcher.submit("a", group="g"), timeout=10)
        assert alone == ("ok", "a") and len(fake.calls) == 1

        incoming[0] = 1  # another row is being decoded
        first = asyncio.ensure_future(batcher.submit("b", group="g"))
        await asyncio.sleep(0.05)
        assert not first.done() and len(fake.calls) == 1  # it waits for the coming row
        incoming[0] = 0
        second = asyncio.ensure_future(batcher.submit("c", group="h"))
        batcher.poke()
        assert await asyncio.wait_for(asyncio.gather(first, second), timeout=10) == [
            ("ok", "b"), ("ok", "c")]
        assert [len(call) for call in fake.calls] == [1, 2]
    finally:
        await batcher.close()
