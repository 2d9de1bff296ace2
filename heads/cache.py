"""A least-recently-used cache of resident heads, bounded by bytes, with pinned bots.

Pure logic (no I/O): the store decides what to load; this decides what stays resident.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from heads.head import Head

CANDIDATE = "candidate"


def _key(bot_id: str, slot: str) -> str:
    # NOTE: '#' is not allowed in a bot id, so a slot's key never names another bot.
    return f"{bot_id}#{slot}" if slot else bot_id


class HeadCache:
    """Resident heads keyed by bot id, at most one version per bot and slot.

    A bot's active head is in the default slot (""); its candidate's (`accounts.candidates`) in
    the slot `CANDIDATE`, a head like the others for the budget and the LRU order, but never
    pinned. Unpinned heads are evicted least recently used first whenever the resident bytes
    exceed `memory_budget_bytes`; pinned bots are never evicted (they may push the total over
    the budget, which `stats()` then shows). A head bigger than the whole budget is handed out
    but not kept. Thread-safe.
    """

    def __init__(self, memory_budget_bytes: int, pinned: Iterable[str] = ()) -> None:
        if memory_budget_bytes < 0:
            raise ValueError("memory_budget_bytes must be >= 0")
        self.memory_budget_bytes = int(memory_budget_bytes)
        self.pinned = frozenset(pinned)
        self._heads: OrderedDict[str, Head] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, bot_id: str, version: int, slot: str = "") -> Head | None:
        """The resident head of `bot_id` at `version` (in `slot`), or None (a miss)."""
        key = _key(bot_id, slot)
        with self._lock:
            head = self._heads.get(key)
            if head is None or head.version != version:
                self.misses += 1
                return None
            self._heads.move_to_end(key)
            self.hits += 1
            return head

    def peek(self, bot_id: str, version: int, slot: str = "") -> Head | None:
        """Like `get` but without touching the LRU order or the hit/miss counters."""
        with self._lock:
            head = self._heads.get(_key(bot_id, slot))
            return head if head is not None and head.version == version else None

    def put(self, head: Head, slot: str = "") -> None:
        """Make `head` resident in `slot` (replacing another version of the same bot there),
        then evict."""
        key = _key(head.bot_id, slot)
        pinned = key in self.pinned
        with self._lock:
            self._discard_locked(key)
            if not pinned and head.nbytes > self.memory_budget_bytes:
                return  # would evict everything and still not fit
            self._heads[key] = head
            self._bytes += head.nbytes
            self._evict_locked(keep=key)

    def discard(self, bot_id: str, slot: str = "") -> None:
        """Drop a bot's head (removed or replaced elsewhere); not counted as an eviction."""
        with self._lock:
            self._discard_locked(_key(bot_id, slot))

    def retain(self, keep: Callable[[Head], bool]) -> None:
        """Drop every resident head (of any slot) for which `keep(head)` is false (stale
        versions)."""
        with self._lock:
            for bot_id in [b for b, h in self._heads.items() if not keep(h)]:
                self._discard_locked(bot_id)

    def clear(self) -> None:
        with self._lock:
            self._heads.clear()
            self._bytes = 0

    def stats(self) -> dict:
        with self._lock:
            return {
                "resident_heads": len(self._heads),
                "resident_bytes": self._bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "memory_budget_bytes": self.memory_budget_bytes,
                "pinned_resident": sum(1 for b in self._heads if b in self.pinned),
            }

    def resident_bot_ids(self) -> list[str]:
        """Resident bots, least recently used first (for tests and diagnostics); a head of
        another slot than the default is listed as `<bot id>#<slot>`."""
        with self._lock:
            return list(self._heads)

    def _discard_locked(self, bot_id: str) -> None:
        old = self._heads.pop(bot_id, None)
        if old is not None:
            self._bytes -= old.nbytes

    def _evict_locked(self, keep: str) -> None:
        if self._bytes <= self.memory_budget_bytes:
            return
        for bot_id in list(self._heads):
            if self._bytes <= self.memory_budget_bytes:
                return
            if bot_id in self.pinned or bot_id == keep:
                continue
            self._discard_locked(bot_id)
            self.evictions += 1
        if self._bytes > self.memory_budget_bytes and keep not in self.pinned:
            # Only pinned heads are left besides the new one: it cannot stay.
            self._discard_locked(keep)
            self.evictions += 1
