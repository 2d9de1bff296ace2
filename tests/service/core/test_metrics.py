"""Metrics: counters and histograms move, one registry per app, bounded per-bot and per-tenant
labels (what each tenant series counts, the cap, the "other" aggregate, stale gauges, and a
property over random traffic that no image is lost and no more than N + 1 labels appear)."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import prometheus
from service.core.metrics import OTHER, REFUSAL_CODES, Metrics, TopBots


def samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    return prometheus.samples(body.decode())


def bot_series(m: Metrics) -> dict[str, float]:
    return {dict(k[1])["bot"]: v for k, v in samples(m).items()
            if k[0] == "multihead_bot_requests_total"}


TENANT_METRICS = ("multihead_tenant_images_total", "multihead_tenant_refusals_total",
                  "multihead_tenant_queued_rows", "multihead_tenant_counter")


def tenant_series(m: Metrics, s: dict | None = None) -> dict[str, dict[tuple[str, ...], float]]:
    """{metric name: {(tenant,) or (tenant, code): value}} of the four tenant metrics."""
    out = {name: {} for name in TENANT_METRICS}
    for (name, labels), value in (s if s is not None else samples(m)).items():
        if name in out:
            d = dict(labels)
            out[name][(d["tenant"], d["code"]) if "code" in d else (d["tenant"],)] = value
    return out


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


# -- tenants ----------------------------------------------------------------------------------------


def test_tenant_images_refusals_and_gauges_per_tenant():
    m = Metrics(top_tenants=5)
    m.observe_tenant_images({"acme": 16, "beta": 3})
    m.observe_tenant_images({"acme": 4, "beta": 0})
    assert m.observe_refusal("beta", "rate_limited") == "beta"
    m.observe_refusal("beta", "rate_limited")
    m.observe_refusal("acme", "queue_share")
    m.observe_refusal("gamma", "overloaded")
    m.bind_tenant_state(lambda: {"acme": (7, 20.0), "beta": (0, 1.5)})

    t = tenant_series(m)
    assert t["multihead_tenant_images_total"] == {("acme",): 20, ("beta",): 3}
    assert t["multihead_tenant_refusals_total"] == {
        ("beta", "rate_limited"): 2, ("acme", "queue_share"): 1, ("gamma", "overloaded"): 1}
    assert t["multihead_tenant_queued_rows"] == {("acme",): 7, ("beta",): 0}
    assert t["multihead_tenant_counter"] == {("acme",): 20.0, ("beta",): 1.5}
    assert m.labelled_tenants == {"acme", "beta", "gamma"}


def test_tenant_labels_are_capped_at_top_tenants_and_sums_are_kept():
    top = 4
    m = Metrics(top_tenants=top)
    # N + 5 tenants of distinct traffic, busiest first: t0 100 images ... t8 20 images.
    traffic = {f"t{i}": 100 - 10 * i for i in range(top + 5)}
    for _ in range(10):
        m.observe_tenant_images({t: n // 10 for t, n in traffic.items()})
    for t, n in traffic.items():
        for _ in range(n // 20):
            m.observe_refusal(t, "rate_limited")
    state = {t: (n // 10, n / 2) for t, n in traffic.items()}
    m.bind_tenant_state(lambda: state)

    busiest = {f"t{i}" for i in range(top)}
    rest = set(traffic) - busiest
    t = tenant_series(m)
    images = t["multihead_tenant_images_total"]
    assert m.labelled_tenants == busiest
    assert set(images) == {(x,) for x in busiest | {OTHER}}
    assert sum(images.values()) == sum(traffic.values())
    assert images[(OTHER,)] == sum(traffic[x] for x in rest)
    refusals = t["multihead_tenant_refusals_total"]
    assert {x for x, _ in refusals} == busiest | {OTHER}
    assert sum(refusals.values()) == sum(n // 20 for n in traffic.values())
    queued = t["multihead_tenant_queued_rows"]
    assert set(queued) == {(x,) for x in busiest | {OTHER}}
    assert queued[(OTHER,)] == sum(state[x][0] for x in rest)  # summed
    assert sum(queued.values()) == sum(q for q, _ in state.values())
    counter = t["multihead_tenant_counter"]
    assert counter[(OTHER,)] == max(state[x][1] for x in rest)  # the largest, not the sum
    assert all(counter[(x,)] == state[x][1] for x in busiest)


def test_an_overtaken_tenant_loses_its_series_and_then_counts_under_other():
    m = Metrics(top_tenants=1)
    m.observe_tenant_images({"a": 10})
    m.observe_refusal("a", "queue_share")
    m.observe_tenant_images({"b": 5})
    assert tenant_series(m)["multihead_tenant_images_total"] == {("a",): 10, (OTHER,): 5}
    m.observe_tenant_images({"b": 10})  # b: 15 > a: 11 + margin
    assert m.labelled_tenants == {"b"}
    t = tenant_series(m)
    # a's series are gone, b's starts with the batch that gave it its label.
    assert t["multihead_tenant_images_total"] == {("b",): 10, (OTHER,): 5}
    assert t["multihead_tenant_refusals_total"] == {}
    m.observe_tenant_images({"a": 2})
    assert tenant_series(m)["multihead_tenant_images_total"] == {("b",): 10, (OTHER,): 7}


def test_stale_tenants_disappear_from_the_gauges():
    m = Metrics(top_tenants=2)
    m.observe_tenant_images({"a": 9, "b": 8, "c": 1})
    state = {"a": (3, 1.0), "b": (2, 2.0), "c": (1, 4.0)}
    m.bind_tenant_state(lambda: dict(state))
    t = tenant_series(m)
    assert t["multihead_tenant_queued_rows"] == {("a",): 3, ("b",): 2, (OTHER,): 1}
    assert t["multihead_tenant_counter"] == {("a",): 1.0, ("b",): 2.0, (OTHER,): 4.0}

    del state["b"], state["c"]  # b and c left the scheduler: no series, no "other"
    state["a"] = (0, 5.0)
    t = tenant_series(m)
    assert t["multihead_tenant_queued_rows"] == {("a",): 0}
    assert t["multihead_tenant_counter"] == {("a",): 5.0}

    state.clear()
    t = tenant_series(m)
    assert t["multihead_tenant_queued_rows"] == {} and t["multihead_tenant_counter"] == {}
    # The counters are not the scheduler's state: they stay.
    assert t["multihead_tenant_images_total"] == {("a",): 9, ("b",): 8, (OTHER,): 1}


@pytest.mark.parametrize("code", ["", "unknown_bot", "Rate_Limited", "other"])
def test_a_refusal_code_outside_the_closed_set_is_refused(code):
    m = Metrics()
    with pytest.raises(ValueError, match="unknown refusal code"):
        m.observe_refusal("acme", code)
    assert tenant_series(m)["multihead_tenant_refusals_total"] == {}
    assert m.labelled_tenants == frozenset()  # not counted as traffic either


def test_a_negative_row_count_is_refused_and_nothing_of_the_batch_counted():
    m = Metrics()
    with pytest.raises(ValueError, match="rows must be >= 0"):
        m.observe_tenant_images({"acme": 3, "beta": -1})
    assert tenant_series(m)["multihead_tenant_images_total"] == {}


def test_a_tenant_named_other_is_always_part_of_the_aggregate():
    m = Metrics(top_tenants=5)
    m.observe_tenant_images({OTHER: 30, "acme": 2})
    m.observe_refusal(OTHER, "overloaded")
    assert m.labelled_tenants == {"acme"}  # room for 4 more, and still no label of its own
    m.bind_tenant_state(lambda: {OTHER: (4, 1.0), "acme": (1, 0.5)})
    t = tenant_series(m)
    assert t["multihead_tenant_images_total"] == {(OTHER,): 30, ("acme",): 2}
    assert t["multihead_tenant_refusals_total"] == {(OTHER, "overloaded"): 1}
    assert t["multihead_tenant_queued_rows"] == {(OTHER,): 4, ("acme",): 1}


def test_top_tenants_zero_puts_every_tenant_under_other():
    m = Metrics(top_tenants=0)
    m.observe_tenant_images({"a": 1, "b": 2})
    m.bind_tenant_state(lambda: {"a": (1, 3.0), "b": (2, 1.0)})
    t = tenant_series(m)
    assert t["multihead_tenant_images_total"] == {(OTHER,): 3}
    assert t["multihead_tenant_queued_rows"] == {(OTHER,): 3}
    assert t["multihead_tenant_counter"] == {(OTHER,): 3.0}
    with pytest.raises(ValueError, match="top_tenants must be >= 0, got -1"):
        Metrics(top_tenants=-1)


def test_tenant_state_read_may_take_a_lock_held_by_a_thread_that_observes():
    """The race it guards: the scheduler calls observe_* holding its lock while a scrape reads
    its state under that lock; read under the metrics lock, the two would deadlock."""
    m = Metrics()
    scheduler_lock = threading.Lock()
    reading = threading.Event()

    def read():
        reading.set()
        with scheduler_lock:
            return {"acme": (1, 1.0)}

    m.bind_tenant_state(read)
    with scheduler_lock:
        scrape = threading.Thread(target=m.render, daemon=True)
        scrape.start()
        assert reading.wait(30)
        m.observe_refusal("acme", "overloaded")  # the scheduler, holding its lock
        m.observe_tenant_images({"acme": 2})
    scrape.join(30)
    assert not scrape.is_alive()
    t = tenant_series(m)
    assert t["multihead_tenant_images_total"] == {("acme",): 2}
    assert t["multihead_tenant_queued_rows"] == {("acme",): 1}


def test_concurrent_observers_and_scrapes_lose_no_count():
    m = Metrics(top_tenants=8)
    m.bind_tenant_state(lambda: {f"t{i}": (i, float(i)) for i in range(8)})

    def observe(i):
        for _ in range(500):
            m.observe_tenant_images({f"t{i}": 2, f"t{(i + 1) % 8}": 1})
            m.observe_refusal(f"t{i}", "rate_limited")

    def scrape():
        for _ in range(20):
            m.render()

    threads = [threading.Thread(target=observe, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=scrape) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t = tenant_series(m)
    assert t["multihead_tenant_images_total"] == {(f"t{i}",): 500 * 3 for i in range(8)}
    assert sum(t["multihead_tenant_refusals_total"].values()) == 8 * 500
    assert t["multihead_tenant_queued_rows"] == {(f"t{i}",): i for i in range(8)}


NAMES = [f"t{i}" for i in range(10)] + [OTHER]
STEP = st.one_of(
    st.tuples(st.just("batch"), st.dictionaries(st.sampled_from(NAMES), st.integers(0, 64),
                                                max_size=6)),
    st.tuples(st.just("refusal"), st.tuples(st.sampled_from(NAMES), st.sampled_from(REFUSAL_CODES))),
    st.tuples(st.just("state"), st.dictionaries(
        st.sampled_from(NAMES), st.tuples(st.integers(0, 1000), st.floats(0, 1e6)), max_size=11)),
)


@settings(max_examples=60, deadline=None)
@given(top=st.integers(0, 4), steps=st.lists(STEP, max_size=40))
def test_random_traffic_loses_no_image_and_keeps_at_most_n_plus_one_tenant_labels(top, steps):
    """Every image (refusal) observed is in a tenant_images_total (tenant_refusals_total) series,
    or was in one that went away when its tenant lost its label to a busier one; with no more
    tenants than labels, none goes away and the labels' sum is the total. Never more than N + 1
    tenant labels, across the four tenant metrics."""
    m = Metrics(top_tenants=top)
    state: dict = {}
    m.bind_tenant_state(lambda: state)
    total = {"multihead_tenant_images_total": 0, "multihead_tenant_refusals_total": 0}
    retired = dict.fromkeys(total, 0)
    seen = set()
    last = tenant_series(m)
    for kind, arg in steps:
        if kind == "batch":
            m.observe_tenant_images(arg)
            total["multihead_tenant_images_total"] += sum(arg.values())
            seen |= {t for t, rows in arg.items() if rows}
        elif kind == "refusal":
            m.observe_refusal(*arg)
            total["multihead_tenant_refusals_total"] += 1
            seen.add(arg[0])
        else:
            state = arg
        now = tenant_series(m)
        for name in total:
            retired[name] += sum(v for k, v in last[name].items() if k not in now[name])
            assert sum(now[name].values()) + retired[name] == total[name]
        last = now
        labels = {k[0] for series in now.values() for k in series}
        assert len(labels) <= top + 1
        assert labels <= m.labelled_tenants | {OTHER}
        queued = now["multihead_tenant_queued_rows"]
        assert sum(queued.values()) == sum(q for q, _ in state.values())
    if len(seen - {OTHER}) <= top:
        assert retired == dict.fromkeys(total, 0)
