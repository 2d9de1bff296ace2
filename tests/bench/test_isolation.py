"""The isolation section's pure parts on made-up numbers: B's statistics per phase, the targets
(PASS and FAIL, one per attack and statistic), the table; what counts as a failure of A's
outcome (`Attack.failures`) and the memory bound from the settings. The attacks against a real
server: tests/hostile."""
from __future__ import annotations

import json

import pytest

from bench.hostile.attacks import ATTACKS, BY_NAME, Outcome
from bench.hostile.common import label_of
from bench.hostile.world import (
    DECODE_BYTES_PER_PIXEL,
    MIB,
    SERVER_OPTIONS,
    Sample,
    rss_bound,
)
from bench.report import evaluate_targets
from bench.sections import isolation
from bench.sections.base import FAIL, PASS
from bench.sections.isolation import IsolationResult, victim_stats
from service.core.errors import HEAD_TIMEOUT_ERROR
from tests.bench.helpers import passing_results


def _targets(data: dict) -> dict:
    results = passing_results()
    results["isolation"] = data
    return {t.key: t for t in evaluate_targets(results, {"isolation"})
            if t.section == "isolation"}


def test_every_attack_has_a_p50_and_a_p99_target_and_all_pass_within_the_limits():
    targets = _targets(passing_results()["isolation"])
    for attack in ATTACKS:
        for stat in ("p50", "p99"):
            assert targets[f"isolation_{attack.name}_{stat}"].status == PASS
    for key in ("isolation_b_non_200", "isolation_a_unexpected", "isolation_rss"):
        assert targets[key].status == PASS, targets[key]


@pytest.mark.parametrize("stat, under, ok", [
    ("p50", 60.0, True), ("p50", 60.1, False),  # 1.5 x 40 ms alone
    ("p99", 240.0, True), ("p99", 240.5, False),  # 3 x 80 ms alone
])
def test_b_latency_targets_are_ratios_to_b_alone(stat, under, ok):
    data = passing_results()["isolation"]
    data["attacks"]["flood"]["b"][f"{stat}_ms"] = under
    t = _targets(data)[f"isolation_flood_{stat}"]
    assert t.status == (PASS if ok else FAIL) and t.measured == pytest.approx(under / {
        "p50": 40.0, "p99": 80.0}[stat])


def test_one_refusal_of_b_one_unexpected_answer_of_a_or_rss_over_its_bound_fails():
    data = passing_results()["isolation"]
    data["attacks"]["grpc"]["b"]["statuses"] = {"200": 99, "503 overloaded": 1}
    data["attacks"]["flood"]["failures"] = ["A got 503 overloaded x 3"]
    data["attacks"]["decode_bomb"]["rss_peak"] = 4_000_000_001
    t = _targets(data)
    assert t["isolation_b_non_200"].status == FAIL and t["isolation_b_non_200"].measured == 1
    assert t["isolation_a_unexpected"].status == FAIL
    assert t["isolation_rss"].status == FAIL


def test_a_section_that_did_not_run_fails_its_targets_and_a_left_out_attack_has_none():
    t = _targets({})
    assert t["isolation_flood_p50"].status == FAIL and t["isolation_b_non_200"].status == FAIL
    data = passing_results()["isolation"]
    del data["attacks"]["grpc"]
    data["left_out"] = {"grpc": "not installed: grpc (the grpc extra)"}
    t = _targets(data)
    assert "isolation_grpc_p50" not in t and t["isolation_flood_p50"].status == PASS


def test_the_table_has_a_row_per_attack_and_says_what_went_wrong():
    data = passing_results()["isolation"]
    data["attacks"]["websockets"]["b"]["statuses"] = {"200": 9, "503 overloaded": 2}
    text = isolation.render(IsolationResult.from_json(data), {})
    assert "| attack | A's answers | B's requests | B non-200 | B p50 alone ms |" in text
    for attack in ATTACKS:
        assert f"| {attack.name} | 429 rate_limited × 5 |" in text
    assert "- `websockets`: B got 503 overloaded × 2" in text


def test_victim_stats_count_statuses_by_code_and_time_every_request():
    samples = [Sample(0.0, 0.010, 200), Sample(0.1, 0.030, 200),
               Sample(0.2, 0.020, 503, '{"error": "busy", "code": "overloaded"}'),
               Sample(0.3, 0.001, 0, "ClientConnectorError")]
    stats = victim_stats(samples)
    assert stats["requests"] == 4 and isolation.non_200(stats) == 2
    assert stats["statuses"] == {"0 ClientConnectorError": 1, "200": 2, "503 overloaded": 1}
    assert stats["p50_ms"] == pytest.approx(15.0)


def test_a_failures_are_answers_outside_the_allowed_ones_and_defences_never_reached():
    flood = BY_NAME["flood"]
    good = Outcome()
    good.add("200", 3)
    good.add("429 rate_limited", 7)
    assert flood.failures(good) == []
    bad = Outcome()
    bad.add("200", 3)
    bad.add("503 overloaded")
    assert flood.failures(bad) == [
        "A got 503 overloaded x 1",
        "A never got any of ['429 queue_share', '429 rate_limited']"]
    bad.violations.append("a leak")
    assert flood.failures(bad)[-1] == "a leak"
    # A bare status allows every code of it.
    bomb = Outcome()
    bomb.add("400 invalid_image")
    assert BY_NAME["decode_bomb"].failures(bomb) == []


class _Answer:
    def __init__(self, status: int, body: dict) -> None:
        self.status, self._body = status, json.dumps(body).encode()

    async def read(self) -> bytes:
        return self._body


async def test_a_late_head_is_labelled_apart_from_a_late_body_and_only_it_is_allowed_a_flood():
    # The two 408s of the server (tests/service/transports/test_slow_clients.py checks their
    # "error"): A's full-speed bodies may meet the header timeout when A's own client is slow
    # (seen in CI), never a body timeout.
    head = await label_of(_Answer(408, {"error": HEAD_TIMEOUT_ERROR, "code": "request_timeout"}))
    body = await label_of(_Answer(408, {"error": "request body too slow: 0 bytes in 1 s",
                                        "code": "request_timeout"}))
    assert (head, body) == ("408 request_timeout head", "408 request_timeout")
    assert await label_of(_Answer(429, {"error": "x", "code": "rate_limited"})) == \
        "429 rate_limited"
    attack = BY_NAME["inflight_bytes"]
    for label, failures in ((head, []), (body, ["A got 408 request_timeout x 1"])):
        outcome = Outcome()
        outcome.add("429 rate_limited")
        outcome.add(label)
        assert attack.failures(outcome) == failures


def test_the_memory_bound_is_idle_plus_the_settings_budgets():
    options = {**SERVER_OPTIONS, "max-image-pixels": 1000, "preprocess-threads": 3,
               "heads-memory-mb": 10}
    assert rss_bound(5, options) == (5 + SERVER_OPTIONS["max-inflight-bytes"]
                                     + (1 + 3) * 1000 * DECODE_BYTES_PER_PIXEL + 10 * MIB)
    # The heavy lane's one image of max-image-pixels; the ordinary threads' at most cost 8.
    big = {**options, "max-image-pixels": 40_000_000}
    assert rss_bound(0, big) == (SERVER_OPTIONS["max-inflight-bytes"] + 10 * MIB
                                 + (40_000_000 + 3 * 8 * 640 * 480 * 3) * DECODE_BYTES_PER_PIXEL)


class _SlowVictim:
    """B's loop whose first request, sent before the phase, outlasts it; then quick ones."""

    def __init__(self, phase_s: float) -> None:
        import threading
        import time

        self.samples: list[Sample] = []
        first = time.perf_counter() - 0.01

        def loop():
            time.sleep(phase_s + 0.1)  # the first request spans the whole phase
            self.samples.append(Sample(first, time.perf_counter() - first, 200))
            while len(self.samples) < 6:
                sent = time.perf_counter()
                time.sleep(0.05)
                self.samples.append(Sample(sent, 0.05, 200))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def last_image(self) -> bytes:
        return b""

    def sent_in(self, start: float, end: float) -> list[Sample]:
        return [s for s in list(self.samples) if start <= s.start < end]

    def answered_after(self, moment: float, timeout_s: float) -> None:
        import time

        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.samples and self.samples[-1].start >= moment:
                return
            time.sleep(0.01)


def test_a_phase_that_one_slow_request_spans_runs_on_until_it_holds_one():
    import os
    from types import SimpleNamespace

    from bench.hostile.world import run_phase

    phase = run_phase(SimpleNamespace(pid=os.getpid(), b_last=None), _SlowVictim(0.3), "alone",
                      0.3, drain_s=5.0)
    assert phase.samples and {s.status for s in phase.samples} == {200}
    assert phase.seconds > 0.3
