"""The resident LRU: byte budget, pins, stats. Pure logic with real (small) Heads."""
from __future__ import annotations

import numpy as np

from heads.cache import CANDIDATE, HeadCache
from heads.head import Head
from tests.support.heads import random_head


def head(bot_id: str, version: int = 1, n: int = 10) -> Head:
    w, b, labels = random_head(n)
    return Head(bot_id, version, tuple(labels), w, b)


def test_evicts_least_recently_used_within_the_budget():
    size = head("a").nbytes
    cache = HeadCache(memory_budget_bytes=3 * size)
    for bot in "abc":
        cache.put(head(bot))
    assert cache.get("a", 1) is not None  # a is now the most recently used
    cache.put(head("d"))
    assert cache.resident_bot_ids() == ["c", "a", "d"]  # b was the least recently used
    stats = cache.stats()
    assert stats["evictions"] == 1 and stats["resident_heads"] == 3
    assert stats["resident_bytes"] == 3 * size <= cache.memory_budget_bytes
    assert cache.get("b", 1) is None and cache.stats()["misses"] == 1
    assert cache.stats()["hits"] == 1


def test_budget_counts_bytes_not_heads():
    small, big = head("s", n=10), head("big", n=100)
    cache = HeadCache(memory_budget_bytes=big.nbytes + small.nbytes)
    cache.put(small)
    cache.put(head("t", n=10))
    cache.put(big)  # only the least recently used small head has to go
    assert cache.resident_bot_ids() == ["t", "big"]
    assert cache.stats()["resident_bytes"] <= cache.memory_budget_bytes


def test_pinned_heads_are_never_evicted():
    size = head("a").nbytes
    cache = HeadCache(memory_budget_bytes=2 * size, pinned={"p1", "p2"})
    cache.put(head("p1"))
    cache.put(head("p2"))
    for i in range(5):
        cache.put(head(f"x{i}"))
    resident = cache.resident_bot_ids()
    assert {"p1", "p2"} <= set(resident)
    # The budget is taken by the pins, so no unpinned head can stay.
    assert set(resident) == {"p1", "p2"}
    assert cache.stats()["pinned_resident"] == 2
    cache.put(head("p2", version=2))  # a new version of a pinned bot replaces the old one
    assert cache.get("p2", 2) is not None and cache.get("p2", 1) is None


def test_head_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    cache = HeadCache(memory_budget_bytes=head("a").nbytes * 2)
    cache.put(head("a"))
    cache.put(head("huge", n=1000))
    assert cache.resident_bot_ids() == ["a"] and cache.stats()["evictions"] == 0


def test_other_version_is_a_miss_and_retain_drops_stale():
    cache = HeadCache(memory_budget_bytes=10**9)
    cache.put(head("a", 1))
    cache.put(head("b", 1))
    assert cache.get("a", 2) is None
    cache.retain(lambda h: h.bot_id != "a")
    assert cache.resident_bot_ids() == ["b"]
    assert cache.stats()["evictions"] == 0
    assert cache.stats()["resident_bytes"] == head("b").nbytes


def test_concurrent_puts_and_gets_keep_the_accounting_exact():
    import threading

    size = head("a").nbytes
    cache = HeadCache(memory_budget_bytes=5 * size)
    heads = [head(f"b{i}") for i in range(20)]

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(300):
            h = heads[int(rng.integers(20))]
            if cache.get(h.bot_id, 1) is None:
                cache.put(h)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.stats()
    assert stats["resident_bytes"] == size * stats["resident_heads"] <= 5 * size
    assert stats["hits"] + stats["misses"] == 1200


def test_a_candidate_slot_sits_beside_the_active_head_counted_and_never_pinned():
    size = head("a").nbytes
    cache = HeadCache(memory_budget_bytes=2 * size, pinned=["a"])
    cache.put(head("a", 1))
    cache.put(head("a", 2), CANDIDATE)
    assert cache.get("a", 1).version == 1 and cache.get("a", 2, CANDIDATE).version == 2
    assert cache.get("a", 2) is None and cache.get("a", 1, CANDIDATE) is None
    assert cache.stats()["resident_bytes"] == 2 * size
    assert cache.stats()["pinned_resident"] == 1  # the bot is pinned, its candidate is not
    cache.put(head("b"))  # over the budget: the candidate goes, not the pinned head
    assert cache.resident_bot_ids() == ["a", "b"]
    cache.put(head("a", 3), CANDIDATE)
    cache.retain(lambda h: h.version != 3)  # retain sees every slot's heads
    assert cache.peek("a", 3, CANDIDATE) is None and cache.peek("a", 1) is not None
    cache.put(head("a", 3), CANDIDATE)  # a candidate is a head like the others: b goes
    assert cache.resident_bot_ids() == ["a", "a#candidate"]
    cache.discard("a", CANDIDATE)
    assert cache.resident_bot_ids() == ["a"] and cache.stats()["evictions"] == 2
