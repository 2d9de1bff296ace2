"""A Prometheus text exposition (what `GET /metrics` answers) as data: the one parser of /metrics
text for the benchmark and the tests (which import it from here; the service never does).

`parse` reads the text with prometheus_client's own parser and refuses a text that gives a
family or a sample twice; the views below are built on it:

- `samples`: {(sample name, sorted labels): value}, every sample;
- `value`: one series, written as the text writes it (`multihead_queue_depth`,
  `multihead_requests_total{route="classify",status="200"}`; labels in any order);
- `by_labels`: one sample name's labelled series, keyed by their label values;
- `unlabelled`: the unlabelled gauges and counters;
- `histograms`: every histogram as a `Histogram` (buckets, sum, count), which two scrapes subtract.

Pure stdlib and prometheus_client; no TensorFlow, no aiohttp (importing this is cheap).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]  # (name, value) pairs, sorted by name
Samples = dict[tuple[str, Labels], float]


@dataclass(frozen=True)
class Sample:
    """One sample line of an exposition.

    Attributes:
        family: its metric family's name (a counter's without `_total`, a histogram's without
            `_bucket`, `_sum`, `_count`).
        kind: its family's type: "counter", "gauge", "histogram", "summary", "info",
            "stateset", "gaugehistogram" or "unknown"/"untyped".
        name: the sample's own name (`multihead_requests_total`, `multihead_batch_size_sum`).
        labels: its labels, sorted by name, values unescaped.
        value: its value.
    """

    family: str
    kind: str
    name: str
    labels: Labels
    value: float


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in the text's order.

    Raises:
        ValueError: the text is not a Prometheus exposition (prometheus_client's parser
            refuses it), or it gives a family or a sample (name and labels) twice.
    """
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(text))
    twice = [name for name, n in collections.Counter(f.name for f in families).items() if n > 1]
    if twice:
        raise ValueError(f"family {twice[0]!r} given twice")
    out: list[Sample] = []
    seen: set[tuple[str, Labels]] = set()
    for family in families:
        for s in family.samples:
            labels = tuple(sorted(s.labels.items()))
            if (s.name, labels) in seen:
                raise ValueError(f"sample {s.name}{dict(labels)} given twice")
            seen.add((s.name, labels))
            out.append(Sample(family.name, family.type, s.name, labels, float(s.value)))
    return out


def samples(text: str) -> Samples:
    """{(sample name, sorted labels): value} of every sample of `text` (see `parse`)."""
    return {(s.name, s.labels): s.value for s in parse(text)}


def series(selector: str) -> tuple[str, Labels]:
    """The (sample name, sorted labels) of a series written as an exposition writes it:
    `name` or `name{label="value",...}` (quoted values escaped as there)."""
    found = samples(f"{selector} 0\n")
    if len(found) != 1:  # pragma: no cover - one line gives one sample or a ValueError
        raise ValueError(f"not one series: {selector!r}")
    return next(iter(found))


def value(text: str, selector: str) -> float | None:
    """The value of the series `selector` (see `series`) in `text`; None when it has none."""
    return samples(text).get(series(selector))


def by_labels(text: str, name: str) -> dict[str, float]:
    """The labelled series of the sample `name` (e.g. "multihead_tenant_images_total") by their
    label values, sorted by label name and joined with a space ("noisy", "rate_limited noisy")."""
    out: dict[str, float] = {}
    for s in parse(text):
        if s.name == name and s.labels:
            key = " ".join(v for _, v in s.labels)
            out[key] = out.get(key, 0.0) + s.value
    return out


def unlabelled(text: str) -> dict[str, float]:
    """The unlabelled samples of the gauges and counters of `text`, by sample name."""
    return {s.name: s.value for s in parse(text)
            if s.kind in ("gauge", "counter", "untyped") and not s.labels}


# -- histograms ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram as scraped: cumulative bucket counts by upper bound, sum, count."""

    buckets: dict[float, float]
    sum: float
    count: float

    def minus(self, earlier: Histogram | None) -> Histogram:
        """What was observed between `earlier` and this scrape."""
        if earlier is None:
            return self
        return Histogram({le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.sum - earlier.sum, self.count - earlier.count)

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def distribution(self) -> dict[str, float]:
        """Observations per bucket (not cumulative), keyed by the bucket's range: "<=1", "2",
        "3-4", ... ("a-b" holds the values in (a-1, b], integers being what batches have)."""
        out: dict[str, float] = {}
        prev_le, prev_c = None, 0.0
        for le in sorted(self.buckets):
            c = self.buckets[le]
            if math.isinf(le):
                key = f">{_fmt_le(prev_le)}" if prev_le is not None else "all"
            elif prev_le is None:
                key = f"<={_fmt_le(le)}"
            elif le - prev_le <= 1:
                key = _fmt_le(le)
            else:
                key = f"{_fmt_le(prev_le + 1)}-{_fmt_le(le)}"
            out[key] = c - prev_c
            prev_le, prev_c = le, c
        return out


def _fmt_le(le: float) -> str:
    return str(int(le)) if float(le).is_integer() else f"{le:g}"


def histograms(text: str) -> dict[str, Histogram]:
    """The histograms of `text`. An unlabelled histogram is keyed by its family name
    ("multihead_batch_size"); a labelled one by name and labels
    ("multihead_request_seconds{route=classify}", labels sorted)."""
    series_of: dict[str, dict] = {}
    for s in parse(text):
        if s.kind != "histogram":
            continue
        labels = [(k, v) for k, v in s.labels if k != "le"]
        key = s.family + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")
        entry = series_of.setdefault(key, {"buckets": {}, "sum": 0.0, "count": 0.0})
        if s.name.endswith("_bucket"):
            entry["buckets"][float(dict(s.labels)["le"])] = s.value
        elif s.name.endswith("_sum"):
            entry["sum"] = s.value
        elif s.name.endswith("_count"):
            entry["count"] = s.value
    return {key: Histogram(e["buckets"], e["sum"], e["count"]) for key, e in series_of.items()}
