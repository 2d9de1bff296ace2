"""`service.core.metrics_scope`: a tenant's view of the Prometheus text, alone and after the
Ray ingress's merge of several replicas' texts."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from service.core.metrics import Metrics
from service.core.metrics_merge import Aggregate
from service.core.metrics_scope import MACHINE, Scope, scoped

ACME = Scope("acme", frozenset({"a1", "a2"}))


def _busy() -> Metrics:
    """acme (bots a1, a2), globex (g1) and initech (i1, under "other" for both labels)."""
    m = Metrics(top_bots=3, top_tenants=2)
    for bot in ("a1", "a2", "g1", "i1"):
        m.observe_bot(bot)
    m.observe_candidate("a1", 2, images=1, agreed=1)
    m.observe_candidate("g1", 3, images=1)
    m.observe_tenant_images({"acme": 2, "globex": 3, "initech": 1})
    m.observe_refusal("globex", "rate_limited")
    m.observe_request("classify", 200, 0.01)
    m.observe_batch(4, 3, [0.001], 0.05)
    m.set_pinned_bots(["a2", "g1"])
    m.set_trunk(device="cpu", runtime="tf", precision="fp32")
    m.bind_tenant_state(lambda: {"acme": (1, 2.0), "globex": (3, 4.0), "initech": (5, 6.0)})
    m.bind_store(lambda: 0.1, lambda: 2)
    return m


def _samples(text: bytes) -> list[tuple[str, str, dict]]:
    return [(f.name, s.name, s.labels)
            for f in text_string_to_metric_families(text.decode()) for s in f.samples]


def test_a_tenant_keeps_its_own_series_and_the_machines_facts_only():
    full, _ = _busy().render()
    mine = scoped(full, ACME)
    for foreign in (b"globex", b"g1", b'"other"'):  # initech and i1 count under "other"
        assert foreign in full and foreign not in mine, foreign
    for family, _, labels in _samples(mine):
        assert (labels.get("tenant") == "acme" or labels.get("bot") in ACME.bots
                or family in MACHINE), (family, labels)
    names = {sample for _, sample, _ in _samples(mine)}
    assert {"multihead_bot_requests_total", "multihead_tenant_images_total",
            "multihead_tenant_queued_rows", "multihead_candidate_images_total",
            "multihead_pinned_bot", "multihead_trunk_info",
            # Facts of the machine: no tenant's traffic moves them.
            "multihead_store_snapshot_age_seconds", "multihead_store_serving_processes"} <= names
    assert not names & {"multihead_requests_total", "multihead_batch_size_count",
                        "multihead_queue_depth", "multihead_resident_heads"}


def test_a_tenant_named_other_never_reads_the_mixed_total():
    m = Metrics(top_bots=1, top_tenants=1)
    m.observe_tenant_images({"acme": 1, "other": 1, "globex": 1})
    full, _ = m.render()
    assert b'tenant="other"' in full
    assert b"tenant=" not in scoped(full, Scope("other", frozenset()))


def test_the_view_is_cut_after_the_merge_of_the_replicas():
    texts = {name: _busy().render()[0].decode() for name in ("r1", "r2")}
    merged, _ = Aggregate().merge(texts, missing=0)
    mine = scoped(merged, ACME)
    assert b"globex" not in mine and b'"other"' not in mine
    requests = [s for s in text_string_to_metric_families(mine.decode())
                if s.name == "multihead_bot_requests"][0].samples
    assert {(s.labels["bot"], s.value) for s in requests
            if s.name.endswith("_total")} == {("a1", 2.0), ("a2", 2.0)}
    assert b"multihead_metrics_replicas 2.0" in mine
