"""The trunk's batch profile: its time per batch alone, by batch size, measured once per trunk.

`BatchProfile` holds, for batch sizes 1, 2, 4, ... up to the largest batch the server runs, the
median seconds one batch takes with nothing else running (`measure`: a fixed random batch of
each size, the first run of each size discarded: it pays the first-run costs, and so is the
warm-up). `seconds_at(n)` interpolates linearly between the measured sizes (and extrapolates
along the last segment beyond the largest). The server measures it at warm-up and keeps it as
JSON in graph_cache/ next to the trunk checkpoint (`ProfileCache`), keyed by what determines
it (`identity`: the runner, its precision and weights, the libraries, the CPU model and the
cores the process may use); a restart with the same key loads it instead of measuring
(`profile_trunk`). It is what a served batch is compared with (issue 31's "time alone") and
what a batch size or a deadline is chosen from (issue 32).

Imports no TensorFlow or OpenVINO: the trunk given does.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from backbone.device import cpu_model
from backbone.spec import IMAGE_SIZE

log = logging.getLogger(__name__)

MEASURED, CACHED = "measured", "cached"
# Timed runs per batch size, after the one discarded; the median is kept.
REPEATS = 3
# Bump when what a profile file holds, or how it is measured, changes: old files are re-measured.
FORMAT = 1
FILE_PREFIX = "batch-profile-"
# The working batch size is the smallest within this fraction of the best images/s.
WORKING_TOLERANCE = 0.05


def profile_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to `max_batch_size`, and `max_batch_size` itself when it is not a power
    of two (the largest batch the server runs is always measured)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [max_batch_size])


@dataclass(frozen=True)
class BatchProfile:
    """The trunk's time per batch alone, by batch size.

    Attributes:
      seconds: batch size -> median seconds of one batch of that size (at least one size).
      repeats: timed runs per size behind each median (after one discarded run).
      measured_at: when it was measured, ISO 8601 UTC.
      took_s: seconds the measurement took (first runs included).
      source: "measured" (by this process) or "cached" (loaded from the profile file).
      key: what it was measured for (`key_of(identity)`), "" if unknown.
      identity: what the key digests, in words (`identity`).
    """

    seconds: Mapping[int, float]
    repeats: int = REPEATS
    measured_at: str = ""
    took_s: float = 0.0
    source: str = MEASURED
    key: str = ""
    identity: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        seconds = {int(n): float(s) for n, s in sorted(self.seconds.items())}
        if not seconds:
            raise ValueError("a batch profile needs at least one batch size")
        for n, s in seconds.items():
            if n < 1 or not math.isfinite(s) or s <= 0:
                raise ValueError(f"batch {n}: {s!r} s is not a batch size and a positive time")
        object.__setattr__(self, "seconds", seconds)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The measured batch sizes, ascending."""
        return tuple(self.seconds)

    def seconds_at(self, n: float) -> float:
        """Seconds of a batch of `n` images alone: a measured size's median, else the linear
        interpolation between the two measured sizes around `n`; below the smallest or above
        the largest, the line through the nearest two (one size measured: proportional)."""
        if n <= 0:
            raise ValueError(f"batch size must be > 0, got {n}")
        sizes = self.sizes
        if n in self.seconds:
            return self.seconds[n]
        if len(sizes) == 1:
            return self.seconds[sizes[0]] * n / sizes[0]
        if n < sizes[0]:
            lo, hi = sizes[0], sizes[1]
        elif n > sizes[-1]:
            lo, hi = sizes[-2], sizes[-1]
        else:
            hi = next(size for size in sizes if size > n)
            lo = sizes[sizes.index(hi) - 1]
        s_lo, s_hi = self.seconds[lo], self.seconds[hi]
        return max(s_lo + (s_hi - s_lo) * (n - lo) / (hi - lo), 1e-9)

    def images_per_s(self, n: int) -> float:
        """Images per second at batch `n` alone."""
        return n / self.seconds_at(n)

    def working_size(self, tolerance: float = WORKING_TOLERANCE) -> int:
        """The smallest measured batch size whose images/s is within `tolerance` (a fraction)
        of the best measured: a longer batch buys less than that, and costs every waiting
        request its length (issue 32)."""
        rates = {n: self.images_per_s(n) for n in self.sizes}
        best = max(rates.values())
        return min(n for n, rate in rates.items() if rate >= (1.0 - tolerance) * best)

    def covers(self, sizes) -> bool:
        """Whether every size of `sizes` was measured."""
        return set(sizes) <= set(self.seconds)

    def report(self) -> dict:
        """For the full /readyz: {"batch_ms": {"1": ms, ...}, "images_per_s": {"1": ...},
        "working_batch_size", "source", "measured_at", "repeats", "measure_s"}."""
        return {"batch_ms": {str(n): round(s * 1e3, 3) for n, s in self.seconds.items()},
                "images_per_s": {str(n): round(self.images_per_s(n), 2) for n in self.sizes},
                "working_batch_size": self.working_size(),
                "source": self.source, "measured_at": self.measured_at,
                "repeats": self.repeats, "measure_s": round(self.took_s, 3)}

    def to_json(self) -> dict:
        return {"format": FORMAT, "key": self.key, "identity": dict(self.identity),
                "measured_at": self.measured_at, "repeats": self.repeats,
                "took_s": self.took_s,
                "seconds": {str(n): s for n, s in self.seconds.items()}}

    @classmethod
    def from_json(cls, data: Mapping) -> BatchProfile:
        """A profile read back (source "cached").

        Raises:
          ValueError: not a profile of this format (a missing field, a bad number).
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(f"not a batch profile of format {FORMAT}")
        try:
            return cls({int(n): float(s) for n, s in data["seconds"].items()},
                       repeats=int(data["repeats"]), measured_at=str(data["measured_at"]),
                       took_s=float(data.get("took_s", 0.0)), source=CACHED,
                       key=str(data["key"]),
                       identity={str(k): str(v) for k, v in data["identity"].items()})
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a batch profile: {exc!r}") from None


def measure(features: Callable[[np.ndarray], object], sizes, *, repeats: int = REPEATS,
            clock: Callable[[], float] = time.perf_counter) -> BatchProfile:
    """Runs one fixed random batch of each size `1 + repeats` times through `features` (a
    trunk's `features`), discards the first run of each size and keeps the median of the rest.

    The batch is the same for every run (seeded uniform values in [-1, 1], the trunk's input
    range), so the time is the trunk's alone, not the data's."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sizes = sorted(set(int(n) for n in sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {sizes}")
    start = clock()
    batch = np.random.default_rng(0).uniform(
        -1.0, 1.0, (sizes[-1], IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.float32)
    seconds = {}
    for n in sizes:
        images = batch[:n]
        features(images)  # first run of this size: first-run costs (kernels, memory), discarded
        runs = []
        for _ in range(repeats):
            t0 = clock()
            features(images)
            runs.append(clock() - t0)
        seconds[n] = statistics.median(runs)
    return BatchProfile(seconds, repeats=repeats, measured_at=_now(), took_s=clock() - start)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- what a profile is measured for ---------------------------------------------------------------

def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _files_state(prefix: str) -> str:
    """The checkpoint's files by path, size and modification time (no content read: a start
    must not hash the official checkpoint's 170 MB for this)."""
    index = Path(f"{prefix}.index")
    files = ([index, *sorted(index.parent.glob(f"{index.name[:-len('.index')]}.data-*"))]
             if index.exists() else [Path(prefix)])
    parts = []
    for path in files:
        try:
            st = path.stat()
        except OSError:
            parts.append(f"{path.resolve()}:missing")
            continue
        parts.append(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def cores() -> int:
    """The CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def identity(trunk) -> dict[str, str]:
    """What a trunk's batch profile depends on, in words: its runtime, precision (and an INT8
    trunk's float layers and calibration set), device, runner code, the libraries that run it,
    the checkpoint's files (path, size, modification time), the CPU model and the cores this
    process may use (its thread count follows from them)."""
    runner = getattr(trunk, "runner", None)
    source = inspect.getsourcefile(type(runner)) if runner is not None else None
    calibration = getattr(trunk, "calibration", None)
    return {
        "runtime": str(getattr(trunk, "runtime", "tf")),
        "precision": str(getattr(trunk, "precision", "fp32")),
        "float_precision": str(getattr(trunk, "float_precision", None) or ""),
        "calibration": calibration.digest if calibration is not None else "",
        "device": str(trunk.device),
        "runner": (hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]
                   if source else type(runner).__name__),
        "libraries": f"tensorflow {_dist_version('tensorflow')}, "
                     f"openvino {_dist_version('openvino')}",
        "checkpoint": _files_state(str(trunk.checkpoint_prefix)),
        "cpu": cpu_model(),
        "cores": str(cores()),
        "env_threads": ",".join(f"{name}={os.environ[name]}" for name in
                                ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")
                                if name in os.environ),
    }


def key_of(ident: Mapping[str, str]) -> str:
    """A short digest of an identity: the profile file's name and its check."""
    text = json.dumps(dict(ident), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ProfileCache:
    """A trunk's profile file, `<dir>/batch-profile-<key>.json`.

    A file that cannot be read or parsed, or whose key or identity is not this trunk's, is
    ignored (logged) and measured over; a directory that cannot be written only costs the next
    start a measurement.
    """

    def __init__(self, directory: str | os.PathLike, ident: Mapping[str, str]):
        self.identity = dict(ident)
        self.key = key_of(self.identity)
        self.path = Path(directory) / f"{FILE_PREFIX}{self.key}.json"

    def load(self, sizes=()) -> BatchProfile | None:
        """The saved profile if it is this trunk's and covers `sizes`, else None."""
        if not self.path.exists():
            return None
        try:
            profile = BatchProfile.from_json(json.loads(self.path.read_text()))
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            log.warning("ignoring unusable batch profile %s: %s", self.path, exc)
            return None
        if profile.key != self.key or dict(profile.identity) != self.identity:
            log.warning("ignoring batch profile %s: measured for another trunk or machine",
                        self.path)
            return None
        if not profile.covers(sizes):
            log.info("batch profile %s lacks batch sizes %s: measuring again", self.path,
                     sorted(set(sizes) - set(profile.sizes)))
            return None
        if sizes:  # a larger max batch size measured before: only the sizes run now
            profile = replace(profile, seconds={n: profile.seconds[n] for n in sizes})
        return profile

    def save(self, profile: BatchProfile) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(replace(profile, key=self.key,
                                              identity=self.identity).to_json(), indent=1))
            os.replace(tmp, self.path)
        except OSError as exc:  # e.g. a read-only store: never stop the service
            log.warning("cannot write batch profile %s: %s", self.path, exc)


def profile_trunk(trunk, *, max_batch_size: int, cache_dir: str | os.PathLike | None,
                  measure_if_missing: bool = True, repeats: int = REPEATS,
                  ) -> BatchProfile | None:
    """The trunk's profile for batch sizes up to `max_batch_size` (`profile_sizes`): loaded from
    `cache_dir` when a matching one is there (source "cached"), else measured through
    `trunk.features` (source "measured") and saved there; None when it is not cached and
    `measure_if_missing` is false. `cache_dir` None: measured, never saved. Blocking."""
    sizes = profile_sizes(max_batch_size)
    cache = ProfileCache(cache_dir, identity(trunk)) if cache_dir is not None else None
    found = cache.load(sizes) if cache is not None else None
    if found is not None:
        return found
    if not measure_if_missing:
        return None
    profile = measure(trunk.features, sizes, repeats=repeats)
    if cache is not None:
        profile = replace(profile, key=cache.key, identity=cache.identity)
        cache.save(profile)
    log.info("batch profile of the trunk measured in %.1fs: %s", profile.took_s,
             ", ".join(f"{n}: {s * 1e3:.0f} ms" for n, s in profile.seconds.items()))
    return profile


__all__ = ["BatchProfile", "CACHED", "MEASURED", "ProfileCache", "REPEATS", "WORKING_TOLERANCE",
           "identity",
           "key_of", "measure", "profile_sizes", "profile_trunk"]
