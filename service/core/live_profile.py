"""The trunk's time per batch as it runs in this server (issue 32, item 1: the profile
refreshed from live batches).

The warm-up profile (`backbone.profile.BatchProfile`) measures each batch size alone. Inside
the server the same batch takes longer when decoding, the event loop and the client share the
cores (measured on 2 Xeon cores: a batch of 8 ran 129-132 ms in the server against 90 ms
alone), and the machine's speed drifts. `LiveProfile` follows the live batches: per batch size
an exponentially weighted mean of its runs (weight ALPHA for the newest), and for a size not
run yet its time alone times the live / alone ratio of the sizes that did run.

What reads which: deadlines (`service.core.schedule.Schedule`: admission, the rows that can
no longer make theirs, a batch's most urgent rows) must be met in fact, so they read `upper`: the
mean plus UPPER_DEVIATIONS x the size's mean absolute deviation (EWMA too), a batch's time
that the live batches rarely exceed.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

ALPHA = 0.2  # the newest batch's weight in a size's running mean
UPPER_DEVIATIONS = 3.0  # `upper`: the mean + this many mean absolute deviations
# A size run fewer times than this has not shown its spread yet: `upper` gives it at least the
# relative deviation of the sizes run more (its first run alone would say none).
FEW_RUNS = 5


class LiveProfile:
    """Seconds per batch by size, from live batches over the times alone. Thread-safe: the
    batch thread observes, the event loop reads.

    Args:
        alone: the warm-up profile's seconds for a batch of n alone (`seconds_at`).
    """

    def __init__(self, alone: Callable[[int], float], alpha: float = ALPHA) -> None:
        self._alone = alone
        self._alpha = alpha
        self._live: dict[int, float] = {}
        self._spread: dict[int, float] = {}  # EWMA of |run - mean| per size
        self._runs: dict[int, int] = {}  # batches run per size
        self._last: float | None = None  # the last batch's seconds, until `took` reads it
        self._lock = threading.Lock()

    def observe(self, n: int, seconds: float) -> None:
        """A batch of `n` images that ran `seconds` in the server."""
        if n < 1 or not seconds > 0:
            return
        with self._lock:
            self._last = seconds
            self._runs[n] = self._runs.get(n, 0) + 1
            mean = self._live.get(n)
            if mean is None:
                self._live[n], self._spread[n] = seconds, 0.0
                return
            self._live[n] = mean + self._alpha * (seconds - mean)
            self._spread[n] += self._alpha * (abs(seconds - mean) - self._spread[n])

    def took(self) -> float | None:
        """The trunk's seconds in the batch observed last, once (None after: a batch that
        ran no trunk observes nothing), for the work around it (`Schedule.around_s`)."""
        with self._lock:
            last, self._last = self._last, None
            return last

    def seconds(self, n: int) -> float:
        """The time a batch of `n` takes here now: its live mean, else its time alone times
        the live / alone ratio of the sizes run (1 before any)."""
        with self._lock:
            live = dict(self._live)
        if n in live:
            return live[n]
        ratios = [t / self._alone(k) for k, t in live.items() if self._alone(k) > 0]
        return self._alone(n) * (sum(ratios) / len(ratios) if ratios else 1.0)

    def upper(self, n: int) -> float:
        """A batch of `n`'s time that live batches rarely exceed: `seconds(n)` plus
        UPPER_DEVIATIONS x its mean absolute deviation (for a size run fewer than FEW_RUNS
        times, at least its mean x the deviation relative to the mean of the sizes run more;
        for a size not run yet, that of the sizes run)."""
        with self._lock:
            live, spread, runs = dict(self._live), dict(self._spread), dict(self._runs)
        mean = self.seconds(n)
        if n in spread:
            deviation = spread[n]
            if runs[n] < FEW_RUNS:
                shown = [spread[k] / t for k, t in live.items() if t > 0 and runs[k] >= FEW_RUNS]
                deviation = max(deviation, mean * (sum(shown) / len(shown) if shown else 0.0))
            return mean + UPPER_DEVIATIONS * deviation
        relative = [spread[k] / t for k, t in live.items() if t > 0]
        return mean * (1 + UPPER_DEVIATIONS * (sum(relative) / len(relative) if relative else 0))

    def report(self) -> dict[str, float]:
        """{batch size: live ms} of the sizes run, for the full /readyz."""
        with self._lock:
            return {str(n): round(1000 * t, 3) for n, t in sorted(self._live.items())}
