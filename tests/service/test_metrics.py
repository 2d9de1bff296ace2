"""Metrics: counters and histograms move, one registry per app, bounded per-bot labels."""
from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

from service.core.metrics import OTHER, Metrics, TopBots


def samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def bot_series(m: Metrics) -> dict[str, float]:
    return {dict(k[1])["bot"]: v for k, v in samples(m).items()
            if k[0] == "multihead_bot_requests_total"}


def test_counters_gauges_and_histograms_move():
    m = Metrics()
    m.observe_request("classify", 200, 0.05)
    m.observe_request("classify", 200, 0.07)
    m.observe_request("classify", 404)
    m.observe_batch(size=5, groups=3, queue_wait_s=[0.001] * 5, run_s=0.3)
    m.observe_cache(hit=True)
    m.observe_cache(hit=False, n=2)
    m.set_resident_heads(3, 3 * 1536 * 10 * 4)
    m.bind_queue_depth(lambda: 7)
    m.decode_seconds.observe(0.01)
    m.trunk_seconds.observe(0.25)
    m.heads_seconds.observe(0.001)

    s = samples(m)
    route = ("route", "classify")
    assert s[("multihead_requests_total", (route, ("status", "200")))] == 2
    assert s[("multihead_requests_total", (route, ("status", "404")))] == 1
    assert s[("multihead_request_seconds_count", (route,))] == 2
    assert s[("multihead_batch_size_bucket", (("le", "4.0"),))] == 0
    assert s[("multihead_batch_size_bucket", (("le", "8.0"),))] == 1
    assert s[("multihead_batch_bots_sum", ())] == 3
    assert s[("multihead_queue_wait_seconds_count", ())] == 5
    assert s[("multihead_feature_cache_hits_total", ())] == 1
    assert s[("multihead_feature_cache_misses_total", ())] == 2
    assert s[("multihead_resident_heads", ())] == 3
    assert s[("multihead_resident_head_bytes", ())] == 3 * 1536 * 10 * 4
    assert s[("multihead_queue_depth", ())] == 7
    for name in ("decode", "trunk", "heads"):
        assert s[(f"multihead_{name}_seconds_count", ())] == 1


def test_each_metrics_object_has_its_own_registry():
    a, b = Metrics(), Metrics()  # registering twice in one registry would raise
    a.observe_request("healthz", 200)
    assert ("multihead_requests_total", (("route", "healthz"), ("status", "200"))) in samples(a)
    assert not any(k[0] == "multihead_requests_total" for k in samples(b))


def test_per_bot_label_cardinality_stays_bounded_with_1000_bots():
    top = 20
    m = Metrics(top_bots=top)
    rng = random.Random(0)
    bots = [f"bot-{i:04d}" for i in range(1000)]
    weights = [1.0 / (i + 1) for i in range(1000)]  # Zipf-like: bot-0000 is the busiest
    stream = rng.choices(bots, weights=weights, k=20_000)
    for bot_id in bots + stream:  # every bot appears at least once
        m.observe_bot(bot_id)

    series = bot_series(m)
    assert len(series) <= top + 1
    assert OTHER in series
    assert set(series) - {OTHER} == m.labelled_bots
    # The busiest bots by true count own their labels.
    counts = {b: stream.count(b) + 1 for b in bots[:50]}
    busiest = sorted(counts, key=counts.get, reverse=True)[:5]
    assert set(busiest) <= set(series), (busiest, sorted(series))


def test_a_bot_overtaking_a_labelled_one_takes_its_label():
    m = Metrics(top_bots=2)
    for bot_id, n in [("a", 5), ("b", 3), ("c", 1)]:
        m.observe_bot(bot_id, n)
    assert m.labelled_bots == {"a", "b"}
    assert bot_series(m) == {"a": 5, "b": 3, OTHER: 1}
    assert m.observe_bot("c", 4) == "c"  # c: 5 > b: 3 + margin
    assert m.labelled_bots == {"a", "c"}
    assert set(bot_series(m)) == {"a", "c", OTHER}


def test_boundary_bots_of_equal_traffic_do_not_swap_on_every_request():
    t = TopBots(1)
    swaps = 0
    # y, then x x y y x x ...: each bot in turn gets ahead of the other by one request.
    for bot_id in ["y"] + ["x", "x", "y", "y"] * 50:
        _, demoted = t.observe(bot_id)
        swaps += demoted is not None
    assert swaps <= 1


def test_top_bots_memory_is_bounded_however_many_ids_appear():
    t = TopBots(3, capacity=50)
    for i in range(5_000):
        t.observe(f"id-{i}")
        t.observe("hot")
    assert len(t.counts) <= 50
    assert "hot" in t.labelled


def test_a_bot_named_other_never_gets_a_label_of_its_own():
    m = Metrics(top_bots=5)
    assert m.observe_bot(OTHER, 10) == OTHER
    assert OTHER not in m.labelled_bots
    assert bot_series(m) == {OTHER: 10}
