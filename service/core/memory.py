"""Giving memory back to the OS after a burst of large uploads (glibc malloc; a no-op elsewhere).

Request bodies are large, short-lived buffers. glibc serves allocations above the mmap
threshold (128 KiB at first) with mmap and unmaps them on free, but it raises that threshold to
the size of every mmapped block it frees (up to 32 MiB): after the first 10 MB body is freed,
the next ones come from the heap arenas, and a heap with a live block on top cannot shrink. A
burst of uploads then leaves the process larger by up to the burst's size.

`Trimmer` gives that memory back once the burst is over: `ByteBudget` (service.core.admission)
calls it when the request bytes in flight have fallen from a peak by at least
TRIM_AFTER_BYTES, and it runs glibc's `malloc_trim(0)` (which releases every whole free page of
every arena, not only the top of the heap) in a thread of its own, at most once per
MIN_INTERVAL_S. The service also asks for one trim when it is ready: building and restoring
the trunk frees memory that would otherwise stay (the server's RSS at start 1.84 GB instead of
2.10 GB, OpenVINO trunk converted from TF, `multihead bench --sections overload`). That run:
RSS after 300 concurrent 10 MB uploads 0.97 x the start (the build before: 1.00 x).

NOTE: an earlier build fixed the mmap threshold at 256 KiB instead (mallopt), so that every
large buffer was mmapped and unmapped at free. That made every large buffer of the hot path
fresh pages too: the decoded image, the preprocessed array (1 MB) and TensorFlow's activation
tensors were page-faulted in on every request and every batch. Measured on a 2-core AMD EPYC:
`preprocess` of a 640x480 JPEG 13-15 ms instead of 6-9 ms, and the TF fp32 trunk at batch 1
453 ms instead of 237 ms. Trimming after bursts costs the hot path nothing between them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A trim is due once the bytes in flight have fallen by this much from their peak (and to at
# most half of it): a burst of large uploads is over, or mostly.
TRIM_AFTER_BYTES = 32 * 1024 * 1024
MIN_INTERVAL_S = 1.0  # between two trims; one asked for sooner runs when the interval ends


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class Trimmer:
    """Runs `trim` (default: glibc's malloc_trim(0)) in a thread when asked, at most once per
    `interval_s`: a request within the interval runs when it ends. Thread-safe; callable.

    Args:
      trim: what gives memory back; None: nothing to do here (not glibc).
      clock: monotonic seconds (a fake one in tests).
      start: runs a callable after a delay in seconds, off the caller's thread (tests run it
        at once).
    """

    def __init__(self, trim: Callable[[], object] | None = ..., *,
                 interval_s: float = MIN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 start: Callable[[float, Callable[[], None]], None] | None = None) -> None:
        self._trim = _malloc_trim() if trim is ... else trim
        self._interval_s = interval_s
        self._clock = clock
        self._start = start or _in_a_thread
        self._lock = threading.Lock()
        self._last = -math.inf
        self._pending = False  # a trim is started or waiting for the interval to end
        self.trims = 0  # trims run so far

    def __call__(self) -> bool:
        """Asks for a trim; False when there is nothing to trim with or one is pending."""
        if self._trim is None:
            return False
        with self._lock:
            if self._pending:
                return False
            self._pending = True
            delay = max(0.0, self._last + self._interval_s - self._clock())
        self._start(delay, self._run)
        return True

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self._trim()
        except Exception:  # noqa: BLE001 - giving memory back is best effort
            log.exception("malloc_trim failed")
        finally:
            with self._lock:
                self._last = self._clock()
                self._pending = False
                self.trims += 1
        log.debug("malloc_trim took %.1f ms", (time.perf_counter() - start) * 1000)


def _in_a_thread(delay_s: float, run: Callable[[], None]) -> None:
    timer = threading.Timer(delay_s, run)
    timer.daemon = True
    timer.name = "multihead-trim"
    timer.start()
