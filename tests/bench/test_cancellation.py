"""The cancellation section's bookkeeping on constructed calls and /metrics texts: the window
of its statistics (goodput charged to when requests were sent), the give-ups against the
server's 499s, its targets (PASS and FAIL) and its Markdown. An impatient client against a real
server (its timeout closes the connection; a 499 only where the server cancels):
tests/bench/test_sections.py."""
from __future__ import annotations

import pytest

from bench.report import evaluate_targets, render_markdown
from bench.sections import cancellation
from bench.sections.base import FAIL, PASS
from bench.sections.cancellation import (
    IMPATIENT,
    MEDIAN_SCENARIO,
    PATIENT,
    SCENARIOS,
    SERVERS,
    CancellationResult,
    gave_up,
    load_summary,
    rows_for_nobody,
    statuses,
    uncounted_give_ups,
)
from bench.sections.fairness import Call
from tests.bench.helpers import passing_results


def _targets(data: dict) -> dict:
    results = passing_results()
    results["cancellation"] = data
    return {t.key: t for t in evaluate_targets(results, {"cancellation"})
            if t.section == "cancellation"}


def _metrics(requests: dict[str, int], batches: int = 0, rows: int = 0,
             trunk_s: float = 0.0) -> str:
    lines = ["# TYPE multihead_requests_total counter"]
    lines += [f'multihead_requests_total{{route="{route}",status="{status}"}} {n}.0'
              for (route, status), n in ((k.split(" "), v) for k, v in requests.items())]
    lines += ["# TYPE multihead_batch_size histogram",
              f'multihead_batch_size_bucket{{le="+Inf"}} {batches}.0',
              f"multihead_batch_size_count {batches}.0", f"multihead_batch_size_sum {rows}.0",
              "# TYPE multihead_trunk_seconds histogram",
              f'multihead_trunk_seconds_bucket{{le="+Inf"}} {batches}.0',
              f"multihead_trunk_seconds_count {batches}.0",
              f"multihead_trunk_seconds_sum {trunk_s}"]
    return "\n".join(lines) + "\n"


def _timeout(label: str, start: float, timeout_s: float = 0.5) -> Call:
    return Call(label, start, start + timeout_s, -1, "TimeoutError")


def _load(window=(10.0, 20.0)) -> dict:
    """A load with the window (10, 20]: patient-0 sent at 4, 8, 12 and 16, each answered 4 s
    later (the last two sent in the window; answers at 12, 16 and 20 in it), patient-1 sent at
    11 and refused 504 at 19; impatient-0 giving up every 0.5 s from 9 s to 20 s (20 of them
    sent in the window), then answered once, sent after the window."""
    calls = [Call("patient-0", s, s + 4.0, 200) for s in (4.0, 8.0, 12.0, 16.0)]
    calls += [Call("patient-1", 11.0, 19.0, 504, "deadline_exceeded")]
    calls += [_timeout("impatient-0", 9.0 + 0.5 * k) for k in range(23)]
    calls += [Call("impatient-0", 20.5, 20.7, 200)]
    return {"window": window, "calls": calls, "unfinished": 2,
            "before": _metrics({"classify 200": 3}, batches=4, rows=20, trunk_s=8.0),
            "after": _metrics({"classify 200": 6}, batches=6, rows=30, trunk_s=12.0)}


def test_goodput_is_charged_to_the_requests_sent_in_the_window():
    summary = load_summary(_load())
    patient = summary[PATIENT]
    assert patient["clients"] == 2 and patient["requests"] == 3  # sent at 11, 12, 16
    assert patient["answered"] == 2 and patient["statuses"] == {"200": 2,
                                                               "504 deadline_exceeded": 1}
    assert patient["goodput"] == pytest.approx(2 / 10.0)
    assert patient["p50_ms"] == pytest.approx(4000.0)
    # Answered in the window, whenever sent: the answers at 12, 16 and 20.
    assert summary["answered_images"] == 3
    impatient = summary[IMPATIENT]
    assert impatient["gave_up"] == 20 and impatient["goodput"] == 0
    assert summary["gave_up"] == 23  # over the whole load, warm-up and drain included
    assert summary["unfinished"] == 2
    # The server over the window: 2 batches of 5 rows, 2 s each.
    assert summary["batches"] == 2 and summary["trunk_images"] == 10
    assert summary["server_trunk_ms"] == pytest.approx(2000.0)
    assert rows_for_nobody(summary) == 10 - 3


def test_a_load_of_patient_clients_only_has_no_impatient_group():
    data = _load()
    data["calls"] = [c for c in data["calls"] if c.tenant.startswith(PATIENT)]
    summary = load_summary(data)
    assert IMPATIENT not in summary and summary["gave_up"] == 0


def test_a_give_up_is_a_timeout_not_another_failure():
    assert gave_up(_timeout("impatient-0", 1.0))
    assert gave_up(Call("impatient-0", 1.0, 2.0, -1, "ServerTimeoutError"))
    assert not gave_up(Call("impatient-0", 1.0, 2.0, -1, "ClientOSError"))
    assert not gave_up(Call("impatient-0", 1.0, 2.0, 504, "deadline_exceeded"))


def test_the_servers_statuses_are_its_classify_requests_between_two_scrapes():
    before = _metrics({"classify 200": 3, "classify 499": 1, "healthz 200": 5})
    after = _metrics({"classify 200": 9, "classify 499": 21, "classify 504": 2,
                      "healthz 200": 9})
    assert statuses(before, after) == {"200": 6, "499": 20, "504": 2}
    summary = load_summary(_load(), {"before": before, "after": after})
    assert summary["server_statuses"] == {"200": 6, "499": 20, "504": 2}


def test_give_ups_the_server_did_not_count_as_499():
    assert uncounted_give_ups({"gave_up": 20, "server_statuses": {"499": 22}}) == 0
    assert uncounted_give_ups({"gave_up": 20, "server_statuses": {"200": 40, "499": 15}}) == 5
    assert uncounted_give_ups({"gave_up": 20, "server_statuses": {"200": 40}}) == 20
    assert uncounted_give_ups({"gave_up": 20}) != uncounted_give_ups({"gave_up": 20})  # NaN


def test_the_median_load_comes_first_and_every_scenario_has_a_server():
    names = [s.name for s in SCENARIOS]
    assert names[0] == MEDIAN_SCENARIO and SCENARIOS[0].impatient == 0
    assert {s.server for s in SCENARIOS} <= set(SERVERS)
    # The two loads compared differ in their server's cancellation only.
    by_name = {s.name: s for s in SCENARIOS}
    on, off = by_name["cancel"], by_name["no-cancel"]
    assert (on.clients, on.impatient) == (off.clients, off.impatient)
    assert SERVERS[on.server].cancels and not SERVERS[off.server].cancels
    assert SERVERS[on.server].options == {"cancel-on-disconnect": True}
    assert SERVERS[off.server].options == {"cancel-on-disconnect": False}


# -- targets and report -------------------------------------------------------------------------


def test_the_targets_carry_this_runs_numbers():
    t = _targets(passing_results()["cancellation"])
    assert {k: v.status for k, v in t.items()} == {"cancel_patient_goodput": PASS,
                                                   "cancel_499": PASS}
    assert t["cancel_patient_goodput"].measured == pytest.approx(0.05 / 0.8)
    assert t["cancel_patient_goodput"].note == "0.05 without vs 0.80 images/s with"
    assert t["cancel_499"].measured == 0
    assert t["cancel_499"].note == "290 give-ups, 306 × 499"


def test_patient_clients_starved_with_cancellation_too_fail():
    data = passing_results()["cancellation"]
    data["runs"]["cancel"][PATIENT]["goodput"] = 0.09  # no better than without
    t = _targets(data)["cancel_patient_goodput"]
    assert t.status == FAIL and t.measured == pytest.approx(0.05 / 0.09)


def test_give_ups_the_server_never_saw_fail_and_so_does_a_load_without_any():
    data = passing_results()["cancellation"]
    data["runs"]["cancel"]["server_statuses"] = {"200": 30, "499": 250}
    t = _targets(data)["cancel_499"]
    assert t.status == FAIL and t.measured == pytest.approx(40 / 290)
    data["runs"]["cancel"]["gave_up"] = 0  # the disconnects were not exercised
    t = _targets(data)["cancel_499"]
    assert t.status == FAIL and t.measured is None


def test_a_missing_load_fails_its_comparison():
    data = passing_results()["cancellation"]
    del data["runs"]["no-cancel"]
    t = _targets(data)
    assert t["cancel_patient_goodput"].status == FAIL
    assert t["cancel_patient_goodput"].measured is None
    assert t["cancel_499"].status == PASS


def test_the_report_has_a_row_per_scenario():
    md = render_markdown(passing_results())
    assert "## Clients that give up (openvino-fp32" in md
    assert "give up after 2 × the one client's median (420 ms): 0.84 s" in md
    assert ("| cancel | 8 patient + 8 giving up, `--cancel-on-disconnect` | 0.8 | 9,100 | "
            "9,800 | 200: 24 | 250 | 0.81 | 48 | 24 | 8 | 4,200 |") in md
    assert "| no-cancel | 290 | 16 | 200: 61, 503: 4, 504: 37 |" in md


def test_an_empty_result_renders_a_header_only():
    md = cancellation.render(CancellationResult(), {})
    assert md.startswith("## Clients that give up") and "| scenario |" in md
    assert "Over each whole load" not in md
