"""Batcher bookkeeping of rows that test_batcher.py leaves out: per-group counts across several
batches, a row whose client went away just as its batch forms, and rows withdrawn while their
batch runs. Same fakes as test_batcher.py."""
from __future__ import annotations

import asyncio
import gc
import logging
import threading

import pytest

from tests.service.test_batcher import (  # noqa: F401 - `make` is a fixture
    LONG_MS,
    FakeClock,
    FakeRunBatch,
    gather5,
    make,
    settle,
    spawn,
)

pytestmark = pytest.mark.timeout(30)


async def test_per_group_full_batches_of_one_group_run_back_to_back(make):  # noqa: F811
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


async def test_a_row_cancelled_as_its_batch_forms_does_not_split_the_batch(make):  # noqa: F811
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


async def test_rows_withdrawn_while_their_batch_runs_leave_no_unretrieved_error(make, caplog):  # noqa: F811
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


async def test_close_after_the_batching_task_was_cancelled_fails_the_rows_left_queued(make):  # noqa: F811
    # The event loop cancels every task when it shuts down; rows queued at that moment must
    # still be answered when the batcher is closed, not left hanging.
    fake = FakeRunBatch(hold=True)
    b = make(fake, max_batch_size=1)
    running = spawn(b.submit("p0", group="a"))
    await fake.entered()
    queued = spawn(b.submit("p1", group="a"))
    await settle()
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
