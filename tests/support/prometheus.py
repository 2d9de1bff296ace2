"""Reading a /metrics text in tests, through the one parser of Prometheus text
(`bench.prometheus`, which tests also import directly for whole-text views: `samples`,
`by_labels`, `histograms`)."""
from __future__ import annotations

from bench.prometheus import value


def metric(text: str, series: str) -> float:
    """The value of `series` in a /metrics text, written as the text writes it (`name`, or
    `name{label="value",...}` in any label order); 0 if absent but named with labels, as a
    labelled counter appears only once it moved. An unlabelled series must be there."""
    found = value(text, series)
    if found is not None:
        return found
    if "{" in series:
        return 0.0
    raise AssertionError(f"{series} not in metrics")
