"""Statistics and load-shape helpers of the benchmark: percentiles, Zipf bot popularity, Poisson
arrivals, process RSS, machine facts (Prometheus text: `bench.prometheus`).

Pure numpy / stdlib; no TensorFlow, no aiohttp (importing this is cheap).
"""
from __future__ import annotations

import math
import os
import platform
from collections.abc import Iterable, Mapping, Sequence

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


def bursty_arrivals(rate_per_s: float, duration_s: float, *, factor: float = 10.0,
                    burst_s: float = 0.3, gap_s: float = 3.0,
                    seed: int = 0) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Arrival times (s, from 0, sorted) over `duration_s` of a Poisson process whose rate
    switches between a base and `factor` x the base (a two-state Markov-modulated Poisson
    process): quiet spells of exponential length (mean `gap_s`) and bursts (mean `burst_s`).
    The base is set from the spells drawn, so the expected number of arrivals is exactly
    `rate_per_s * duration_s`. Returns (arrivals, the bursts as (begin, end))."""
    if not (rate_per_s > 0 and duration_s > 0 and factor >= 1 and burst_s > 0 and gap_s > 0):
        raise ValueError("rate, duration, burst and gap must be > 0 and factor >= 1; got "
                         f"{rate_per_s}, {duration_s}, {burst_s}, {gap_s}, {factor}")
    rng = np.random.default_rng(seed)
    spells: list[tuple[float, float, float]] = []  # (begin, end, rate factor)
    t, burst = 0.0, False
    while t < duration_s:
        length = rng.exponential(burst_s if burst else gap_s)
        spells.append((t, min(t + length, duration_s), factor if burst else 1.0))
        t, burst = t + length, not burst
    weight = sum((end - begin) * f for begin, end, f in spells)
    base = rate_per_s * duration_s / weight
    arrivals = [begin + np.sort(rng.uniform(0.0, end - begin,
                                            rng.poisson(base * f * (end - begin))))
                for begin, end, f in spells]
    bursts = [(begin, end) for begin, end, f in spells if f != 1.0]
    return np.concatenate(arrivals) if arrivals else np.zeros(0), bursts


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


def cpu_seconds(pid: int | str = "self") -> float:
    """CPU time the process `pid` has used so far, all its threads, user + system (utime +
    stime of /proc/<pid>/stat), in seconds; NaN where /proc is missing or the process is gone.

    Read at two moments, the difference is the CPU the process spent in between, whatever
    its threads did (a server's event loop, decode and trunk threads)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return math.nan
    return stat_cpu_seconds(text, os.sysconf("SC_CLK_TCK"))


def stat_cpu_seconds(stat: str, ticks_per_s: int) -> float:
    """utime + stime of one /proc/<pid>/stat line, in seconds. The process name (field 2) is
    in parentheses and may hold spaces or parentheses itself, so the fields are counted from
    after its last ")": state is field 3, utime and stime fields 14 and 15."""
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime = int(fields[14 - 3]), int(fields[15 - 3])
    return (utime + stime) / ticks_per_s


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
