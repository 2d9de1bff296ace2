"""The deadlines section's bookkeeping: the bursty trace it sends, what it counts of the calls
(admitted, within the deadline, late, goodput), its targets (PASS and FAIL) and its Markdown.
The section against a real server: `multihead bench --sections deadlines`."""
from __future__ import annotations

import numpy as np
import pytest

from bench.report import evaluate_targets, render_markdown
from bench.sections.base import FAIL, PASS
from bench.sections.deadlines_load import tenant_summary, trace, trace_summary
from bench.sections.fairness_load import Call
from bench.stats import bursty_arrivals
from tests.bench.helpers import passing_results


def _targets(data: dict) -> dict:
    results = passing_results()
    results["deadlines"] = data
    return {t.key: t for t in evaluate_targets(results, {"deadlines"})
            if t.section == "deadlines"}


def test_bursty_arrivals_have_the_mean_rate_and_ten_times_it_in_bursts():
    """Over a long trace the count is the rate x the duration; inside the bursts the arrivals
    come 10 x as fast as outside; the same seed gives the same trace."""
    arrivals, bursts = bursty_arrivals(20.0, 3000.0, factor=10, burst_s=0.3, gap_s=3.0, seed=4)
    assert len(arrivals) == pytest.approx(60_000, rel=0.03)
    assert np.all(np.diff(arrivals) >= 0) and arrivals[0] >= 0 and arrivals[-1] <= 3000
    in_burst = sum(((arrivals >= b) & (arrivals < e)).sum() for b, e in bursts)
    burst_s = sum(e - b for b, e in bursts)
    inside = in_burst / burst_s
    outside = (len(arrivals) - in_burst) / (3000.0 - burst_s)
    assert inside / outside == pytest.approx(10.0, rel=0.1)
    assert burst_s / 3000.0 == pytest.approx(0.3 / 3.3, rel=0.2)
    again, _ = bursty_arrivals(20.0, 3000.0, factor=10, burst_s=0.3, gap_s=3.0, seed=4)
    assert np.array_equal(arrivals, again)
    with pytest.raises(ValueError):
        bursty_arrivals(0.0, 10.0)


def test_the_trace_gives_each_arrival_a_tenant_at_the_share():
    schedule = trace(np.arange(10_000) / 100.0, ("fast", "slow"), 0.8, seed=1)
    assert [t for t, _ in schedule] == list(np.arange(10_000) / 100.0)
    assert sum(1 for _, tenant in schedule if tenant == "fast") == pytest.approx(8000, rel=0.03)


def test_a_tenants_calls_are_counted_against_its_deadline():
    """Latency from the scheduled time; a 504 deadline_unmeetable is refused at admission,
    every other answer was admitted; a 200 later than the deadline is late (the trunk's work
    for a row past it), not within; goodput is the answers within per second."""
    calls = [Call("i", 0.0, 0.10, 200), Call("i", 1.0, 1.16, 200),
             Call("i", 2.0, 2.001, 504, "deadline_unmeetable"),
             Call("i", 3.0, 3.2, 504, "deadline_exceeded"), Call("i", 4.0, 4.149, 200)]
    s = tenant_summary(calls, 150.0, 10.0)
    assert (s["sent"], s["refused_at_admission"], s["admitted"]) == (5, 1, 4)
    assert (s["answered"], s["within"], s["late"]) == (3, 2, 1)
    assert s["met_of_admitted"] == pytest.approx(0.5)
    assert s["goodput_per_s"] == pytest.approx(0.2)
    assert s["statuses"] == {"200": 3, "504 deadline_exceeded": 1,
                             "504 deadline_unmeetable": 1}
    both = trace_summary(calls + [Call("b", 0.0, 4.0, 200)], {"i": 150.0, "b": 5000.0}, 10.0,
                         {"i": 2.0}, {"i": 1.0})
    assert both["goodput_per_s"] == pytest.approx(0.3)
    assert (both["late"], both["trunk_rows_late"], both["trunk_rows_expired"],
            both["sent"]) == (1, 2.0, 1.0, 6)


def test_the_targets_pass_on_good_numbers_and_carry_this_runs_ratios():
    t = _targets(passing_results()["deadlines"])
    assert {k: v.status for k, v in t.items()} == dict.fromkeys(t, PASS)
    assert t["deadlines_quiet_vs_fifo"].measured == pytest.approx(0.06)
    assert t["deadlines_quiet_vs_alone"].measured == pytest.approx(3.0)
    assert t["deadlines_interactive_met"].measured == pytest.approx(0.99)
    assert t["deadlines_goodput"].measured == pytest.approx(1.6)
    assert t["deadlines_trunk_in_server"].measured == pytest.approx(1.05)
    assert t["deadlines_saturation"].measured == pytest.approx(0.96)


@pytest.mark.parametrize("change, key", [
    (lambda d: d["runs"]["deadline-aware"].update(trunk_rows_expired=1), "deadlines_expired"),
    (lambda d: d["runs"]["deadline-aware"].pop("trunk_rows_expired"), "deadlines_expired"),
    (lambda d: d["runs"]["deadline-aware"].update(goodput_per_s=20.0), "deadlines_goodput"),
    (lambda d: d["runs"]["deadline-aware"]["tenants"]["interactive"].update(
        met_of_admitted=0.98), "deadlines_interactive_met"),
    (lambda d: d["saturation"]["defaults"].update(total_images_per_s=65.0),
     "deadlines_saturation"),
    (lambda d: d["saturation"].pop("before the profile"), "deadlines_saturation"),
    (lambda d: d["floods"]["fair"]["quiet"].update(p50_ms=90.0), "deadlines_quiet_vs_alone"),
    (lambda d: d.pop("runs"), "deadlines_goodput"),
    (lambda d: d["floods"]["fifo"].update(server_trunk_ms=140.0), "deadlines_trunk_in_server"),
    (lambda d: d["floods"]["fifo"].update(mean_batch_size=7.5), "deadlines_trunk_in_server"),
    (lambda d: d.pop("alone_batch_ms"), "deadlines_trunk_in_server"),
])
def test_a_missed_target_fails(change, key):
    data = passing_results()["deadlines"]
    change(data)
    assert _targets(data)[key].status == FAIL


def test_the_report_has_the_flood_the_trace_and_goodput_tables(tmp_path):
    results = passing_results()
    text = render_markdown(results, evaluate_targets(results, {"deadlines"}))
    section = text[text.index("## Latency objectives"):]
    for expected in ("| fifo | 45", "| 105 | 1.05 |", "| fair | 48", "quiet p50 / alone",
                     "| deadline-aware | interactive | 800 | 300 | 500 | 495 |", "goodput /s",
                     "trunk rows run past deadline", "trunk rows ended past deadline",
                     "fair runs 1.07 x fifo's images/s",
                     "| defaults | 66 | 0.96 | 8 | 95 |", "| before the profile | 68.8 | 1 | 16 |"):
        assert expected in section, expected
