"""The fairness section's bookkeeping on constructed calls: the windows of its statistics, the
quota's rate estimate against the service's own token bucket (`service.core.quota.Quotas`, on
a fake clock), where the raw trunk's batch time comes from, its targets (PASS and FAIL) and its
Markdown. The load drivers against a real server: tests/bench/test_sections.py."""
from __future__ import annotations

import random

import pytest

from bench.report import evaluate_targets, render_markdown
from bench.sections import fairness, fairness_load
from bench.sections.base import FAIL, PASS
from bench.sections.fairness import FairnessResult, quota_rate
from bench.sections.fairness_load import LIMITED, NOISY, Call, ImagePool
from bench.sections.fairness_numbers import (
    batch_rates,
    bucket_level,
    call_stats,
    flood_summary,
    quota_summary,
    raw_batch,
)
from service.core.errors import RateLimited, retry_after_header
from service.core.quota import Quotas
from tests.bench.helpers import passing_results


def _targets(data: dict) -> dict:
    results = passing_results()
    results["fairness"] = data
    return {t.key: t for t in evaluate_targets(results, {"fairness"})
            if t.section == "fairness"}


# -- statistics over a window -------------------------------------------------------------------


def test_latency_counts_requests_sent_in_the_window_and_rate_those_answered_in_it():
    calls = [Call("a", 0.5, 1.5, 200),  # sent before the window: no latency, answered in it
             Call("a", 1.0, 2.0, 200),  # sent at its start: counted
             Call("a", 2.0, 5.0, 200, images=4),  # answered after its end: latency only
             Call("a", 3.0, 3.5, 429, "rate_limited", 2.0),
             Call("a", 4.0, 4.2, 200)]  # sent at its end: not counted
    stats = call_stats(calls, 1.0, 4.0)
    assert stats["requests"] == 3 and stats["answered"] == 2
    assert stats["p50_ms"] == pytest.approx(2000.0) and stats["max_ms"] == pytest.approx(3000.0)
    assert stats["images_per_s"] == pytest.approx(2 / 3.0)  # answered at 1.5 and 2.0
    assert stats["statuses"] == {"200": 2, "429 rate_limited": 1}


def test_the_image_pool_hands_out_distinct_images_in_turn():
    pool = ImagePool([b"a", b"b", b"c"])
    assert pool.take(2) == [b"a", b"b"] and pool.take(1) == [b"c"]
    assert pool.take(4) == [b"a", b"b", b"c", b"a"]
    with pytest.raises(ValueError):
        ImagePool([])


METRICS_BEFORE = """\
# TYPE multihead_tenant_images_total counter
multihead_tenant_images_total{tenant="noisy"} 10.0
multihead_tenant_images_total{tenant="quiet-1"} 1.0
# TYPE multihead_tenant_refusals_total counter
multihead_tenant_refusals_total{code="queue_share",tenant="noisy"} 2.0
# TYPE multihead_batch_size histogram
multihead_batch_size_bucket{le="1.0"} 0.0
multihead_batch_size_bucket{le="16.0"} 2.0
multihead_batch_size_bucket{le="+Inf"} 2.0
multihead_batch_size_count 2.0
multihead_batch_size_sum 20.0
"""

METRICS_AFTER = """\
# TYPE multihead_tenant_images_total counter
multihead_tenant_images_total{tenant="noisy"} 40.0
multihead_tenant_images_total{tenant="quiet-1"} 3.0
multihead_tenant_images_total{tenant="quiet-2"} 2.0
# TYPE multihead_tenant_refusals_total counter
multihead_tenant_refusals_total{code="queue_share",tenant="noisy"} 2.0
# TYPE multihead_batch_size histogram
multihead_batch_size_bucket{le="1.0"} 0.0
multihead_batch_size_bucket{le="16.0"} 4.0
multihead_batch_size_bucket{le="+Inf"} 4.0
multihead_batch_size_count 4.0
multihead_batch_size_sum 54.0
# TYPE multihead_trunk_seconds histogram
multihead_trunk_seconds_bucket{le="+Inf"} 2.0
multihead_trunk_seconds_count 2.0
multihead_trunk_seconds_sum 2.0
"""


def _batches(ends, noisy_per_batch=6):
    """Answers of trunk batches ending at `ends`: `noisy_per_batch` noisy ones sent 3 s before,
    and quiet-k's sent k/2 s before (k = 1, 2, 3), a millisecond apart."""
    calls = []
    for end in ends:
        calls += [Call(NOISY, end - 3.0, end + 0.001 * j, 200) for j in range(noisy_per_batch)]
        calls += [Call(q, end - 0.5 * k, end + 0.002, 200)
                  for k, q in enumerate(fairness_load.QUIET, start=1)]
    return calls


def test_a_flood_summary_has_each_tenant_the_quiet_ones_pooled_and_the_servers_numbers():
    data = {"window": (1.0, 4.0), "calls": _batches([0.5, 1.5, 2.5, 3.5, 4.5]),
            "before": METRICS_BEFORE, "after": METRICS_AFTER}
    clients = {NOISY: 18, **dict.fromkeys(fairness_load.QUIET, 1)}
    summary = flood_summary(data, clients)
    noisy = summary["tenants"][NOISY]
    assert noisy["clients"] == 18 and noisy["requests"] == 6  # those sent at 1.5
    assert noisy["p50_ms"] == pytest.approx(3002.5)  # ends 1 ms apart
    # Sent in [1, 4): quiet-1 at 1, 2, 3 (502 ms); quiet-2 at 1.5, 2.5, 3.5 (1,002 ms);
    # quiet-3 at 1, 2, 3 (1,502 ms).
    assert summary["quiet"]["requests"] == 9
    assert summary["quiet"]["p50_ms"] == pytest.approx(1002.0)
    # Batches answered at 1.5, 2.5 and 3.5 in the window: the two after the first over 2 s.
    assert summary["measured_s"] == pytest.approx(2.0)
    assert noisy["images_per_s"] == pytest.approx(6.0)
    assert summary["tenants"]["quiet-2"]["images_per_s"] == pytest.approx(1.0)
    assert summary["quiet"]["images_per_s"] == pytest.approx(3.0)
    assert summary["total_images_per_s"] == pytest.approx(9.0)
    assert summary["batches"] == 2 and summary["mean_batch_size"] == pytest.approx(17.0)
    assert summary["server_trunk_ms"] == pytest.approx(1000.0)
    assert summary["server_heads_ms"] is None  # not in the scrape
    assert summary["served"] == {"noisy": 30.0, "quiet-1": 2.0, "quiet-2": 2.0}
    assert summary["refused"] == {}  # unchanged over the window
    # Without the server's trunk time, batches are not told apart: over the whole window.
    summary = flood_summary({**data, "after": ""}, clients)
    assert summary["measured_s"] == pytest.approx(3.0)
    assert summary["total_images_per_s"] == pytest.approx(27 / 3.0)  # at 1.5, 2.5, 3.5


def test_answers_are_rated_from_the_first_batch_to_the_last_not_over_the_window():
    calls = _batches([0.9, 1.9, 2.9, 3.9])  # 9 images a second, the window (0.5, 4.0]
    plain = call_stats(calls, 0.5, 4.0)
    assert plain["answered_images"] == 36 and plain["images_per_s"] == pytest.approx(36 / 3.5)
    rates, span = batch_rates(calls, 0.5, 4.0, gap_s=0.5)
    assert span == pytest.approx(3.0) and sum(rates.values()) == pytest.approx(9.0)
    assert rates[NOISY] == pytest.approx(6.0)
    # A gap that joins every batch into one, or a single batch: nothing to rate.
    assert batch_rates(calls, 0.5, 4.0, gap_s=5.0) == ({}, None)
    assert batch_rates(calls, 0.5, 1.5, gap_s=0.5) == ({}, None)


# -- the quota ----------------------------------------------------------------------------------


def test_the_bucket_level_a_retry_after_implies_holds_the_true_one():
    rng = random.Random(0)
    for _ in range(2000):
        rate, need = rng.choice([0.5, 1.0, 1.5, 3.0, 8.0, 20.0]), rng.choice([1, 4, 16])
        level = rng.uniform(0, need) * 0.999999
        retry_after = float(retry_after_header((need - level) / rate))
        estimate = bucket_level(retry_after, rate, need)
        # The true level is within half the interval the header leaves: min(need, rate) wide.
        assert abs(estimate - level) <= min(need, rate) / 2 + 1e-9, (rate, need, level)


def _simulate(true_rate: float, told_rate: float, seconds: float, latency_s: float = 0.3,
              burst: int = 16, images: int = 4, honour: float = 1.0) -> tuple[list, float]:
    """One client against the service's token bucket (fake clock): `images` per request, each
    answered after `latency_s`; on a refusal it sleeps `honour` x Retry-After and sends the same
    request again. Returns (calls, first 429's time) for `quota_summary` at `told_rate`."""
    clock = [0.0]
    quotas = Quotas(lambda tenant: (true_rate, burst), clock=lambda: clock[0])
    calls, first, retry = [], None, False
    while clock[0] < seconds:
        start = clock[0]
        try:
            quotas.take(LIMITED, images)
        except RateLimited as exc:
            retry_after = float(retry_after_header(exc.retry_after_s))
            calls.append(Call(LIMITED, start, start + 0.01, 429, "rate_limited", retry_after,
                              images, retry))
            first = start if first is None else first
            clock[0] = start + 0.01 + honour * retry_after
            retry = True
            continue
        clock[0] = start + latency_s
        calls.append(Call(LIMITED, start, clock[0], 200, images=images, retry=retry))
        retry = False
    return calls, first


@pytest.mark.parametrize("rate", [0.7, 1.5, 2.0, 4.0, 8.0])
def test_a_client_honouring_retry_after_gets_the_rate_and_is_never_refused_twice(rate):
    calls, first = _simulate(rate, rate, 60.0)
    summary = quota_summary(calls, first, rate, 16, 4, 20.0)
    assert summary["refusals"] > 0 and summary["refusals_improper"] == 0
    # Every refusal is of a new request, and its retry (but maybe the last) is accepted.
    assert summary["refusals"] - 1 <= summary["retries"] <= summary["refusals"]
    assert summary["retries_refused"] == 0
    # Off by at most the two levels' half-intervals over the measured span (the module doc).
    error = abs(summary["accepted_images_per_s"] - rate) * summary["measured_span_s"]
    assert error <= min(4, rate) + 1e-9
    # The plain count is what the bucket allowed too, give or take a request and a second.
    assert abs(summary["accepted_images"] - 20.0 * rate) <= 4 + rate + 1e-9
    assert summary["statuses"]["429 rate_limited"] == summary["refusals"]
    targets = _targets({**passing_results()["fairness"],
                        "quota": {**summary, "capacity_images_per_s": 40.0}})
    assert targets["quota_rate"].status == PASS and targets["quota_retry_after"].status == PASS


def test_a_bucket_faster_than_its_rate_fails_the_rate_target():
    calls, first = _simulate(2.6, 2.0, 60.0)  # 30 % over what the tenant was told
    summary = quota_summary(calls, first, 2.0, 16, 4, 20.0)
    assert summary["accepted_images_per_s"] == pytest.approx(2.6, rel=0.05)
    targets = _targets({**passing_results()["fairness"], "quota": summary})
    assert targets["quota_rate"].status == FAIL
    assert targets["quota_rate"].measured == pytest.approx(0.3, abs=0.05)


def test_a_retry_before_its_retry_after_is_refused_again_and_counted():
    calls, first = _simulate(2.0, 2.0, 40.0, honour=0.3)
    summary = quota_summary(calls, first, 2.0, 16, 4, 20.0)
    assert summary["retries_refused"] > 0
    targets = _targets({**passing_results()["fairness"], "quota": summary})
    assert targets["quota_retry_after"].status == FAIL
    assert targets["quota_retry_after"].measured == summary["retries_refused"]


def test_refusals_without_retry_after_or_of_another_code_are_improper():
    calls = [Call(LIMITED, 0.0, 0.1, 200, images=4),
             Call(LIMITED, 1.0, 1.1, 429, "rate_limited", 1.0, 4),
             Call(LIMITED, 2.1, 2.2, 200, images=4, retry=True),
             Call(LIMITED, 3.0, 3.1, 429, "rate_limited", None, 4),
             Call(LIMITED, 4.1, 4.2, 503, "overloaded", 1.0, 4),
             Call(LIMITED, 5.2, 5.3, -1, "ClientOSError", None, 4, retry=True),
             Call("quiet-1", 1.0, 9.0, 503, "overloaded", None)]  # not the limited tenant's
    summary = quota_summary(calls, 1.0, 4.0, 16, 4, 20.0)
    assert summary["refusals"] == 4 and summary["refusals_improper"] == 3
    assert summary["retries"] == 2 and summary["retries_refused"] == 1
    assert summary["accepted_images"] == 4  # from the first 429 on
    assert "accepted_images_per_s" not in summary  # one proper refusal: no span to measure
    targets = _targets({**passing_results()["fairness"], "quota": summary})
    assert targets["quota_retry_after"].measured == 4  # 3 improper + 1 retry refused
    assert targets["quota_retry_after"].status == FAIL
    assert targets["quota_rate"].status == FAIL and targets["quota_rate"].measured is None


def test_a_quota_that_never_refused_was_not_exercised():
    summary = quota_summary([Call(LIMITED, 0.0, 0.1, 200, images=4)], None, 2.0, 16, 4, 20.0)
    assert summary["refusals"] == 0 and "accepted_images" not in summary
    targets = _targets({**passing_results()["fairness"], "quota": summary})
    for key in ("quota_rate", "quota_retry_after"):
        assert targets[key].status == FAIL and targets[key].measured is None


def test_the_rate_is_a_quarter_of_the_fair_capacity_at_most_8():
    result = FairnessResult(runs={"fair": {"total_images_per_s": 6.0},
                                  "fifo": {"total_images_per_s": 7.0}})
    assert quota_rate(result) == (1.5, 6.0)
    assert quota_rate(FairnessResult(runs={"fair": {"total_images_per_s": 100.0}})) == (8.0,
                                                                                       100.0)
    assert quota_rate(FairnessResult(runs={"fifo": {"total_images_per_s": 4.0}})) == (1.0, 4.0)
    assert quota_rate(FairnessResult()) == (0.5, None)


# -- the raw trunk ------------------------------------------------------------------------------


class _Trunk:
    runtimes = {"openvino-fp32": {"batches": [
        {"batch_size": 1, "median_s": 0.2, "images_per_s": 5.0},
        {"batch_size": 16, "median_s": 2.0, "images_per_s": 8.0}]}}


class _Service:
    raw_trunk = {"name": "openvino-fp32", "batch_size": 16, "images_per_s": 6.4}


def test_the_raw_batch_comes_from_the_trunk_section_then_the_service_then_a_measure():
    measured = []

    def measure(name, size):
        measured.append((name, size))
        return {"median_s": 3.0, "images_per_s": size / 3.0}

    raw = raw_batch("openvino-fp32", 16, _Trunk(), _Service(), measure)
    assert (raw["batch_s"], raw["source"]) == (2.0, "trunk section") and not measured
    raw = raw_batch("openvino-fp32", 16, None, _Service(), measure)
    assert raw["batch_s"] == pytest.approx(2.5) and raw["source"] == "service section"
    raw = raw_batch("openvino-fp32", 8, _Trunk(), _Service(), measure)  # neither has batch 8
    assert raw["batch_s"] == 3.0 and measured == [("openvino-fp32", 8)]
    raw = raw_batch("tf-fp32", 16, _Trunk(), _Service(), measure)  # another runtime
    assert raw["source"] == "measured in the fairness section"


# -- targets and report -------------------------------------------------------------------------


def test_the_targets_carry_this_runs_ratios():
    t = _targets(passing_results()["fairness"])
    assert {k: v.status for k, v in t.items()} == dict.fromkeys(
        ["fair_quiet_p50", "fair_quiet_vs_batch", "fair_throughput", "quota_rate",
         "quota_retry_after"], PASS)
    assert t["fair_quiet_p50"].measured == pytest.approx(5200 / 11800)
    assert t["fair_quiet_p50"].note == "fair 5200 ms vs fifo 11800 ms"
    assert t["fair_quiet_vs_batch"].measured == pytest.approx(5200 / 2500)
    assert "raw openvino-fp32 batch of 16 2500 ms" in t["fair_quiet_vs_batch"].note
    assert t["fair_throughput"].measured == pytest.approx(6.1 / 6.2)
    assert t["quota_rate"].measured == pytest.approx(abs(1.47 / 1.5 - 1))
    assert t["quota_retry_after"].measured == 0


def test_a_missing_scheduler_run_fails_its_comparisons():
    data = passing_results()["fairness"]
    del data["runs"]["fifo"]
    t = _targets(data)
    assert t["fair_quiet_p50"].status == FAIL and t["fair_quiet_p50"].measured is None
    assert t["fair_throughput"].status == FAIL
    assert t["fair_quiet_vs_batch"].status == PASS  # fair and the raw batch are there
    data["raw_trunk"] = None
    assert _targets(data)["fair_quiet_vs_batch"].status == FAIL


def test_the_report_has_a_table_per_scenario():
    md = render_markdown(passing_results())
    assert "## Fair sharing between tenants (openvino-fp32" in md
    assert "| fair | noisy | 48 | 160 | 5.5 | 8,100 |" in md
    assert "| fifo | quiet-1 | 1 | 6 | 0.1 | 11,810 |" in md
    assert "| fair | 6.1 | 5,200 | 6,760 | 8,100 | 15.9 | 2,600 | 4.5 | 2 |" in md
    assert "| fifo | 6.2 | 11,800 | 15,340 | 7,800 | 15.9 | 2,600 | 4.5 | 4.54 |" in md
    assert "one batch of 16: 2,500 ms (6.4 images/s; from the fairness section)" in md
    assert ("| 1.5 | 32 | 1.6 | 1.47 | 0.98 | 200: 12, 429 rate_limited: 9 | 2: 7, 3: 2 | 0 | "
            "0 | 1,900 |") in md


def test_an_empty_result_renders_a_header_only():
    md = fairness.render(FairnessResult(), {})
    assert md.startswith("## Fair sharing between tenants") and "Quota" not in md
