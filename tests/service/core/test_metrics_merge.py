"""The merge of several replicas' /metrics (what `multihead serve --ray` answers): real `Metrics`
registries with different traffic, rendered and merged; the answer parsed back with
the one parser of /metrics text (`bench.prometheus`). The Ray end to end (two real replicas):
tests/scaleout/test_ray.py."""
from __future__ import annotations

import pytest

from bench.prometheus import Samples, samples
from service.core import metrics_merge
from service.core.metrics import Metrics
from service.core.metrics_merge import GAUGES, MISSING, PER_REPLICA, REPLICAS, Aggregate


def parse(body: bytes) -> Samples:
    """`samples` of a /metrics body (refused if a family or a sample is given twice)."""
    return samples(body.decode())


def text(m: Metrics) -> str:
    return m.render()[0].decode()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replica(requests: int, *, queued: int, resident: int, bot: str = "alpha",
            seconds: float = 0.02) -> Metrics:
    m = Metrics()
    for _ in range(requests):
        m.observe_request("classify", 200, seconds)
        m.observe_bot(bot)
    m.observe_request("classify", 404, None)
    m.observe_batch(requests, 1, [0.001] * requests, 0.5)
    m.observe_cache(False, requests)
    m.bind_queue_depth(lambda: queued)
    m.set_resident_heads(resident, resident * 1000)
    m.set_trunk(device="cpu", runtime="tf", precision="fp32")
    m.set_pinned_bots(["alpha"])
    return m


REQ_200 = ("multihead_requests_total", (("route", "classify"), ("status", "200")))
REQ_404 = ("multihead_requests_total", (("route", "classify"), ("status", "404")))
QUEUE = ("multihead_queue_depth", ())


def test_counters_and_histograms_are_summed_gauges_by_meaning():
    a, b = replica(3, queued=2, resident=1), replica(5, queued=7, resident=4, bot="beta")
    body, content_type = Aggregate().merge({"ra": text(a), "rb": text(b)})
    assert content_type.startswith("text/plain")
    merged, sa, sb = parse(body), parse(a.render()[0]), parse(b.render()[0])
    assert merged[REQ_200] == 8 and merged[REQ_404] == 2
    assert merged[("multihead_bot_requests_total", (("bot", "alpha"),))] == 3
    assert merged[("multihead_bot_requests_total", (("bot", "beta"),))] == 5
    assert merged[("multihead_feature_cache_misses_total", ())] == 8
    # every sample of the histograms is the sum: buckets, count, sum
    for name, value in sa.items():
        if name[0].startswith("multihead_request_seconds") and not name[0].endswith("_created"):
            assert merged[name] == pytest.approx(value + sb[name]), name
    assert merged[("multihead_batch_size_count", ())] == 2
    assert merged[("multihead_batch_size_sum", ())] == 8
    # _created: the earliest
    created = ("multihead_requests_created", REQ_200[1])
    assert merged[created] == min(sa[created], sb[created])
    # gauges: rows queued summed; a replica's own heads per replica; facts once
    assert merged[QUEUE] == 9
    assert merged[("multihead_resident_heads", (("replica", "ra"),))] == 1
    assert merged[("multihead_resident_heads", (("replica", "rb"),))] == 4
    assert ("multihead_resident_heads", ()) not in merged
    assert [k for k in merged if k[0] == "multihead_trunk_info"] == [
        ("multihead_trunk_info", (("calibration", ""), ("calibration_date", ""),
                                  ("calibration_images", ""), ("device", "cpu"),
                                  ("precision", "fp32"), ("runtime", "tf")))]
    assert merged[("multihead_pinned_bot", (("bot", "alpha"),))] == 1
    assert merged[(REPLICAS, ())] == 2 and merged[(MISSING, ())] == 0


def test_one_replica_merged_is_that_replica():
    """Nothing lost or renamed: one replica's merge has its every series (its own gauges
    under its name)."""
    a = replica(3, queued=2, resident=1)
    merged, own = parse(Aggregate().merge({"ra": text(a)})[0]), parse(a.render()[0])
    for (name, labels), value in own.items():
        if GAUGES.get(name) == PER_REPLICA:
            labels = tuple(sorted((*labels, ("replica", "ra"))))
        assert merged[(name, labels)] == value, name
    assert set(merged) - {(REPLICAS, ()), (MISSING, ())} == {
        (name, tuple(sorted((*labels, ("replica", "ra")))) if GAUGES.get(name) == PER_REPLICA
         else labels) for name, labels in own}


def test_a_replica_that_stops_answering_keeps_its_counts_and_loses_its_gauges():
    clock = Clock()
    aggregate = Aggregate(retain_s=60, clock=clock)
    a, b = replica(3, queued=2, resident=1), replica(5, queued=7, resident=4)
    before = parse(aggregate.merge({"ra": text(a), "rb": text(b)})[0])
    b.observe_request("classify", 200, 0.01)
    clock.now += 1
    after = parse(aggregate.merge({"rb": text(b)}, missing=1)[0])
    assert after[REQ_200] == 9  # ra's last 3, rb's 6: never below the 8 before
    assert all(after[k] >= v for k, v in before.items()
               if k[0].endswith(("_total", "_bucket", "_count", "_sum"))), "a sum went back"
    assert after[QUEUE] == 7  # a gauge is a value of now: ra has none
    assert ("multihead_resident_heads", (("replica", "ra"),)) not in after
    assert after[(REPLICAS, ())] == 1 and after[(MISSING, ())] == 1
    # a new replica takes ra's place; later, ra's entry is folded into the retired total
    c = replica(2, queued=0, resident=1)
    for step in (1, 61, 1):
        clock.now += step
        merged = parse(aggregate.merge({"rb": text(b), "rc": text(c)})[0])
        assert merged[REQ_200] == 3 + 6 + 2, step
    assert merged[("multihead_requests_created", REQ_200[1])] == \
        before[("multihead_requests_created", REQ_200[1])]


def test_the_same_texts_give_the_same_answer():
    a, b = replica(3, queued=2, resident=1), replica(5, queued=7, resident=4)
    aggregate = Aggregate()
    live = {"ra": text(a), "rb": text(b)}
    assert aggregate.merge(live)[0] == aggregate.merge(live)[0]


def test_a_text_that_is_not_prometheus_is_refused_and_nothing_is_remembered():
    aggregate = Aggregate()
    a = replica(3, queued=2, resident=1)
    with pytest.raises(ValueError):
        aggregate.merge({"ra": text(a), "rb": "multihead_requests_total{ 1\n"})
    assert parse(aggregate.merge({})[0]) == {(REPLICAS, ()): 0, (MISSING, ()): 0}


def test_every_gauge_of_the_service_has_a_merge_rule():
    """A new gauge must say whether replicas add up (rows queued), state the same fact (the
    trunk), or each have their own (resident heads): add it to metrics_merge.GAUGES."""
    families = Metrics().registry.collect()
    gauges = {f.name for f in families if f.type == "gauge"}
    assert gauges - set(GAUGES) == set(), "gauges without a rule in metrics_merge.GAUGES"
    assert set(GAUGES) - gauges == set(), "rules for gauges that do not exist"
    assert set(GAUGES.values()) <= {metrics_merge.SUM, metrics_merge.SAME, PER_REPLICA}
