"""The cancellation section's bookkeeping on constructed calls and /metrics texts: the window
of its statistics (goodput charged to when requests were sent), the give-ups against the
server's 499s, its impatient clients from the trunk's measured time (`bench.sections.
impatience`'s arithmetic, and the section's order of loads on fake servers), its targets (PASS
and FAIL) and its Markdown. An impatient client against a real
server (its timeout closes the connection; a 499 only where the server cancels):
tests/bench/test_sections.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bench.bots import register_bots
from bench.plan import Plan
from bench.report import evaluate_targets, render_markdown
from bench.sections import cancellation
from bench.sections.base import FAIL, PASS
from bench.sections.cancellation import (
    BATCH_SCENARIO,
    IMPATIENT,
    MEDIAN_SCENARIO,
    PATIENT,
    SCENARIOS,
    SERVERS,
    SHADOW_BASE,
    CancellationResult,
    Server,
    client_bots,
    gave_up,
    impatience_of,
    load_summary,
    register_shadows,
    rows_for_nobody,
    shadow_cost,
    statuses,
    uncounted_give_ups,
)
from bench.sections.fairness_load import Call
from bench.sections.impatience import MAX_IMPATIENT, OVERLOAD, Impatience, impatience
from tests.bench.helpers import passing_results


def _targets(data: dict) -> dict:
    results = passing_results()
    results["cancellation"] = data
    return {t.key: t for t in evaluate_targets(results, {"cancellation"})
            if t.section == "cancellation"}


def _metrics(requests: dict[str, int], batches: int = 0, rows: int = 0,
             trunk_s: float = 0.0, heads_s: float = 0.0,
             candidates: dict[str, int] | None = None) -> str:
    lines = ["# TYPE multihead_requests_total counter"]
    lines += [f'multihead_requests_total{{route="{route}",status="{status}"}} {n}.0'
              for (route, status), n in ((k.split(" "), v) for k, v in requests.items())]
    lines += ["# TYPE multihead_batch_size histogram",
              f'multihead_batch_size_bucket{{le="+Inf"}} {batches}.0',
              f"multihead_batch_size_count {batches}.0", f"multihead_batch_size_sum {rows}.0",
              "# TYPE multihead_trunk_seconds histogram",
              f'multihead_trunk_seconds_bucket{{le="+Inf"}} {batches}.0',
              f"multihead_trunk_seconds_count {batches}.0",
              f"multihead_trunk_seconds_sum {trunk_s}",
              "# TYPE multihead_heads_seconds histogram",
              f'multihead_heads_seconds_bucket{{le="+Inf"}} {batches}.0',
              f"multihead_heads_seconds_count {batches}.0",
              f"multihead_heads_seconds_sum {heads_s}"]
    if candidates is not None:
        lines += ["# TYPE multihead_candidate_images_total counter"]
        lines += [f'multihead_candidate_images_total{{bot="{bot}",version="2"}} {n}.0'
                  for bot, n in candidates.items()]
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


def test_the_servers_heads_time_and_its_candidate_images_over_the_window():
    data = _load()
    assert load_summary(data)["candidate_images"] is None  # no candidate: no series
    assert load_summary(data)["server_heads_ms"] == 0.0
    data["before"] = _metrics({}, batches=4, rows=20, trunk_s=8.0, heads_s=0.01,
                              candidates={"bot-00000": 12, "other": 8})
    data["after"] = _metrics({}, batches=6, rows=30, trunk_s=12.0, heads_s=0.03,
                             candidates={"bot-00000": 15, "bot-00001": 2, "other": 13})
    summary = load_summary(data)
    assert summary["server_heads_ms"] == pytest.approx(10.0)  # 20 ms over 2 batches
    assert summary["candidate_images"] == 10  # every series, a new one included


def _run(images_per_s: float, trunk_ms: float, heads_ms: float, candidates=None) -> dict:
    """A 16-patient load's summary: 6 batches of 8 rows."""
    return {"total_images_per_s": images_per_s, "batches": 6, "trunk_images": 48,
            "server_trunk_ms": trunk_ms, "server_heads_ms": heads_ms,
            "candidate_images": candidates}


def test_the_shadow_cost_counts_the_heads_not_the_trunks_drift():
    # The trunk ran 10 % slower on the shadow's server: the clients' ratio carries it, the
    # server's does not (heads 8 -> 40 ms per batch of 8: 1 -> 5 ms per image).
    cost = shadow_cost(_run(1.6, 4000.0, 8.0), _run(1.44, 4400.0, 40.0, candidates=48))
    assert cost["trunk_ms"] == pytest.approx((500.0, 550.0))
    assert cost["heads_ms"] == pytest.approx((1.0, 5.0))
    assert cost["client_ratio"] == pytest.approx(0.9)
    assert cost["server_ratio"] == pytest.approx(551.0 / 555.0)
    assert cost["scored"] == 1.0
    # Heads as slow as a tenth of the trunk: a cost the server's ratio shows.
    cost = shadow_cost(_run(1.6, 4000.0, 8.0), _run(1.6, 4000.0, 408.0, candidates=40))
    assert cost["server_ratio"] == pytest.approx(501.0 / 551.0)
    assert cost["scored"] == pytest.approx(40 / 48)


def test_a_shadow_cost_without_its_numbers_is_nan():
    cost = shadow_cost({}, _run(1.6, 4000.0, 8.0))
    assert np.isnan(cost["client_ratio"]) and np.isnan(cost["server_ratio"])
    assert np.isnan(cost["scored"])  # no candidate series: the shadows never ran
    cost = shadow_cost(_run(1.6, 4000.0, 8.0), {**_run(0.0, 0.0, 0.0), "trunk_images": 0})
    assert np.isnan(cost["server_ratio"]) and cost["client_ratio"] == 0


def test_register_shadows_gives_every_bot_another_head_with_its_labels(tmp_path):
    from store import HeadStore

    store = tmp_path / "store"
    bots = register_bots(store, 3, classes=4, seed=1)
    register_shadows(SimpleNamespace(plan=Plan(classes=4, seed=1)), store, bots)
    heads = HeadStore(store)
    try:
        for bot in bots:
            info = heads.info(bot)
            assert info.version == 1 and info.candidate is not None
            assert str(info.candidate.mode) == "shadow"
            assert info.candidate.labels == info.labels
            live, candidate = heads.get(bot), heads.candidate(bot).head
            assert not np.allclose(live.weights, candidate.weights)
    finally:
        heads.close()


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
    assert names[0] == MEDIAN_SCENARIO and not SCENARIOS[0].impatient
    assert {s.server for s in SCENARIOS} <= set(SERVERS)
    # The impatient clients come from the median and the trunk time of a load of 16 patient
    # clients on the same server, both run before any load that has them.
    first_impatient = next(i for i, s in enumerate(SCENARIOS) if s.impatient)
    assert BATCH_SCENARIO in names[:first_impatient]
    by_name = {s.name: s for s in SCENARIOS}
    assert (by_name[BATCH_SCENARIO].patient, by_name[BATCH_SCENARIO].impatient) == (16, False)
    assert by_name[BATCH_SCENARIO].server == SCENARIOS[first_impatient].server
    # The two loads compared differ in their server's cancellation only.
    on, off = by_name["cancel"], by_name["no-cancel"]
    assert (on.patient, on.impatient) == (off.patient, off.impatient) == (8, True)
    assert SERVERS[on.server].cancels and not SERVERS[off.server].cancels
    assert SERVERS[on.server].options == {"cancel-on-disconnect": True}
    assert SERVERS[off.server].options == {"cancel-on-disconnect": False}
    # The shadow load is the 16 patient clients of the one it is compared with, on a server
    # of the same flags whose prepare registers the candidates; last (it changes the store).
    base, shadow = by_name[SHADOW_BASE], by_name["shadow"]
    assert names[-1] == "shadow" and (shadow.patient, shadow.impatient) == (16, False)
    assert (base.patient, base.impatient) == (16, False)
    assert SERVERS[shadow.server].options == SERVERS[base.server].options
    assert SERVERS[shadow.server].prepare is register_shadows
    assert all(SERVERS[s.server].prepare is None for s in SCENARIOS[:-1])


# -- the impatient clients, from the trunk ----------------------------------------------------


def test_a_slow_trunk_gets_8_clients_giving_up_after_a_quarter_of_a_batch():
    # A batch of 8 in 4 s (500 ms per image), a request alone in 500 ms: T = 4000 / 4 = 1 s,
    # and 8 clients giving up every second abandon 8 rows a second, 4 × the trunk's 2.
    got = impatience(500.0, 4000.0, 500.0, 8)
    assert got == Impatience(1.0, 8, 4000.0, 500.0, 500.0)
    assert got.overload == pytest.approx(4.0)


def test_a_fast_trunk_keeps_the_rate_with_more_clients_past_the_median():
    # A batch of 8 in 136 ms (17 ms per image) but 45 ms for a request alone: B / 4 = 34 ms
    # would give up on requests that never queued, so T = 45 ms, and 4 × 45 / 17 = 10.6
    # requests must be in flight: 11 clients, 11 / 0.045 s = 244 a second, 4.16 × 58.8.
    got = impatience(45.0, 136.0, 17.0, 8)
    assert (got.timeout_s, got.clients) == (pytest.approx(0.045), 11)
    assert got.overload == pytest.approx(11 / 0.045 * 0.017)


def test_the_impatient_clients_mean_the_same_on_any_trunk_speed():
    """Scale every time by s (a CPU s times slower): the same clients, the timeout s times
    longer, the same overload; and wherever the request path allows it, each rule holds."""
    for m, batch, image in ((500.0, 4000.0, 500.0), (45.0, 136.0, 17.0),
                            (50.0, 320.0, 40.0), (30.0, 73.0, 9.3)):
        base = impatience(m, batch, image, 8)
        for s in (0.1, 0.25, 3.0, 10.0):
            scaled = impatience(m * s, batch * s, image * s, 8)
            assert scaled.clients == base.clients
            assert scaled.timeout_s == pytest.approx(base.timeout_s * s)
            assert scaled.overload == pytest.approx(base.overload)
        assert base.overload >= OVERLOAD  # abandoned work piles up at 3 s a second or more
        assert base.timeout_s * 1000 >= m  # only requests that queued are given up on
        assert base.timeout_s * 1000 < batch  # every request under the load is given up on
        assert base.clients >= 8


def test_8_clients_at_a_quarter_of_a_full_batch_are_not_rounded_up_to_9():
    # The time per image as the section computes it (ms per batch × batches ÷ rows): here
    # 4 × (B / 4) ÷ it is 8.000000000000002, not 8.
    for batch, batches in ((970.2, 19), (1997.1, 3), (2628.6, 26), (136.0, 6)):
        assert impatience(1.0, batch, batch * batches / (8 * batches), 8).clients == 8


def test_half_full_batches_keep_the_batch_size_of_clients_at_a_higher_overload():
    # Batches of 4 rows in 400 ms: 10 rows a second; 8 clients every 100 ms: 80, 8 ×.
    got = impatience(50.0, 400.0, 100.0, 8)
    assert (got.clients, got.timeout_s) == (8, pytest.approx(0.1))
    assert got.overload == pytest.approx(8.0)


def test_a_request_path_slower_than_two_batches_is_capped_and_says_so():
    # A request alone takes 300 ms, a batch of 8 100 ms: 4 × 300 / 12.5 = 96 clients wanted.
    got = impatience(300.0, 100.0, 12.5, 8)
    assert got.clients == MAX_IMPATIENT and got.timeout_s == pytest.approx(0.3)
    assert got.overload == pytest.approx(MAX_IMPATIENT / 0.3 * 0.0125)
    assert got.overload < OVERLOAD  # 2.67 ×: the report says it


@pytest.mark.parametrize("median_ms, batch_ms, image_ms", [
    (float("nan"), 4000.0, 500.0), (500.0, float("nan"), 500.0), (500.0, 4000.0, 0.0),
    (500.0, float("inf"), 500.0), (-1.0, 4000.0, 500.0)])
def test_impatient_clients_need_every_number(median_ms, batch_ms, image_ms):
    with pytest.raises(ValueError):
        impatience(median_ms, batch_ms, image_ms, 8)


def test_the_sections_impatient_clients_come_from_its_all_patient_window():
    # passing_results: median 420 ms; all-patient 6 batches of 48 rows at 4.1 s a batch.
    result = CancellationResult.from_json(passing_results()["cancellation"])
    got = impatience_of(result)
    assert (got.batch_ms, got.image_ms, got.median_ms) == (4100.0, 512.5, 420.0)
    assert (got.clients, got.timeout_s) == (8, pytest.approx(1.025))
    del result.runs[BATCH_SCENARIO]["server_trunk_ms"]  # no /metrics: no trunk time
    with pytest.raises(ValueError):
        impatience_of(result)


def test_impatient_clients_share_the_bots_the_patient_ones_do_not_use():
    bots = [f"b{i}" for i in range(16)]
    got = client_bots(bots, 8, 11)
    assert [got[f"{PATIENT}-{i}"] for i in range(8)] == bots[:8]
    assert [got[f"{IMPATIENT}-{j}"] for j in range(11)] == bots[8:] + bots[8:11]
    assert client_bots(bots, 16, 0) == {f"{PATIENT}-{i}": bots[i] for i in range(16)}


class _FakeServer:
    url, ready_s, pid = "http://fake", 1.0, 1

    def __init__(self, name: str, options: dict) -> None:
        self.name, self.options = name, options

    def runtime(self) -> str:
        return "fake"

    def stop(self, timeout_s: float) -> None:
        pass


def _fake_context(tmp_path, started: list, errors: dict) -> SimpleNamespace:
    def server(name, store, **options):
        started.append(name)
        return _FakeServer(name, options)

    return SimpleNamespace(
        plan=Plan(), jpegs=[b"jpeg"], image_summary=lambda: "fake images",
        bot_store=lambda name, n: (tmp_path, [f"bot-{i}" for i in range(n)]),
        server=server, start=lambda s: s,
        record_error=lambda name, exc: errors.__setitem__(name, str(exc)))


def _fake_summary(p50_ms: float, trunk_ms: float | None) -> dict:
    return {PATIENT: {"p50_ms": p50_ms, "goodput": 1.0}, "gave_up": 0, "answered_images": 48,
            "batches": 6, "trunk_images": 48, "server_trunk_ms": trunk_ms}


def test_the_run_sets_the_impatient_loads_from_the_trunk_time_of_all_patient(
        tmp_path, monkeypatch):
    """The section on fake servers: the loads with impatient clients get those derived from
    the one client's median and all-patient's trunk time (a fast trunk: 136 ms a batch)."""
    loads, started, errors = {}, [], {}

    def fake_load(context, url, bots, scenario, give_up, cancels):
        loads[scenario.name] = give_up if scenario.impatient else None
        return _fake_summary(45.0, 136.0)

    async def no_warm_up(*args):
        pass

    monkeypatch.setattr(cancellation, "_load", fake_load)
    monkeypatch.setattr(cancellation, "warm_up_batch", no_warm_up)
    monkeypatch.setitem(SERVERS, "shadow", Server({"cancel-on-disconnect": True}))
    result = cancellation.run(_fake_context(tmp_path, started, errors))
    assert errors == {} and list(loads) == [s.name for s in SCENARIOS]
    expected = impatience(45.0, 136.0, 17.0, 8)
    assert loads["cancel"] == loads["no-cancel"] == expected and expected.clients == 11
    assert (result.impatient, result.timeout_s, result.overload) == (
        11, expected.timeout_s, expected.overload)
    assert (result.batch_ms, result.image_ms, result.median_ms) == (136.0, 17.0, 45.0)
    assert started == ["cancellation-cancel", "cancellation-no-cancel", "cancellation-shadow"]


def test_without_a_trunk_time_the_impatient_loads_are_errors_not_guesses(tmp_path,
                                                                        monkeypatch):
    loads, started, errors = [], [], {}

    def fake_load(context, url, bots, scenario, give_up, cancels):
        loads.append(scenario.name)
        return _fake_summary(45.0, None)  # the server's /metrics never answered

    async def no_warm_up(*args):
        pass

    monkeypatch.setattr(cancellation, "_load", fake_load)
    monkeypatch.setattr(cancellation, "warm_up_batch", no_warm_up)
    monkeypatch.setitem(SERVERS, "shadow", Server({"cancel-on-disconnect": True}))
    result = cancellation.run(_fake_context(tmp_path, started, errors))
    assert loads == [MEDIAN_SCENARIO, BATCH_SCENARIO, "shadow"]
    assert set(errors) == {"cancellation-impatience", "cancellation-cancel",
                           "cancellation-no-cancel"}
    assert "cancellation-no-cancel" not in started and result.impatient is None
    t = _targets(result.to_json())
    assert t["cancel_patient_goodput"].status == FAIL and t["cancel_499"].status == FAIL


# -- targets and report -------------------------------------------------------------------------


def test_the_targets_carry_this_runs_numbers():
    t = _targets(passing_results()["cancellation"])
    assert {k: v.status for k, v in t.items()} == {"cancel_patient_goodput": PASS,
                                                   "cancel_499": PASS, "shadow_cost": PASS,
                                                   "shadow_scored": PASS}
    assert t["cancel_patient_goodput"].measured == pytest.approx(0.05 / 0.8)
    assert t["cancel_patient_goodput"].note == ("0.05 without vs 0.80 images/s with; 8 giving "
                                                "up after 1025 ms: 4.0 × the trunk's rows")
    assert t["cancel_499"].measured == 0
    assert t["cancel_499"].note == "290 give-ups, 306 × 499"


    # Heads 2 -> 4 ms per batch of 8 (0.25 -> 0.5 ms per image), the trunk at 537.5 ms per
    # image with the shadows; the clients' 0.957 is the trunk's drift.
    assert t["shadow_cost"].measured == pytest.approx(537.75 / 538.0)
    assert t["shadow_cost"].note == ("heads 0.50 vs 0.25 ms/image, trunk 538 ms/image; "
                                     "clients' images/s 1.55 vs 1.62 (0.957)")
    assert t["shadow_scored"].measured == 1.0
    assert t["shadow_scored"].note == "48 candidate images, 48 trunk images"


def test_shadows_that_cost_or_never_ran_fail():
    data = passing_results()["cancellation"]
    data["runs"]["shadow"]["server_heads_ms"] = 200.0  # 25 ms per image: 4.5 %
    t = _targets(data)
    assert t["shadow_cost"].status == FAIL
    assert t["shadow_cost"].measured == pytest.approx(537.75 / 562.5)
    del data["runs"]["shadow"]["candidate_images"]  # no candidate series at all
    data["runs"]["shadow"]["server_heads_ms"] = 2.0
    t = _targets(data)
    assert t["shadow_cost"].status == PASS
    assert t["shadow_scored"].status == FAIL and t["shadow_scored"].measured is None
    data["runs"]["shadow"]["candidate_images"] = 40  # 8 rows no candidate scored
    assert _targets(data)["shadow_scored"].status == FAIL
    del data["runs"]["shadow"]
    t = _targets(data)
    assert t["shadow_cost"].status == FAIL and t["shadow_scored"].status == FAIL


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
    assert ("The clients giving up: 8, each after 1.02 s (a quarter of the server's trunk "
            "time per batch under all-patient, 4,100 ms, and no less than the one client's "
            "median, 420 ms), then at once sending their next request: they abandon 4 × the "
            "rows the trunk runs a second (512 ms per image)") in md
    assert ("| cancel | 8 patient + 8 giving up, `--cancel-on-disconnect` | 0.8 | 9,100 | "
            "9,800 | 200: 24 | 250 | 0.81 | 48 | 24 | 8 | 4,200 |") in md
    assert "| no-cancel | 290 | 16 | 200: 61, 503: 4, 504: 37 |" in md
    assert "| all-patient | 1.62 | 512 | 0.25 | — | 48 |" in md
    assert "| shadow | 1.55 | 538 | 0.5 | 48 | 48 |" in md
    assert "clients' images/s 0.9568; server time per image, the trunk as it ran with the " \
        "shadows 0.9995 (the target's)" in md


def test_an_empty_result_renders_a_header_only():
    md = cancellation.render(CancellationResult(), {})
    assert md.startswith("## Clients that give up") and "| scenario |" in md
    assert "Over each whole load" not in md and "A shadow candidate" not in md
