"""Where the core's blocking calls run, off the event loop: the default executor for slow work
(body parsing, registrations, store writes), and a pool of its own for lookups (heads, bot
infos, candidates: the hot path)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any

LOOKUP_THREADS = 4


class Threads:
    """The two executors of one process's service.

    NOTE: head lookups (the hot path, milliseconds at most) get their own threads, so they
    never queue behind body parsing or registrations on the default executor.
    """

    def __init__(self) -> None:
        self._lookups = concurrent.futures.ThreadPoolExecutor(
            max_workers=LOOKUP_THREADS, thread_name_prefix="multihead-lookup")

    async def blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the default executor (parsing, registrations, file writes)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def lookup(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the lookup threads (a store read for a request)."""
        return await asyncio.get_running_loop().run_in_executor(self._lookups, fn, *args)

    async def close(self) -> None:
        """Waits for the lookups under way, without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._lookups.shutdown, wait=True))
