"""The serving processes of a store (`store.leases`): each serving process's lease, live for
`ttl_s` after its last beat, counted by every process at its beats; on both backends, and the
TTL's arithmetic on a fake clock."""
from __future__ import annotations

import logging
import sqlite3

import pytest

from store import open_store
from store.directory.leases import PROCESSES_NAME, DirectoryLeases
from store.leases import Lease, Leases
from store.processes import ServingProcesses
from tests.support.fakes import FakeClock
from tests.support.heads import pg_execute, random_head
from tests.support.polling import wait_until


def lease(name: str) -> Lease:
    return Lease(name, "host", 1, "2026-01-01T00:00:00Z")


# -- the TTL, on a fake clock ---------------------------------------------------------------------


def test_a_lease_is_live_for_its_ttl_after_its_last_beat_then_swept(tmp_path):
    clock = FakeClock(1_000_000.0)
    leases = DirectoryLeases(tmp_path, clock=clock)
    try:
        assert leases.beat(lease("a"), 10.0) == 1
        assert leases.beat(lease("b"), 10.0) == 2
        clock.advance(9.0)
        assert leases.beat(lease("a"), 10.0) == 2  # b seen 9 s ago: live
        clock.advance(1.5)
        assert leases.beat(lease("a"), 10.0) == 1  # b seen 10.5 s ago: swept
        rows = sqlite3.connect(tmp_path / PROCESSES_NAME).execute(
            "SELECT id, host, pid, started FROM serving_processes").fetchall()
        assert rows == [("a", "host", 1, "2026-01-01T00:00:00Z")]
        assert leases.beat(lease("b"), 10.0) == 2  # b beats again: made again
        leases.leave("b")
        leases.leave("b")  # gone already: nothing
        assert leases.beat(lease("a"), 10.0) == 1
    finally:
        leases.close()


class FailingLeases(Leases):
    """Counts `counts` in turn; raises where one is an exception."""

    def __init__(self, *counts) -> None:
        self.counts = list(counts)
        self.left: list[str] = []

    def beat(self, lease, ttl_s):
        count = self.counts.pop(0)
        if isinstance(count, Exception):
            raise count
        return count

    def leave(self, lease_id):
        self.left.append(lease_id)


def test_a_failed_beat_keeps_the_last_count_and_is_logged_once(caplog):
    leases = FailingLeases(3, OSError("locked"), OSError("locked"), 2)
    processes = ServingProcesses(leases, "here")
    processes.beat_s = 3600.0  # the test beats, not the thread
    assert processes.count() == 1 and not processes.joined
    processes.join()
    assert processes.count() == 3 and processes.joined
    with caplog.at_level(logging.DEBUG, logger="store.processes"):
        processes._beat()
        processes._beat()
        assert processes.count() == 3
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "locked" in warned[0].getMessage()
        processes._beat()
    assert processes.count() == 2
    processes.leave()
    processes.leave()
    assert len(leases.left) == 1
    with pytest.raises(RuntimeError):
        processes.join()


# -- both backends --------------------------------------------------------------------------------


def test_two_serving_stores_count_two_and_one_after_the_other_leaves(location):
    with open_store(location) as a, open_store(location) as b:
        for s in (a, b):
            s.processes.beat_s = 0.05
        a.processes.join()
        b.processes.join()
        assert b.processes.count() == 2  # its first beat saw a's lease
        wait_until(lambda: a.processes.count() == 2, 10, what="a counting b")
        b.close()
        wait_until(lambda: a.processes.count() == 1, 10, what="a counting b gone")


def test_a_lease_that_is_never_renewed_expires_after_the_ttl(location):
    with open_store(location) as a, open_store(location) as crashed:
        a.processes.beat_s, a.processes.ttl_s = 0.05, 0.5
        a.processes.join()
        # A process that beat once and died: its lease is written, never renewed nor deleted.
        assert crashed._backend.leases.beat(lease("crashed"), 10.0) == 2
        wait_until(lambda: a.processes.count() == 2, 10, what="a counting the dead lease")
        wait_until(lambda: a.processes.count() == 1, 10, what="the dead lease expiring")


def test_a_store_that_does_not_serve_takes_no_lease(location, tmp_path):
    with open_store(location) as s:
        s.register("acme", *random_head(3, seed=1))
        s.list()
        s.get("acme")
        assert s.processes.count() == 1 and not s.processes.joined
    if not location.startswith("postgresql"):
        assert not (tmp_path / "store" / PROCESSES_NAME).exists()
    else:
        assert pg_execute(location, "SELECT count(*) FROM multihead.serving_processes") == [(0,)]


@pytest.mark.postgresql
def test_a_postgresql_store_made_before_the_leases_gains_their_table(pg_url):
    with open_store(pg_url) as s:
        s.register("acme", *random_head(3, seed=1))
    pg_execute(pg_url, "DROP TABLE multihead.serving_processes")  # as an older version made it
    with open_store(pg_url) as s:
        s.processes.join()
        assert s.processes.count() == 1
        assert pg_execute(pg_url, "SELECT count(*) FROM multihead.serving_processes") == [(1,)]
        assert [i.bot_id for i in s.list()] == ["acme"]
    # Left at close.
    assert pg_execute(pg_url, "SELECT count(*) FROM multihead.serving_processes") == [(0,)]


def test_a_directory_store_gains_its_processes_file_at_the_first_lease(store_dir):
    with open_store(store_dir) as s:
        s.register("acme", *random_head(3, seed=1))
    assert not (store_dir / PROCESSES_NAME).exists()
    with open_store(store_dir) as s:
        s.processes.join()
        rows = sqlite3.connect(store_dir / PROCESSES_NAME).execute(
            "SELECT host, pid FROM serving_processes").fetchall()
        assert len(rows) == 1 and rows[0][1] > 0
        assert [i.bot_id for i in s.list()] == ["acme"]
    assert sqlite3.connect(store_dir / PROCESSES_NAME).execute(
        "SELECT count(*) FROM serving_processes").fetchall() == [(0,)]
