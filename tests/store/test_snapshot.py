"""The store as a snapshot, on both backends (`location`): the lookups read only the current
`StoreSnapshot`, never the registry; a refresher thread publishes each change; a write through
the store is read at once by the same store; the snapshot is immutable; the thread runs only
while the store is watched.

The registry reads of a serving store are blocked with `BackendReads` (a gate in front of its
bots and accounts reads) right after a change: every lookup answers at once from the last
snapshot, and the change appears once the gate opens. End to end, through a real server:
tests/service/core/test_store_snapshot.py.
"""
from __future__ import annotations

import dataclasses
import gc
import threading

import pytest

from accounts import CandidateMode, TenantLimits
from heads import UnknownBot
from store import HeadStore, StoreSnapshot, open_store
from tests.support.heads import is_pg, listening, random_head
from tests.support.polling import wait_until
from tests.support.stores import BackendReads

REFRESHER = "multihead-store-refresher"
# A gate that stays closed this long means a lookup waited for it: the test then fails on
# what it asserts instead of hanging.
GATE_SAFETY_S = 30.0


def refreshers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == REFRESHER}


def populate(store: HeadStore) -> str:
    """A tenant with a key, a live bot with a shadow candidate, a second bot not loaded yet;
    returns the key's id."""
    store.add_tenant("t1")
    key, _ = store.add_key("t1", "infer")
    store.register("acme", *random_head(3, seed=1), tenant="t1")
    store.register("acme", *random_head(3, seed=2), tenant="t1", candidate="shadow")
    store.register("cold", *random_head(2, seed=3), tenant="t1")
    return key.id


def test_lookups_answer_from_the_last_snapshot_while_the_registry_reads_block(
        location, monkeypatch):
    """Another store commits changes to every part of the snapshot; the serving store's
    refresher learns of them and blocks reading them. Meanwhile every lookup answers at once,
    from what the serving store knew, with no backend call but a cold head's blob read."""
    with open_store(location) as writer, open_store(location) as serving:
        key_id = populate(writer)
        serving.watch()
        if is_pg(location):
            listening(serving)
        assert serving.get("acme").version == 1 and serving.candidate("acme") is not None
        reads = BackendReads(serving, monkeypatch)
        reads.close(after_s=GATE_SAFETY_S)

        writer.register("beta", *random_head(2, seed=4), tenant="t1")
        writer.revoke_key(key_id)
        writer.set_tenant_limits("t1", weight=3)
        writer.promote("acme")
        assert reads.blocked.wait(GATE_SAFETY_S), "the refresher never read the change"

        assert serving.get("acme").version == 1
        assert serving.exists("acme") and not serving.exists("beta")
        with pytest.raises(UnknownBot):
            serving.get("beta")
        assert serving.owner("acme") == "t1"
        assert serving.has_candidate("acme")
        assert serving.candidate_mode("acme") == (2, CandidateMode("shadow"))
        assert serving.candidate("acme").head.version == 2
        assert key_id in serving.key_table()
        assert serving.tenant_limits()["t1"] == TenantLimits()
        assert serving.get("cold").version == 1  # not resident yet: loaded from its blobs
        assert not reads.gate.is_set(), "a lookup waited for the registry"
        assert reads.by() == ["blobs.load"]  # the cold head; nothing else, not even a poll

        reads.open()  # the change appears
        wait_until(lambda: serving.exists("beta") and key_id not in serving.key_table(), 10,
                   what="the change published")
        assert serving.get("acme").version == 2 and not serving.has_candidate("acme")
        assert serving.tenant_limits()["t1"] == TenantLimits(weight=3)
        assert serving.snapshot.keys == {}


def test_a_write_through_the_store_is_read_at_once_by_it(location, monkeypatch):
    """Read-your-writes: each write publishes its snapshot on the writer's thread before it
    returns, the refresher polling never meanwhile."""
    with open_store(location) as s:
        s.change_poll_s = 3600.0
        s.watch()
        reads = BackendReads(s, monkeypatch)
        s.add_tenant("t1")
        assert "t1" in s.tenant_limits()
        key, _ = s.add_key("t1", "infer")
        assert key.id in s.key_table()
        s.set_tenant_limits("t1", rate=5)
        assert s.tenant_limits()["t1"] == TenantLimits(rate=5)
        s.register("acme", *random_head(3, seed=1), tenant="t1")
        assert s.owner("acme") == "t1" and s.get("acme").version == 1
        s.register("acme", *random_head(3, seed=2), tenant="t1", candidate="canary:20")
        assert s.candidate_mode("acme") == (2, CandidateMode("canary", 20.0))
        assert s.promote("acme") == (1, 2) and s.get("acme").version == 2
        assert not s.has_candidate("acme")
        s.register("acme", *random_head(3, seed=3), tenant="t1", candidate="shadow")
        assert s.discard("acme") == 3 and not s.has_candidate("acme")
        assert s.rollback("acme") == 1 and s.get("acme").version == 1
        s.revoke_key(key.id)
        assert key.id not in s.key_table()
        s.remove("acme")
        assert not s.exists("acme")
        s.remove_tenant("t1")
        assert "t1" not in s.tenant_limits()
        assert "bots.active_map" in reads.by()  # read on this thread, by the writes


def test_the_snapshot_is_immutable(store):
    store.add_tenant("t1")
    store.register("acme", *random_head(3, seed=1), tenant="t1")
    before = store.snapshot
    assert isinstance(before, StoreSnapshot) and before.active == {"acme": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.active = {}
    for mapping in (before.active, before.owners, before.candidates, before.keys, before.limits):
        with pytest.raises(TypeError):
            mapping["x"] = 1
    store.register("beta", *random_head(2, seed=2))
    assert before.active == {"acme": 1}  # what a reader holds does not move under it
    assert store.snapshot.active == {"acme": 1, "beta": 1}
    assert store.snapshot.limits is before.limits  # unchanged parts: the same mapping


def test_the_refresher_runs_from_watch_or_the_first_lookup_until_close(store_dir):
    """A store that is only written to and listed (a CLI command) starts no thread."""
    before = refreshers()
    with HeadStore(store_dir) as s:
        s.add_tenant("t1")
        key, _ = s.add_key("t1", "infer")
        s.register("acme", *random_head(3, seed=1), tenant="t1")
        s.list(), s.info("acme"), s.history("acme"), s.tenants(), s.keys(), s.audit()
        s.rollback("acme", to=1), s.revoke_key(key.id)
        assert refreshers() == before
        assert s.exists("acme")  # the first lookup
        started = refreshers() - before
        assert len(started) == 1 and next(iter(started)).daemon
        s.watch()  # idempotent
        assert refreshers() - before == started
    assert not next(iter(started)).is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        s.exists("acme")
    with pytest.raises(RuntimeError, match="closed"):
        s.watch()
    with HeadStore(store_dir) as s:
        s.watch()  # the service's bring-up
        assert len(refreshers() - before) == 1 and s.exists("acme")


def test_a_store_dropped_without_close_stops_its_refresher(store_dir):
    """The thread holds its store weakly: a store nobody closed does not poll forever."""
    s = HeadStore(store_dir)
    s.watch()
    thread = s._snapshots._refresher.thread
    assert thread.is_alive()
    del s
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_snapshot_age_grows_while_the_registry_cannot_be_read(location, monkeypatch):
    """`snapshot_age_s()`: since the last poll that confirmed the snapshot; it grows while
    the refresher is stuck reading a change and falls back once the change is read."""
    with open_store(location) as writer, open_store(location) as serving:
        writer.register("acme", *random_head(3, seed=1))
        serving.change_poll_s = 0.01
        serving.watch()
        if is_pg(location):
            listening(serving)
        wait_until(lambda: serving.snapshot_age_s() < 0.5, 10, what="a fresh snapshot")
        reads = BackendReads(serving, monkeypatch)
        reads.close(after_s=GATE_SAFETY_S)
        writer.register("beta", *random_head(2, seed=2))
        assert reads.blocked.wait(GATE_SAFETY_S)
        stuck = serving.snapshot.confirmed_s
        wait_until(lambda: serving.snapshot_age_s() > 1.0, 10, what="the age growing")
        assert serving.snapshot.confirmed_s == stuck and not serving.exists("beta")
        reads.open()
        wait_until(lambda: serving.exists("beta"), 10)
        assert serving.snapshot.confirmed_s > stuck
        # Confirmed again by the next poll (the rows' time is when their version was read).
        wait_until(lambda: serving.snapshot_age_s() < 0.5, 10, what="the age falling back")
