"""A server process's memory, seen from outside: VmRSS sampled in a thread, the peak (VmHWM) and
its reset, the RSS once a burst has settled. Used by the overload and soak sections.
"""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from bench.stats import rss_bytes


class RssSampler:
    """Samples a process's VmRSS every `period_s` in a thread; `peak` and `series` after."""

    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        self.pid, self.period_s = pid, period_s
        self.series: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.series.append((time.monotonic() - t0, rss_bytes(self.pid)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max((r for _, r in self.series), default=0)


def reset_peak(pid: int) -> bool:
    """Resets VmHWM (Linux: write 5 to clear_refs); False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def settle_rss(pid: int, seconds: float) -> int:
    """RSS after the burst: the lowest of the samples over `seconds` (the server may still be
    freeing the last buffers when the last answer arrives)."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(rss_bytes(pid))
        await asyncio.sleep(0.1)
    return min(samples)
