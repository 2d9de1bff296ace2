"""Memory given back after a burst of large bodies: `ByteBudget` notices the end of a burst,
`Trimmer` runs malloc_trim at most once per interval (fake clock, timers run inline)."""
from __future__ import annotations

import gc
import time

import pytest

from service.core import memory
from service.core.admission import ByteBudget

MB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Starts:
    """Records the delays asked for; runs each at once unless `hold`."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.held: list = []
        self.hold = False

    def __call__(self, delay, run) -> None:
        self.delays.append(delay)
        if self.hold:
            self.held.append(run)
        else:
            run()


def test_a_burst_ends_when_the_bytes_in_flight_fall_from_their_peak():
    ends = []
    budget = ByteBudget(1000 * MB, on_burst_end=lambda: ends.append(budget.used_bytes),
                        burst_bytes=32 * MB)
    for _ in range(10):  # a burst: 10 bodies of 10 MB in flight at once
        budget.reserve(10 * MB)
    for _ in range(5):  # 10..40 MB freed: not yet half the peak; 50 MB freed: half
        budget.release(10 * MB)
    assert ends == [50 * MB]  # 50 MB freed, half the peak left: the burst is over
    for _ in range(5):
        budget.release(10 * MB)
    # 40 MB freed from the new peak (50): over again. What stays untrimmed is less than
    # `burst_bytes` (the last 10 MB), until the next burst.
    assert ends == [50 * MB, 10 * MB] and budget.used_bytes == 0
    # Small traffic never calls it: never 32 MB below a peak.
    for _ in range(100):
        budget.reserve(3 * MB)
        budget.release(3 * MB)
    assert ends == [50 * MB, 10 * MB]


def test_steady_large_traffic_is_no_burst_end():
    ends = []
    budget = ByteBudget(1000 * MB, on_burst_end=lambda: ends.append(1), burst_bytes=32 * MB)
    for _ in range(8):
        budget.reserve(10 * MB)  # 80 MB in flight, steadily
    for _ in range(50):
        budget.release(10 * MB)
        budget.reserve(10 * MB)
    assert ends == []


def test_the_trimmer_runs_at_most_once_per_interval_and_never_drops_a_request():
    clock, starts, trims = Clock(), Starts(), []
    trimmer = memory.Trimmer(lambda: trims.append(clock.now), interval_s=1.0, clock=clock,
                             start=starts)
    assert trimmer() and trims == [100.0] and starts.delays == [0.0]
    clock.now = 100.25
    starts.hold = True
    assert trimmer()  # within the interval: it waits for the rest of it
    assert starts.delays[-1] == pytest.approx(0.75)
    assert not trimmer()  # one is pending: asking again adds nothing
    clock.now = 101.0
    starts.held.pop()()
    assert trims == [100.0, 101.0] and trimmer.trims == 2
    clock.now = 105.0
    starts.hold = False
    assert trimmer() and starts.delays[-1] == 0.0 and trims[-1] == 105.0


def test_a_failing_trim_is_logged_and_the_next_one_still_runs(caplog):
    calls = []

    def trim():
        calls.append(1)
        raise OSError("no")

    clock = Clock()
    trimmer = memory.Trimmer(trim, clock=clock, start=Starts())
    assert trimmer()
    clock.now += 5
    assert trimmer() and len(calls) == 2
    assert "malloc_trim failed" in caplog.text


def test_without_glibc_there_is_nothing_to_trim():
    assert memory.Trimmer(None)() is False


def test_the_real_malloc_trim_runs_here():
    trim = memory._malloc_trim()  # glibc on the machines this runs on (Debian)
    assert trim is not None
    assert trim() in (0, 1)
    done = memory.Trimmer(interval_s=0.0)
    assert done()
    for _ in range(200):
        if done.trims:
            break
        time.sleep(0.01)
    assert done.trims == 1


async def test_a_service_gives_back_its_build_garbage_once_ready_and_trims_after_bursts(
        tmp_path):
    from service.core.service import Service
    from tests.support.fakes import FakeTrunk
    from tests.support.servers import make_settings

    service = Service(make_settings(tmp_path, max_inflight_bytes=200 * MB), trunk=FakeTrunk())
    asked = []
    service.trimmer = lambda: asked.append(service.readiness.status)
    service.inflight._on_burst_end = service.trimmer  # noqa: SLF001 - the same trimmer
    await service.start()
    assert await service.wait_ready()
    assert asked == ["ready"]  # once, when ready
    assert gc.get_freeze_count() == 0  # only `multihead serve` freezes (one service a process)
    service.inflight.reserve(100 * MB)
    service.inflight.release(100 * MB)
    assert asked == ["ready", "ready"]  # after a burst
    await service.close()
    fresh = Service(make_settings(tmp_path))  # as built: one real Trimmer for both
    frozen = Service(make_settings(tmp_path), trunk=FakeTrunk())
    frozen.trimmer = lambda: None
    frozen.freeze_gc_when_ready = True  # as run_app sets it
    try:
        await frozen.start()
        assert await frozen.wait_ready()
        assert gc.get_freeze_count() > 0  # what was alive once ready: out of gen 2's scans
    finally:
        gc.unfreeze()
        await frozen.close()
    assert isinstance(fresh.trimmer, memory.Trimmer)
    assert fresh.inflight._on_burst_end is fresh.trimmer  # noqa: SLF001
