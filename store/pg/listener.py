"""Change notification of a PostgreSQL store: a daemon thread with its own connection that
LISTENs on `multihead_heads`, and `Changes`, the state `data_version()` is made of.

A write transaction sends `NOTIFY multihead_heads, '<change_seq>'` (delivered at commit). Each
notification (or a check of `change_seq` every `poll_s`, or a reconnect) changes
`Changes.version()` and wakes its subscribers: `HeadStore`'s refresher reads the rows again at
once and publishes a new snapshot. When the
connection is lost the thread logs one warning, marks the pool down (reads fail at once with
StoreUnavailable; `HeadStore` keeps serving resident heads and its last snapshot), reconnects
with exponential backoff (`reconnect_min_s` .. `reconnect_max_s`), and after reconnecting
re-reads `change_seq`, so changes made while it was away are not missed.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable

import psycopg

from store.errors import StoreUnavailable
from store.pg.pool import Pool, first_line
from store.pg.schema import read_seq

log = logging.getLogger(__name__)

CHANNEL = "multihead_heads"


def notify(conn: psycopg.Connection, seq: int) -> None:
    """Tell every listener of change `seq`: queued now, delivered at COMMIT, dropped on
    rollback."""
    conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(seq)))


class Changes:
    """What this process knows of the store's changes: the newest change_seq and how often the
    listener (re)connected. Thread-safe."""

    def __init__(self, pool: Pool, where: str) -> None:
        self._pool = pool
        self._where = where
        self._lock = threading.Lock()
        self._generation = 0  # listener (re)connections
        self._seq: int | None = None  # newest change_seq known
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever `version()` changes (from the thread that changed it)."""
        with self._lock:
            self._subscribers.append(callback)

    def _moved(self) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback()

    @property
    def generation(self) -> int:
        return self._generation

    def version(self) -> tuple[int, int | None]:
        """Changes whenever a change was committed or the listener reconnected."""
        with self._lock:
            return self._generation, self._seq

    def saw(self, seq: int) -> None:
        """A change up to `seq` was committed (a notification, a poll, or our own write)."""
        with self._lock:
            moved = self._seq is None or seq > self._seq
            if moved:
                self._seq = seq
        if moved:
            self._moved()

    def connected(self, seq: int) -> None:
        """The listener is (again) connected and listening; `seq` read after LISTEN."""
        was_down = self._pool.set_down(False)  # reads may go to the server again...
        with self._lock:
            self._generation += 1  # ...and then HeadStore re-reads everything
            self._seq = seq
        self._moved()
        if was_down:
            log.warning("PostgreSQL store %s is reachable again: re-reading its bots",
                        self._where)

    def disconnected(self, exc: BaseException) -> None:
        if not self._pool.set_down(True):
            log.warning("PostgreSQL store %s unreachable (%s): serving resident heads and the "
                        "last known bots, reconnecting in the background", self._where,
                        first_line(exc))
        else:
            log.debug("PostgreSQL store %s still unreachable: %s", self._where, first_line(exc))


class Listener:
    """The background thread that LISTENs for changes on its own connection and reports them
    to `changes`. `stop()` wakes it through a socket pair and joins it."""

    def __init__(self, pool: Pool, changes: Changes, *, poll_s: float, reconnect_min_s: float,
                 reconnect_max_s: float) -> None:
        self._pool = pool
        self._changes = changes
        self._poll_s = poll_s
        self._reconnect_s = (reconnect_min_s, reconnect_max_s)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="multihead-pg-listener",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._wake_lock:
            if self._wake_w.fileno() != -1:
                try:
                    self._wake_w.send(b"x")
                except OSError:
                    pass
        if self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    def _run(self) -> None:
        min_s, max_s = self._reconnect_s
        delay = min_s
        try:
            while not self._stop.is_set():
                conn = None
                try:
                    conn = self._pool.connect()
                    if self._stop.is_set():
                        break
                    conn.execute(f"LISTEN {CHANNEL}")
                    # After LISTEN: a commit before it is in this seq, one after it notifies.
                    self._changes.connected(read_seq(conn))
                    delay = min_s
                    self._listen(conn)
                except (psycopg.Error, StoreUnavailable, OSError) as exc:
                    if self._stop.is_set():
                        break
                    self._changes.disconnected(exc)
                finally:
                    if conn is not None:
                        conn.close()
                if self._stop.wait(delay):
                    break
                delay = min(delay * 2, max_s)
        finally:
            with self._wake_lock:
                self._wake_r.close()
                self._wake_w.close()

    def _listen(self, conn: psycopg.Connection) -> None:
        """Returns when stopped; raises psycopg.Error when the connection is lost."""
        changes = self._changes
        poll_due = time.monotonic() + self._poll_s
        fd = conn.fileno()
        while not self._stop.is_set():
            # Drain what arrived (also what a query below left in psycopg's backlog).
            payloads = [n.payload for n in conn.notifies(timeout=0)]
            if payloads:
                try:
                    changes.saw(max(int(p) for p in payloads))
                except ValueError:  # not ours: look the number up
                    changes.saw(read_seq(conn))
            timeout = max(0.0, poll_due - time.monotonic())
            ready, _, _ = select.select([fd, self._wake_r], [], [], timeout)
            if self._wake_r in ready:
                return
            if not ready:
                # The fallback poll: a lost notification, or a connection that died silently
                # (the query fails and we reconnect).
                changes.saw(read_seq(conn))
                poll_due = time.monotonic() + self._poll_s
