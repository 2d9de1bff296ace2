"""Connections of a PostgreSQL store: a small pool of idle autocommit connections, and what a
lost connection means for a read (tried once more, or refused at once while the server is known
to be down) and for a write (never retried: its outcome is unknown)."""
from __future__ import annotations

import select
import threading
from collections.abc import Callable

import psycopg
from psycopg import conninfo as pg_conninfo
from psycopg.pq import TransactionStatus

from store.errors import InvalidStoreLocation, StoreUnavailable

# Applied unless the URL says otherwise: fail fast instead of hanging on a dead host, and notice
# a silently dead connection (keepalives, tcp_user_timeout in ms).
_CONNECT_DEFAULTS = {
    "connect_timeout": "5", "application_name": "multihead", "keepalives": "1",
    "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (psycopg's run over several)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _idle_connection_ok(conn: psycopg.Connection) -> bool:
    """An idle connection with input waiting was most likely ended by the server (restart,
    `pg_terminate_backend`): its termination message and EOF are what is waiting."""
    if conn.closed or conn.broken:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return False
    return not readable


class Pool:
    """Connections to one database. Thread-safe.

    `down` is set by whoever learns that the server is gone (the listener) and cleared when it
    is back: meanwhile reads fail at once with StoreUnavailable instead of waiting for a
    connect timeout on the lookup path.
    """

    max_idle = 4

    def __init__(self, url: str, where: str) -> None:
        """`where` is the URL as shown in messages (no password).

        Raises:
            InvalidStoreLocation: libpq cannot parse the URL.
        """
        self._where = where
        try:
            params = pg_conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise InvalidStoreLocation(
                f"malformed PostgreSQL store URL {where!r}: {first_line(exc)}") from None
        for key, value in _CONNECT_DEFAULTS.items():
            params.setdefault(key, value)
        self._params = params
        self._lock = threading.Lock()  # guards everything below
        self._idle: list[psycopg.Connection] = []
        self._closed = False
        self._down = False

    @property
    def down(self) -> bool:
        return self._down

    def connect(self) -> psycopg.Connection:
        """A new autocommit connection. Raises StoreUnavailable."""
        try:
            return psycopg.connect(autocommit=True, **self._params)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(self._unreachable(exc)) from None

    def set_down(self, down: bool) -> bool:
        """Mark the server gone (dropping the idle connections: all dead or about to be) or
        back. Returns whether it was down before."""
        with self._lock:
            was_down, self._down = self._down, down
            idle, self._idle = (self._idle, []) if down else ([], self._idle)
        for conn in idle:
            conn.close()
        return was_down

    def run(self, work: Callable[[psycopg.Connection], object], *, read: bool) -> object:
        """`work(conn)` on a pooled connection; a lost connection is StoreUnavailable.

        A read fails at once while the server is known to be down, and is tried once more on
        a new connection if its connection turns out dead. A write always tries to connect,
        and is never retried: a connection lost during COMMIT leaves its outcome unknown.
        """
        for attempt in (0, 1):
            conn = self._take(fail_fast=read)
            try:
                result = work(conn)
            except psycopg.OperationalError as exc:
                lost = conn.broken or conn.closed
                self._give(conn)
                if lost and read and attempt == 0:
                    continue
                # Not lost: the server refused the work (out of disk, cancelled, ...).
                raise StoreUnavailable(self._unreachable(exc) if lost else
                                       f"PostgreSQL store {self._where} failed: "
                                       f"{first_line(exc)}") from None
            except BaseException:
                self._give(conn)
                raise
            self._give(conn)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Close the idle connections and refuse any further work. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _unreachable(self, exc: BaseException) -> str:
        return f"PostgreSQL store {self._where} is unreachable: {first_line(exc)}"

    def _take(self, *, fail_fast: bool) -> psycopg.Connection:
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the head store is closed")
                if self._down and fail_fast:
                    raise StoreUnavailable(f"PostgreSQL store {self._where} is unreachable "
                                           "(reconnecting in the background)")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self.connect()
            if _idle_connection_ok(conn):
                return conn
            conn.close()

    def _give(self, conn: psycopg.Connection) -> None:
        reusable = (not conn.closed and not conn.broken
                    and conn.info.transaction_status == TransactionStatus.IDLE)
        with self._lock:
            if reusable and not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()
