"""The leases part of a directory store (`store.leases`): `processes.sqlite` beside the registry,
a SQLite file of its own (WAL), so that a beat every few seconds moves neither the registry's
`PRAGMA data_version` (every process would read its rows again) nor its writer lock. Made by the
first beat of a serving process (with the store directory, if it is missing); the table is
rendered from `store.schema.LEASE_TABLE`. Time: this machine's clock (`time.time`)."""
from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from store.backend import SQLITE
from store.leases import Lease, Leases
from store.schema import lease_statements

PROCESSES_NAME = "processes.sqlite"
_BUSY_TIMEOUT_S = 5.0


class DirectoryLeases(Leases):
    """The leases of the serving processes of one store directory.

    Args:
        root: the store directory.
        clock: seconds since the epoch (tests pass a fake one).
    """

    def __init__(self, root: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(root) / PROCESSES_NAME
        self._clock = clock
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    def _connect(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError("the head store is closed")
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")  # a lost beat is made again in 2 s
                for statement in lease_statements(SQLITE):
                    conn.execute(statement)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def beat(self, lease: Lease, ttl_s: float) -> int:
        with self._lock:
            conn = self._connect()
            now = self._clock()
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(
                    "INSERT INTO serving_processes VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) "
                    "DO UPDATE SET seen = excluded.seen",
                    (lease.id, lease.host, lease.pid, lease.started, now))
                conn.execute("DELETE FROM serving_processes WHERE seen < ?", (now - ttl_s,))
                (count,) = conn.execute("SELECT count(*) FROM serving_processes").fetchone()
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return int(count)

    def leave(self, lease_id: str) -> None:
        with self._lock:
            if self._conn is None and not self.path.exists():
                return  # nothing was ever leased here
            self._connect().execute("DELETE FROM serving_processes WHERE id = ?", (lease_id,))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None
