"""Polling: wait until a condition holds, with a bound, and fail the test if it never does.

One schedule (check, then sleep `interval_s`, until `timeout_s` has passed) with two ways to
sleep between checks: `wait_until` blocks the calling thread (plain tests: stores, processes),
`until` awaits on the event loop (async tests, where blocking would stop the very work being
waited for), and `until_checked` awaits the check itself too (a request to a server). Each
returns the seconds it took, for the tests whose contract is a latency.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

What = str | Callable[[], str] | None  # what is waited for, named in the failure


class _Deadline:
    def __init__(self, timeout_s: float, what: What) -> None:
        self.start, self.timeout_s, self.what = time.monotonic(), timeout_s, what

    def reached(self, predicate: Callable[[], object]) -> bool:
        """True once `predicate()` holds; AssertionError once the time is up."""
        if predicate():
            return True
        if self.elapsed() >= self.timeout_s:
            what = self.what() if callable(self.what) else self.what
            raise AssertionError(f"{what or 'the condition'} did not hold within "
                                 f"{self.timeout_s} s")
        return False

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def wait_until(predicate: Callable[[], object], timeout_s: float = 30.0, *,
               what: What = None, interval_s: float = 0.005) -> float:
    """Seconds until `predicate()` was true; AssertionError after `timeout_s`, naming `what` (a
    text, or a function giving it then: say, the log so far)."""
    deadline = _Deadline(timeout_s, what)
    while not deadline.reached(predicate):
        time.sleep(interval_s)
    return deadline.elapsed()


async def until(predicate: Callable[[], object], timeout_s: float = 30.0, *,
                what: What = None, interval_s: float = 0.005) -> float:
    """`wait_until` on the event loop: other tasks run between the checks."""
    deadline = _Deadline(timeout_s, what)
    while not deadline.reached(predicate):
        await asyncio.sleep(interval_s)
    return deadline.elapsed()


async def until_checked(check: Callable[[], Awaitable[object]], timeout_s: float = 30.0, *,
                        what: What = None, interval_s: float = 0.005) -> float:
    """`until` with a check that must be awaited (a request to a server under test, say)."""
    deadline = _Deadline(timeout_s, what)
    while True:
        holds = await check()
        if deadline.reached(lambda holds=holds: holds):
            return deadline.elapsed()
        await asyncio.sleep(interval_s)


async def serve_ready(http, base: str, proc, output: Callable[[], str],
                      timeout_s: float = 60.0) -> float:
    """Until `GET {base}/readyz` of a `multihead serve` subprocess answers 200 (`http`: an
    aiohttp session); AssertionError with `output()` as soon as the process has exited."""
    import aiohttp

    async def ready() -> bool:
        try:
            async with http.get(f"{base}/readyz") as r:
                if r.status == 200:
                    return True
        except aiohttp.ClientConnectionError:
            pass
        assert proc.poll() is None, output()
        return False

    return await until_checked(ready, timeout_s, what=f"{base}/readyz answering 200",
                               interval_s=0.1)
