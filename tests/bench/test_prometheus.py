"""The one parser of /metrics text (`bench.prometheus`), on a real `Metrics` render: every sample
reads back as the registry holds it (counters, gauges, histograms with and without labels, a
label value that needs escaping), and each view (`value`, `by_labels`, `unlabelled`,
`histograms`) gives what its callers read; a text giving a family or a sample twice is refused.
Pure logic, no TensorFlow."""
from __future__ import annotations

import math

import pytest

from bench.prometheus import (
    Histogram,
    by_labels,
    histograms,
    parse,
    samples,
    series,
    unlabelled,
    value,
)
from service.core.metrics import Metrics

# A tenant name that the text format must escape: a quote, a backslash, a newline.
ODD = 'acme "eu"\\west\nbis'
ODD_TEXT = 'acme \\"eu\\"\\\\west\\nbis'  # the same, as it appears inside a label value


def render(batches: tuple[int, ...] = (1, 3, 16)) -> tuple[Metrics, str]:
    """A `Metrics` after some traffic of every kind, and its /metrics text."""
    m = Metrics(top_bots=2, top_tenants=2)
    m.observe_request("classify", 200, 0.25)
    m.observe_request("classify", 200, 0.5)
    m.observe_request("oip_infer", 429, 0.01)
    m.observe_request("classify_ws", 101)
    for size in batches:
        m.observe_batch(size, 2, [0.001] * size, 0.1)
    m.observe_cache(True, 3)
    m.observe_cache(False)
    m.observe_bot("alpha", 4)
    m.observe_tenant_images({"acme": 5, ODD: 2})
    m.observe_refusal(ODD, "rate_limited")
    m.set_resident_heads(7, 7 * 1024)
    m.set_pinned_bots(["alpha"])
    m.set_trunk(device="cpu", runtime="tf", precision="fp32")
    return m, m.render()[0].decode()


def registry_samples(m: Metrics) -> dict:
    """What the registry holds, read without any text: the parser's ground truth."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in m.registry.collect() for s in family.samples}


def test_every_sample_of_a_real_render_reads_back_as_the_registry_holds_it():
    m, text = render()
    assert ODD_TEXT in text  # the render escaped it, and the parser must unescape it
    parsed = samples(text)
    assert parsed == registry_samples(m)
    # Each kind is there: a labelled counter, a labelled histogram's buckets, an unlabelled
    # histogram, a gauge, a labelled gauge with empty label values.
    assert parsed[("multihead_requests_total", (("route", "classify"), ("status", "200")))] == 2
    assert parsed[("multihead_request_seconds_bucket",
                   (("le", "+Inf"), ("route", "classify")))] == 2
    assert parsed[("multihead_batch_size_count", ())] == 3
    assert parsed[("multihead_resident_heads", ())] == 7
    assert parsed[("multihead_tenant_refusals_total", (("code", "rate_limited"),
                                                        ("tenant", ODD)))] == 1
    kinds = {s.family: s.kind for s in parse(text)}
    assert (kinds["multihead_requests"], kinds["multihead_batch_size"],
            kinds["multihead_resident_heads"]) == ("counter", "histogram", "gauge")


def test_a_series_is_found_as_the_text_writes_it_labels_in_any_order():
    _, text = render()
    assert value(text, 'multihead_requests_total{route="classify",status="200"}') == 2
    assert value(text, 'multihead_requests_total{status="429",route="oip_infer"}') == 1
    assert value(text, f'multihead_tenant_images_total{{tenant="{ODD_TEXT}"}}') == 2
    assert value(text, "multihead_feature_cache_hits_total") == 3
    assert value(text, "multihead_batch_size_sum") == 20
    # A WebSocket is counted, not timed: no latency series for its route.
    assert value(text, 'multihead_request_seconds_count{route="classify_ws"}') is None
    assert value(text, "multihead_no_such_total") is None
    assert series('a_total{b="1",a="x \\"y\\""}') == ("a_total", (("a", 'x "y"'), ("b", "1")))


def test_labelled_series_are_keyed_by_their_label_values_sorted_by_label_name():
    _, text = render()
    assert by_labels(text, "multihead_tenant_refusals_total") == {f"rate_limited {ODD}": 1.0}
    assert by_labels(text, "multihead_tenant_images_total") == {"acme": 5.0, ODD: 2.0}
    assert by_labels(text, "multihead_requests_total") == {
        "classify 200": 2.0, "oip_infer 429": 1.0, "classify_ws 101": 1.0}
    assert by_labels(text, "multihead_pinned_bot") == {"alpha": 1.0}
    assert by_labels(text, "multihead_resident_heads") == {}  # unlabelled
    assert by_labels(text, "multihead_no_such_total") == {}


def test_unlabelled_reads_the_unlabelled_gauges_and_counters_only():
    _, text = render()
    plain = unlabelled(text)
    assert plain["multihead_resident_heads"] == 7
    assert plain["multihead_feature_cache_hits_total"] == 3
    assert plain["multihead_feature_cache_misses_total"] == 1
    # Not a histogram's sum or count, nor a labelled series.
    assert "multihead_batch_size_sum" not in plain and "multihead_batch_size_count" not in plain
    assert not any(name.startswith("multihead_requests") for name in plain)


def test_histograms_and_the_difference_of_two_scrapes():
    _, before_text = render((1, 16))
    _, after_text = render((1, 16, 2, 3, 4, 8, 16, 16))
    before, after = histograms(before_text), histograms(after_text)
    assert "multihead_request_seconds" not in after  # labelled: keyed with its labels
    assert after["multihead_request_seconds{route=classify}"].count == 2
    assert after["multihead_request_seconds{route=classify}"].sum == pytest.approx(0.75)
    assert "multihead_requests" not in after  # a counter
    h = after["multihead_batch_size"].minus(before["multihead_batch_size"])
    assert h.count == 6
    assert h.sum == pytest.approx(2 + 3 + 4 + 8 + 16 + 16)
    assert h.mean == pytest.approx(49 / 6)
    assert h.distribution() == {"<=1": 0, "2": 1, "3-4": 2, "5-8": 1, "9-16": 2, "17-32": 0,
                                "33-64": 0, ">64": 0}
    assert after["multihead_batch_size"].minus(None) is after["multihead_batch_size"]
    assert math.isnan(Histogram({1.0: 0.0}, 0.0, 0.0).mean)
    assert histograms("") == {}


@pytest.mark.parametrize("text, says", [
    ("# TYPE a counter\na_total 1\n# TYPE b gauge\nb 1\n# TYPE a counter\na_total 2\n",
     "family 'a' given twice"),
    ('# TYPE a gauge\na{x="1"} 1\na{x="1"} 2\n', "given twice"),
    ("multihead_requests_total{ 1\n", None),
])
def test_a_text_that_is_not_one_exposition_is_refused(text, says):
    with pytest.raises(ValueError, match=says):
        parse(text)
