"""One Prometheus answer from the `/metrics` texts of several processes: under
`multihead serve --ray`, every model replica's (each has its own `Metrics` registry).

    aggregate = Aggregate()
    body, content_type = aggregate.merge({"r1": text_1, "r2": text_2}, missing=0)

What each metric becomes:
- **counters and histograms** (every sample: `_total`, `_bucket`, `_count`, `_sum`) are summed
  over the replicas; their `_created` is the earliest. A replica that stops answering (killed,
  replaced by a new replica under a new name, stuck) keeps its last values in the sums, so a
  sum never goes backwards while the aggregating process lives: Prometheus reads a counter that
  drops as a restart, and its `rate()` would count the surviving replicas' whole totals again.
  After `retain_s` away, a replica's last values are folded into one retired total (bounded
  memory however many replicas come and go; Ray never reuses a replica's name).
- **gauges** by their meaning (`GAUGES`): `SUM` for an amount of the whole deployment (rows
  queued, bytes in flight), `SAME` for a fact every replica states alike (value 1 per label
  set: the trunk in use, the pinned bots; the largest value is kept), and `PER_REPLICA` for a
  replica's own state (its resident heads, its scheduler's counters), one series per replica
  with a `replica` label. A gauge is a value of now: a replica that did not answer has none.
  A gauge without a rule here is kept per replica (never summed by mistake);
  `tests/service/core/test_metrics_merge.py` fails until it has one.
- two of its own (`OWN`): `multihead_metrics_replicas` (replicas whose metrics this answer
  holds) and `multihead_metrics_replicas_missing` (replicas asked that did not answer).

Not thread-safe: one caller at a time (the ingress calls it from its event loop).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

SUM, SAME, PER_REPLICA = "sum", "same", "per_replica"
REPLICA_LABEL = "replica"
# The rule of each gauge of `service.core.metrics.Metrics`.
GAUGES = {
    "multihead_queue_depth": SUM,
    "multihead_inflight_bytes": SUM,
    "multihead_tenant_queued_rows": SUM,
    "multihead_trunk_info": SAME,
    "multihead_pinned_bot": SAME,
    "multihead_resident_heads": PER_REPLICA,
    "multihead_resident_head_bytes": PER_REPLICA,
    "multihead_pinned_heads": PER_REPLICA,
    "multihead_preloaded_heads": PER_REPLICA,
    "multihead_store_snapshot_age_seconds": PER_REPLICA,
    "multihead_store_serving_processes": PER_REPLICA,
    # Each replica measured its own trunk alone (the same machine: alike, not the same).
    "multihead_trunk_alone_seconds": PER_REPLICA,
    "multihead_batch_size_working": PER_REPLICA,
    "multihead_batch_size_shared": PER_REPLICA,
    "multihead_tenant_counter": PER_REPLICA,
    # NOTE: per replica, although a bot's agreement is the same in each: which bots have a
    # label of their own, and so what "other" holds, is each replica's traffic.
    "multihead_bot_int8_agreement": PER_REPLICA,
}
SUMMED_TYPES = ("counter", "histogram")
# prometheus_client's text format gives a counter's or histogram's creation time as a gauge
# family of its own, `<name>_created`, right after it.
CREATED = "_created"
# A replica away this long is gone for good (Ray replaces a replica that fails its health
# checks within about a minute, under a new name).
RETAIN_S = 600.0

REPLICAS = "multihead_metrics_replicas"
MISSING = "multihead_metrics_replicas_missing"
OWN = {
    REPLICAS: "model replicas whose metrics this answer holds, read now (--ray only)",
    MISSING: "model replicas asked for their metrics that did not answer in time (--ray "
             "only); their last counts stay in the sums",
}

Key = tuple[str, tuple[tuple[str, str], ...]]  # sample name, label pairs
Samples = dict[str, dict[Key, float]]  # family name -> sample -> value


def describe() -> list[Metric]:
    """The aggregate's own metric families (without samples)."""
    return [Metric(name, help_text, "gauge") for name, help_text in OWN.items()]


class Aggregate:
    """Merges replicas' `/metrics` texts, remembering each replica's last counters.

    Args:
        retain_s: how long a replica that stopped answering keeps its own entry before its
            last values are folded into the retired total.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, retain_s: float = RETAIN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.retain_s = retain_s
        self._clock = clock
        self._families: dict[str, tuple[str, str]] = {}  # name -> (type, help), first seen first
        self._last: dict[str, tuple[float, Samples]] = {}  # replica -> (seen at, summed samples)
        self._retired: Samples = {}

    def merge(self, live: Mapping[str, str], missing: int = 0) -> tuple[bytes, str]:
        """The Prometheus text of the deployment and its content type.

        Args:
            live: {replica name: its `/metrics` text} of the replicas that answered now.
            missing: replicas asked that did not answer (reported, nothing else).

        Raises:
            ValueError: a text that is not the Prometheus text format (nothing is remembered
                from this call then).
        """
        parsed = {replica: list(text_string_to_metric_families(text))
                  for replica, text in live.items()}
        now = self._clock()
        gauges: Samples = {}
        for replica, families in parsed.items():
            own: Samples = {}
            for family in families:
                self._families.setdefault(family.name, (family.type, family.documentation))
                rule = self._rule(family.name, family.type)
                if rule is None:
                    own[family.name] = {_key(s.name, s.labels): s.value for s in family.samples}
                    continue
                values = gauges.setdefault(family.name, {})
                for sample in family.samples:
                    if rule == PER_REPLICA:
                        labels = {**sample.labels, REPLICA_LABEL: replica}
                        values[_key(sample.name, labels)] = sample.value
                        continue
                    key = _key(sample.name, sample.labels)
                    if key not in values:
                        values[key] = sample.value
                    elif rule == SUM:
                        values[key] += sample.value
                    else:  # SAME
                        values[key] = max(values[key], sample.value)
            self._last[replica] = (now, own)
        for replica, (seen, own) in list(self._last.items()):
            if replica not in live and now - seen > self.retain_s:
                _add(self._retired, own)
                del self._last[replica]
        totals: Samples = {}
        _add(totals, self._retired)
        for _, own in self._last.values():
            _add(totals, own)
        families = [_family(name, kind, help_text, totals.get(name) or gauges.get(name) or {})
                    for name, (kind, help_text) in self._families.items()]
        families += [_family(REPLICAS, "gauge", OWN[REPLICAS], {(REPLICAS, ()): len(live)}),
                     _family(MISSING, "gauge", OWN[MISSING], {(MISSING, ()): missing})]
        return generate_latest(_Families(families)), CONTENT_TYPE_LATEST

    def _rule(self, name: str, kind: str) -> str | None:
        """None: summed and remembered (counters, histograms and their `_created`); else the
        gauge rule."""
        if kind in SUMMED_TYPES:
            return None
        base = name.removesuffix(CREATED)
        if base != name and self._families.get(base, ("",))[0] in SUMMED_TYPES:
            return None
        return GAUGES.get(name, PER_REPLICA)


def _key(name: str, labels: Mapping[str, str]) -> Key:
    return name, tuple(labels.items())


def _add(into: Samples, samples: Samples) -> None:
    """Sums `samples` into `into`; a `_created` sample keeps the earliest time."""
    for family, values in samples.items():
        target = into.setdefault(family, {})
        for key, value in values.items():
            if key not in target:
                target[key] = value
            elif key[0].endswith(CREATED):
                target[key] = min(target[key], value)
            else:
                target[key] += value


def _family(name: str, kind: str, help_text: str, values: Mapping[Key, float]) -> Metric:
    family = Metric(name, help_text, kind)
    for (sample, labels), value in values.items():
        family.add_sample(sample, dict(labels), value)
    return family


class _Families:
    """What `generate_latest` reads: anything with `collect()`."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families

