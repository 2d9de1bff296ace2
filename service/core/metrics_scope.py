"""What of the Prometheus text a tenant's metrics key reads: its own tenant's series only.

`/metrics` holds every tenant's traffic (`service.core.metrics`). The operator (and anyone with
`--auth none`) reads all of it; a key's caller reads the text through `scoped`, which keeps:

- a series with a `tenant` label: only its own tenant's (never `tenant="other"`: that total
  mixes the tenants without a label of their own);
- a series with a `bot` label: only its own tenant's bots (never `bot="other"`);
- a series with neither: only the machine's facts (`MACHINE`): the trunk in use and its time
  per batch alone, the store snapshot's age, the processes serving the store (their count says
  nothing of any tenant), and under Ray the replicas answering. Every other process-wide figure
  (requests by route, latency and batch histograms, queue depth, bytes in flight, feature cache
  hits, resident heads, trunk batches) counts every tenant's traffic together: a tenant would
  read the others' volume as the total minus its own. Those are the operator's.

A family left without a sample is left out. Under Ray the ingress applies the same `Scope`
after merging the replicas' texts (the replica that checked the caller puts it on its
`Reply`).

    text = scoped(body, Scope("acme", frozenset({"acme-bot"})))
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from service.core.metrics import NAMESPACE, OTHER

TENANT_LABEL, BOT_LABEL = "tenant", "bot"
# Families without a tenant or bot label that a tenant reads: facts of the machine that do not
# move with anyone's traffic.
MACHINE = frozenset({
    f"{NAMESPACE}_trunk_info",
    f"{NAMESPACE}_trunk_alone_seconds",
    f"{NAMESPACE}_store_snapshot_age_seconds",
    f"{NAMESPACE}_store_serving_processes",
    f"{NAMESPACE}_metrics_replicas",
    f"{NAMESPACE}_metrics_replicas_missing",
})


@dataclass(frozen=True)
class Scope:
    """One tenant's view: its name and its bots (the store snapshot's owners)."""

    tenant: str
    bots: frozenset[str]

    def keeps(self, family: str, labels: Mapping[str, str]) -> bool:
        """Whether a sample of `family` with `labels` is this tenant's to read."""
        if TENANT_LABEL in labels:
            return labels[TENANT_LABEL] == self.tenant != OTHER
        if BOT_LABEL in labels:
            return labels[BOT_LABEL] in self.bots and labels[BOT_LABEL] != OTHER
        return family in MACHINE


def scoped(text: bytes | str, scope: Scope) -> bytes:
    """The Prometheus text `text` with only what `scope` keeps (see the module doc).

    Raises:
        ValueError: `text` is not the Prometheus text format.
    """
    if isinstance(text, bytes):
        text = text.decode()
    kept = []
    for family in text_string_to_metric_families(text):
        samples = [s for s in family.samples if scope.keeps(family.name, s.labels)]
        if not samples:
            continue
        out = Metric(family.name, family.documentation, family.type, family.unit)
        out.samples = samples
        kept.append(out)
    return generate_latest(_Families(kept))


class _Families:
    """What `generate_latest` reads: anything with `collect()`."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families
