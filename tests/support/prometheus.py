"""A Prometheus text as data, for tests that compare /metrics samples."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """{(sample name, sorted labels): value} of a Prometheus text, which must be valid: parsed
    by prometheus_client, each family and each sample given once."""
    out: Samples = {}
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families), "a family given twice"
    for family in families:
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"{key} given twice"
            out[key] = s.value
    return out
