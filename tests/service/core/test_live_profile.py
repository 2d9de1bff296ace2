"""The trunk's time per batch as it runs in the server (`service.core.live_profile`), and the
batcher's deadline cut reading it rather than the times alone."""
from __future__ import annotations

import pytest

from service.core.live_profile import LiveProfile
from service.core.schedule import batch_pick


def alone(n: int) -> float:
    return 0.010 * n  # 10 ms an image alone


def test_live_batches_refresh_the_profile_and_sizes_not_run_follow_their_ratio():
    live = LiveProfile(alone, alpha=0.5)
    assert live.seconds(4) == pytest.approx(0.040)  # nothing run yet: the time alone
    live.observe(2, 0.030)  # 1.5 x alone here
    assert live.seconds(2) == pytest.approx(0.030)
    assert live.seconds(8) == pytest.approx(0.120)  # 80 ms alone x 1.5
    live.observe(2, 0.020)  # the newest weighs alpha
    assert live.seconds(2) == pytest.approx(0.025)
    live.observe(4, 0.080)  # 2 x alone
    assert live.seconds(8) == pytest.approx(0.080 * (1.25 + 2.0) / 2)
    for bad in ((0, 0.01), (3, 0.0), (3, float("nan"))):
        live.observe(*bad)  # ignored
    assert live.report() == {"2": 25.0, "4": 80.0}


def test_a_deadline_cut_reads_the_live_times():
    """A batch of 4 fits a 45 ms deadline at the times alone (40 ms) but not at the server's
    (1.5 x: 60 ms); the cut made from the live profile keeps 2 rows (30 ms)."""
    live = LiveProfile(alone)
    deadlines = [0.045, None, None, None]
    assert len(batch_pick(deadlines, 0.0, alone)) == 4
    live.observe(2, 0.030)
    assert len(batch_pick(deadlines, 0.0, live.seconds)) == 3  # 3 x 15 ms = 45 ms: just in time
    live.observe(3, 0.050)
    assert len(batch_pick(deadlines, 0.0, live.seconds)) == 2


def test_the_upper_time_is_the_mean_plus_deviations_and_follows_sizes_not_run():
    """`upper` (what deadlines read): a size run steadily stays at its mean; one whose runs
    spread gets UPPER_DEVIATIONS x its mean absolute deviation above; a size not run yet, its
    live time x (1 + that many times the relative deviation of the sizes run)."""
    from service.core.live_profile import UPPER_DEVIATIONS

    live = LiveProfile(alone, alpha=0.5)
    assert live.upper(2) == pytest.approx(0.020)  # nothing run: the time alone
    live.observe(2, 0.030)
    live.observe(2, 0.030)
    assert live.upper(2) == pytest.approx(0.030)  # steady: no spread
    live.observe(2, 0.050)  # mean 0.040, deviation 0.5 x |0.050 - 0.030| = 0.010
    assert live.seconds(2) == pytest.approx(0.040)
    assert live.upper(2) == pytest.approx(0.040 + UPPER_DEVIATIONS * 0.010)
    assert live.upper(4) == pytest.approx(live.seconds(4) * (1 + UPPER_DEVIATIONS * 0.25))


def test_the_last_batchs_trunk_time_is_read_once():
    """`took`: the seconds of the batch observed last, once; None before any and after it was
    read (a batch whose rows were all cached runs no trunk and observes nothing)."""
    live = LiveProfile(lambda n: 0.01 * n)
    assert live.took() is None
    live.observe(4, 0.05)
    assert live.took() == 0.05
    assert live.took() is None
    live.observe(0, 0.05)  # not a batch
    assert live.took() is None


def test_a_size_run_a_few_times_has_at_least_the_spread_the_sizes_run_more_showed():
    """A size run fewer than FEW_RUNS times has not shown its spread: its upper time is at
    least its mean x (1 + UPPER_DEVIATIONS x the relative deviation of the sizes run more);
    before, a size run once had no margin at all (its one run was its upper time)."""
    from service.core.live_profile import FEW_RUNS

    live = LiveProfile(alone, alpha=0.5)
    for i in range(FEW_RUNS):
        live.observe(2, 0.030 if i % 2 else 0.050)
    relative = live.upper(2) / live.seconds(2) - 1
    assert relative > 0
    live.observe(6, 0.090)  # once
    assert live.upper(6) == pytest.approx(0.090 * (1 + relative))
    for _ in range(FEW_RUNS):  # steady from now on: its own spread, none
        live.observe(6, 0.090)
    assert live.upper(6) == pytest.approx(0.090)
