"""Statistics and load-shape helpers of the benchmark: percentiles, Zipf bot popularity, Poisson
arrivals, Prometheus histogram deltas, process RSS, machine facts.

Pure numpy / stdlib; no TensorFlow, no aiohttp (importing this is cheap).
"""
from __future__ import annotations

import math
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# -- latency summaries ---------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return math.nan
    return float(np.percentile(arr, q))


def summarize(values_s: Sequence[float]) -> dict[str, float]:
    """Latency summary in milliseconds: n, mean, p50, p95, p99, min, max (NaN when empty)."""
    ms = [v * 1000.0 for v in values_s]
    return {
        "n": len(ms),
        "mean_ms": float(np.mean(ms)) if ms else math.nan,
        "p50_ms": percentile(ms, 50),
        "p95_ms": percentile(ms, 95),
        "p99_ms": percentile(ms, 99),
        "min_ms": min(ms) if ms else math.nan,
        "max_ms": max(ms) if ms else math.nan,
    }


# -- load shapes ------------------------------------------------------------------------------

def zipf_weights(n: int, s: float = 1.0) -> np.ndarray:
    """Popularity of n items under Zipf's law: p(rank k) proportional to 1 / k**s, k = 1..n."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not s >= 0:
        raise ValueError(f"s must be >= 0, got {s}")
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


class ZipfSampler:
    """Draws item indices 0..n-1 with Zipf popularity (index 0 the most popular). Seeded."""

    def __init__(self, n: int, s: float = 1.0, seed: int = 0) -> None:
        self.n = n
        self.s = s
        self.p = zipf_weights(n, s)
        self._cdf = np.cumsum(self.p)
        self._cdf[-1] = 1.0  # guard against round-off leaving a gap at the top
        self._rng = np.random.default_rng(seed)

    def sample(self, size: int | None = None):
        """One index (size=None) or an int64 array of `size` indices."""
        u = self._rng.random(size)
        idx = np.searchsorted(self._cdf, u, side="right")
        return int(idx) if size is None else idx.astype(np.int64)


def poisson_arrivals(rate_per_s: float, count: int, seed: int = 0) -> np.ndarray:
    """Arrival times (s, from 0) of `count` events of a Poisson process of the given rate.

    Inter-arrival gaps are exponential with mean 1 / rate; the first event comes after one gap.
    """
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=count))


# -- Prometheus ---------------------------------------------------------------------------------

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


def parse_histograms(text: str) -> dict[str, Histogram]:
    """Histograms of a Prometheus text exposition. An unlabelled histogram is keyed by its base
    name ("multihead_batch_size"); a labelled one by name and labels
    ("multihead_request_seconds{route=classify}", labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        series: dict[str, dict] = {}
        for sample in family.samples:
            labels = sorted((k, v) for k, v in sample.labels.items() if k != "le")
            key = family.name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}"
                                 if labels else "")
            entry = series.setdefault(key, {"buckets": {}, "sum": 0.0, "count": 0.0})
            if sample.name.endswith("_bucket"):
                entry["buckets"][float(sample.labels["le"])] = float(sample.value)
            elif sample.name.endswith("_sum"):
                entry["sum"] = float(sample.value)
            elif sample.name.endswith("_count"):
                entry["count"] = float(sample.value)
        for key, entry in series.items():
            out[key] = Histogram(entry["buckets"], entry["sum"], entry["count"])
    return out


def parse_gauges(text: str) -> dict[str, float]:
    """Unlabelled gauges and counters of a Prometheus text exposition, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("gauge", "counter", "untyped"):
            continue
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = float(sample.value)
    return out


# -- processes and the machine --------------------------------------------------------------

def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size (VmRSS of /proc/<pid>/status) in bytes; 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts(tf_version: str | None = None) -> dict:
    """CPU model, cores, memory, OS and library versions, for the report header."""
    mem = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    from backbone.device import cpu_flags  # the one place that reads the CPU's flags

    flags = cpu_flags()
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": affinity,
        "cpu_simd": simd,
        "memory_bytes": mem,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "tensorflow": tf_version,
        "load_average_at_start": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(np.mean(values)) if values else math.nan


def num(value) -> float:
    """`value` as a float; NaN when it is None or not a number."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def ratio(numerator: float | None, denominator: float | None) -> float:
    """numerator / denominator, NaN when either is missing, NaN or the denominator is 0."""
    if numerator is None or denominator is None:
        return math.nan
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator


def get_path(data: Mapping, path: str, default=None):
    """data["a"]["b"]["c"] for path "a.b.c", or `default` when any step is missing."""
    node = data
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return default
        node = node[key]
    return node
