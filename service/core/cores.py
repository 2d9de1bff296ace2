"""Who runs on the machine's cores: the trunk alone, or the image decoders.

On a CPU the trunk's runtime (OpenVINO, TensorFlow) runs each layer on one thread per core and
waits for the slowest thread; a core taken by a decode thread stalls the whole batch. Measured
on 2 cores (issue 31): a batch took 136 ms inside the server against 73 ms alone, and a decode
9.6 ms against 4.1. So the engine never runs the two at once: decoding is a shared hold (any
number of decode threads together), the trunk an exclusive one, like a readers-writer lock with
the writer preferred:

- `trunk()` waits for the decodes already running to finish, then runs alone; decodes that
  start meanwhile wait for it. A decode is ~5 ms; a hostile one (a 36-megapixel PNG) may take
  seconds, so the trunk waits at most `max_trunk_wait_s` for running decodes and then runs
  beside them, as it did before this gate existed (counted in `trunk_waits_given_up`).
- `decode()` runs at once unless the trunk runs or waits, or a batch was taken for it
  (`reserve`); then it waits for the trunk's batch to finish. The time decodes spend waiting
  goes to `on_wait(seconds)`.
- `reserve()` (the batcher's, on the event loop, as it takes a batch) holds the cores for that
  batch from then on: between the take and the trunk's start (the hand-off to the batch
  thread, the stacking) decodes used to start and the trunk then waited for them (`trunk()`
  waits for running decodes). The hold passes to `trunk()`, or is given back by
  `unreserve()` (a batch with no trunk work: all its features cached). Measured
  on 2 Xeon cores (OpenVINO bf16, 48 closed-loop clients and a quiet one, a temporary log of
  every take, decode and trunk start): the trunk started 3.1 ms after the take (p50, fair)
  and 6.2 ms (fifo) before, 1.7 and 3.6 ms with the hold; fifo's flood in batches of 4 ran
  +4.1, +8.5, +0.8, +1.9 and -1.7 % images/s with it in five pairs of runs (median +1.9 %:
  about the spread of one run).

The heads' matrix products (numpy, after each batch) run on one BLAS thread when the trunk owns
the cores (`one_blas_thread`): OpenBLAS's own pool would wake a worker for every product of 7
rows or more, which then spins for a while after it, on one of the trunk's two cores, while the
next batch runs. Measured on 2 Xeon cores (OpenVINO bf16, 48 closed-loop clients, one run
each): a batch of 8 ran 138 ms in the server against 95 ms alone with the pool at 2 threads,
92 ms with 1 (47 -> 69 images/s); a batch of 16 210 ms -> 177 ms (60 -> 73 images/s). A head's
product takes 0.5 ms on 16 rows on one thread.

Decodes therefore run between trunk batches, all decode threads together, and the batcher
gathers the rows they finish into the next batch (`Batcher(gather_booked=True)`): the trunk's
cores idle for one batch's decoding, instead of every batch running at the speed of its
slowest, disturbed thread.

Without `exclusive` (a GPU trunk, whose work is not on these cores; `--no-own-cores`; a fake
trunk in tests) both holds are free: nothing waits.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

# How long the trunk waits for decodes already running before it runs beside them.
MAX_TRUNK_WAIT_S = 0.25


class Cores:
    """The gate between the trunk and the decode threads. Thread-safe.

    Args:
      exclusive: whether the trunk runs alone (see the module's docstring); False: no waiting.
      on_wait: told how long each decode waited for the trunk (seconds), in the decode's thread.
      max_trunk_wait_s: the most the trunk waits for decodes already running.
      clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, exclusive: bool, *, on_wait: Callable[[float], None] | None = None,
                 max_trunk_wait_s: float = MAX_TRUNK_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not max_trunk_wait_s >= 0:
            raise ValueError(f"max_trunk_wait_s must be >= 0, got {max_trunk_wait_s!r}")
        self.exclusive = bool(exclusive)
        self._on_wait = on_wait
        self._max_trunk_wait_s = float(max_trunk_wait_s)
        self._clock = clock
        self._cond = threading.Condition()
        self._decoding = 0  # decodes running
        self._trunk = 0  # trunk holds running or waiting (the batch thread: at most one)
        self._waiting = 0  # decodes waiting for the trunk
        self._reserved = False  # a batch was taken for the trunk (`reserve`)
        self.trunk_waits_given_up = 0

    @property
    def decodes_waiting(self) -> int:
        """Decodes waiting for the trunk's batch to finish."""
        return self._waiting

    @property
    def decoding(self) -> int:
        """Decodes running now."""
        return self._decoding

    @property
    def reserved(self) -> bool:
        """Whether a batch was taken for the trunk and its trunk has not started yet."""
        return self._reserved

    def _held(self) -> bool:
        return bool(self._trunk) or self._reserved

    @contextlib.contextmanager
    def decode(self) -> Iterator[None]:
        """Hold the cores shared, for one image's decode: waits while the trunk runs or waits,
        or a batch is reserved for it."""
        if not self.exclusive:
            yield
            return
        waited = None
        with self._cond:
            if self._held():
                start = self._clock()
                self._waiting += 1
                try:
                    self._cond.wait_for(lambda: not self._held())
                finally:
                    self._waiting -= 1
                waited = self._clock() - start
            self._decoding += 1
        if waited is not None and self._on_wait is not None:
            self._on_wait(waited)
        try:
            yield
        finally:
            with self._cond:
                self._decoding -= 1
                if not self._decoding:
                    self._cond.notify_all()

    def reserve(self) -> Callable[[], None]:
        """Hold the cores for a batch just taken, until its `trunk()` takes the hold over:
        decodes not started yet wait. Returns `unreserve`, to call once the batch is done (it
        gives back a hold its batch did not take: no trunk work)."""
        if self.exclusive:
            with self._cond:
                self._reserved = True
        return self.unreserve

    def unreserve(self) -> None:
        """Give back a hold `reserve` took that no `trunk()` took over (else nothing)."""
        with self._cond:
            if self._reserved:
                self._reserved = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def trunk(self) -> Iterator[None]:
        """Hold the cores alone, for one trunk batch: new decodes wait; running ones are waited
        for (at most `max_trunk_wait_s`). Takes over a hold `reserve` took."""
        if not self.exclusive:
            yield
            return
        with self._cond:
            self._trunk += 1
            self._reserved = False
            if not self._cond.wait_for(lambda: not self._decoding,
                                       timeout=self._max_trunk_wait_s):
                self.trunk_waits_given_up += 1
        try:
            yield
        finally:
            with self._cond:
                self._trunk -= 1
                self._cond.notify_all()


def one_blas_thread() -> None:
    """Limits the BLAS libraries numpy loaded (OpenBLAS) to one thread, for the whole process
    (see the module's docstring: their spinning workers take a core from the trunk). The
    limit stays (`threadpoolctl.threadpool_limits` called, not entered)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def blas_threads() -> int | None:
    """The most threads any BLAS library loaded in this process may use now (None: none
    loaded). Scans the loaded libraries: read once (`Engine.blas_threads`)."""
    from threadpoolctl import threadpool_info

    counts = [int(pool["num_threads"]) for pool in threadpool_info()
              if pool.get("user_api") == "blas"]
    return max(counts) if counts else None


__all__ = ["Cores", "MAX_TRUNK_WAIT_S", "blas_threads", "one_blas_thread"]
