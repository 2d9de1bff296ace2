"""The PostgreSQL backend: registry, head tensors and labels in one database (psycopg 3).

For replicas on many machines: `open_store("postgresql://user@host:5432/dbname")` needs no
shared filesystem. Everything lives in the schema `multihead` of that database, created by the
first registration (a reader of a database without it sees an empty store):

    state(singleton, schema_version, change_seq)   one row; change_seq grows by one per write
                                                   transaction, which also takes its row lock
                                                   first (writers are serialised, as with the
                                                   flock of a directory store)
    versions(bot_id, version, n_classes, labels jsonb, created, source)   every stored version
    blobs(bot_id, version, name, data bytea, sha256)   per version: 'weights' (float32 [1536, n]
                                                   little-endian, C order), 'biases' (float32
                                                   [n]) and 'labels' (UTF-8 JSON array);
                                                   each checked against its sha256 on load
    bots(bot_id, active_version, updated)          one row per live bot
    history(id, bot_id, action, version, previous, at, source)   append-only audit trail; also
                                                   keeps version numbers from being reused

A registration is ONE transaction (rows, blobs, `NOTIFY multihead_heads, '<change_seq>'`): a
writer killed at any point leaves nothing visible, and the notification is delivered at commit.

Change notification: the first lookup starts a daemon thread with its own connection that
LISTENs on `multihead_heads`. Each notification (or a check of `change_seq` every `poll_s`, or
a reconnect) changes `data_version()`, and `HeadStore` re-reads the active map on its next
lookup. When the connection is lost the thread logs one warning, reconnects with exponential
backoff (`reconnect_min_s` .. `reconnect_max_s`), and after reconnecting re-reads `change_seq`,
so changes made while it was away are not missed. Meanwhile reads that need the database fail
at once with StoreUnavailable (no connect timeout on the lookup path) and `HeadStore` keeps
serving resident heads and the last known bots.
"""
from __future__ import annotations

import hashlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import psycopg
from psycopg import conninfo as pg_conninfo
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb

from backbone.spec import FEATURE_DIM
from heads.backend import POSTGRESQL, Step, StoreBackend, VersionRow, redact_url, utc_now
from heads.errors import (
    HeadLoadError,
    InvalidHead,
    InvalidStoreLocation,
    StoreUnavailable,
    UnknownBot,
)
from heads.head import Head, validate_labels

log = logging.getLogger(__name__)

SCHEMA = "multihead"
SCHEMA_VERSION = 1
CHANNEL = "multihead_heads"
BLOB_NAMES = ("weights", "biases", "labels")
_FLOAT = np.dtype("<f4")
# pg_advisory_xact_lock key serialising schema creation between processes ("mhschema").
_DDL_LOCK_KEY = 0x6D68736368656D61
# Applied unless the URL says otherwise: fail fast instead of hanging on a dead host, and notice
# a silently dead connection (keepalives, tcp_user_timeout in ms).
_CONNECT_DEFAULTS = {
    "connect_timeout": "5", "application_name": "multihead", "keepalives": "1",
    "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}

S = SCHEMA
_DDL = [
    f"CREATE SCHEMA IF NOT EXISTS {S}",
    f"""CREATE TABLE IF NOT EXISTS {S}.state (
        singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
        schema_version integer NOT NULL,
        change_seq bigint NOT NULL
    )""",
    f"INSERT INTO {S}.state (schema_version, change_seq) VALUES ({SCHEMA_VERSION}, 0) "
    "ON CONFLICT DO NOTHING",
    f"""CREATE TABLE IF NOT EXISTS {S}.versions (
        bot_id text COLLATE "C" NOT NULL,
        version integer NOT NULL CHECK (version > 0),
        n_classes integer NOT NULL CHECK (n_classes >= 2),
        labels jsonb NOT NULL,
        created text NOT NULL,
        source text NOT NULL,
        PRIMARY KEY (bot_id, version)
    )""",
    f"""CREATE TABLE IF NOT EXISTS {S}.blobs (
        bot_id text COLLATE "C" NOT NULL,
        version integer NOT NULL,
        name text NOT NULL CHECK (name IN ('weights', 'biases', 'labels')),
        data bytea NOT NULL,
        sha256 text NOT NULL CHECK (length(sha256) = 64),
        PRIMARY KEY (bot_id, version, name),
        FOREIGN KEY (bot_id, version) REFERENCES {S}.versions ON DELETE CASCADE
    )""",
    # float32 tensors do not compress: store them out of line without trying.
    f"ALTER TABLE {S}.blobs ALTER COLUMN data SET STORAGE EXTERNAL",
    f"""CREATE TABLE IF NOT EXISTS {S}.bots (
        bot_id text COLLATE "C" PRIMARY KEY,
        active_version integer NOT NULL,
        updated text NOT NULL,
        FOREIGN KEY (bot_id, active_version) REFERENCES {S}.versions
    )""",
    f"""CREATE TABLE IF NOT EXISTS {S}.history (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        bot_id text COLLATE "C" NOT NULL,
        action text NOT NULL CHECK (action IN ('register', 'rollback', 'remove')),
        version integer,
        previous integer,
        at text NOT NULL,
        source text
    )""",
    f"CREATE INDEX IF NOT EXISTS history_by_bot ON {S}.history (bot_id, version)",
]
# A database in which no registration ever happened: reads see an empty store.
_NO_SCHEMA = (pg_errors.UndefinedTable, pg_errors.InvalidSchemaName)


def _first_line(exc: BaseException) -> str:
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


class PgBackend(StoreBackend):
    """A head store in a PostgreSQL database (see the module docstring)."""

    kind = POSTGRESQL
    read_errors = (StoreUnavailable,)
    reconnect_min_s = 0.1
    reconnect_max_s = 2.0
    poll_s = 5.0
    max_idle_connections = 4

    def __init__(self, url: str) -> None:
        self.url = url
        self._where = redact_url(url)
        try:
            params = pg_conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise InvalidStoreLocation(
                f"malformed PostgreSQL store URL {self._where!r}: {_first_line(exc)}") from None
        for key, value in _CONNECT_DEFAULTS.items():
            params.setdefault(key, value)
        self._params = params
        self._lock = threading.Lock()  # guards everything below
        self._idle: list[psycopg.Connection] = []
        self._closed = False
        self._down = False  # the listener lost the server and has not reconnected yet
        self._generation = 0  # listener (re)connections
        self._seq: int | None = None  # newest change_seq known
        self._listener: _Listener | None = None
        self._schema_ready = False

    def describe(self) -> str:
        return self._where

    # -- connections ---------------------------------------------------------------------------

    def connect(self) -> psycopg.Connection:
        """A new autocommit connection. Raises StoreUnavailable."""
        try:
            return psycopg.connect(autocommit=True, **self._params)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(self._unreachable(exc)) from None

    def _unreachable(self, exc: BaseException) -> str:
        return f"PostgreSQL store {self._where} is unreachable: {_first_line(exc)}"

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
            if reusable and not self._closed and len(self._idle) < self.max_idle_connections:
                self._idle.append(conn)
                return
        conn.close()

    def _run(self, work: Callable[[psycopg.Connection], object], *, read: bool) -> object:
        """`work(conn)` on a pooled connection; a lost connection is StoreUnavailable.

        A read fails at once while the listener knows the server is down (the lookup path
        never waits for a connect timeout), and is tried once more on a new connection if its
        connection turns out dead. A write always tries to connect, and is never retried: a
        connection lost during COMMIT leaves its outcome unknown.
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
                                       f"{_first_line(exc)}") from None
            except BaseException:
                self._give(conn)
                raise
            self._give(conn)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    # -- change detection ----------------------------------------------------------------------

    def data_version(self) -> object:
        with self._lock:
            if self._closed:
                raise RuntimeError("the head store is closed")
            if self._listener is None:
                self._listener = _Listener(self)
                self._listener.start()
            return (self._generation, self._seq)

    def read_seq(self, conn: psycopg.Connection) -> int:
        try:
            row = conn.execute(f"SELECT change_seq FROM {S}.state").fetchone()
        except _NO_SCHEMA:
            return 0
        return int(row[0]) if row is not None else 0

    def saw(self, seq: int) -> None:
        """A change up to `seq` was committed (a notification, a poll, or our own write)."""
        with self._lock:
            if self._seq is None or seq > self._seq:
                self._seq = seq

    def connected(self, seq: int) -> None:
        """The listener is (again) connected and listening; `seq` read after LISTEN."""
        with self._lock:
            was_down, self._down = self._down, False
            self._generation += 1  # changes data_version: HeadStore re-reads everything
            self._seq = seq
        if was_down:
            log.warning("PostgreSQL store %s is reachable again: re-reading its bots",
                        self._where)

    def disconnected(self, exc: BaseException) -> None:
        with self._lock:
            was_down, self._down = self._down, True
            idle, self._idle = self._idle, []
        for conn in idle:  # connections to the lost server: all dead or about to be
            conn.close()
        if not was_down:
            log.warning("PostgreSQL store %s unreachable (%s): serving resident heads and the "
                        "last known bots, reconnecting in the background", self._where,
                        _first_line(exc))
        else:
            log.debug("PostgreSQL store %s still unreachable: %s", self._where, _first_line(exc))

    # -- reading -------------------------------------------------------------------------------

    def active_map(self) -> dict[str, int]:
        def work(conn):
            try:
                rows = conn.execute(f"SELECT bot_id, active_version FROM {S}.bots").fetchall()
            except _NO_SCHEMA:
                return {}
            return {b: int(v) for b, v in rows}

        return self._run(work, read=True)

    def snapshot(self, bot_id: str | None = None) -> list[tuple[int, VersionRow, list[int]]]:
        where, params = ("WHERE b.bot_id = %s", (bot_id,)) if bot_id is not None else ("", ())

        def work(conn):
            try:
                # One statement, one snapshot: the active rows and the version lists agree.
                return conn.execute(
                    f"SELECT v.bot_id, v.version, v.n_classes, v.labels, v.created, v.source, "
                    f"ARRAY(SELECT w.version FROM {S}.versions w WHERE w.bot_id = b.bot_id "
                    f"ORDER BY w.version) "
                    f"FROM {S}.bots b JOIN {S}.versions v "
                    f"ON v.bot_id = b.bot_id AND v.version = b.active_version {where} "
                    "ORDER BY b.bot_id", params).fetchall()
            except _NO_SCHEMA:
                return []

        return [(int(version), VersionRow(b, int(version), int(n), tuple(labels), created, source),
                 [int(x) for x in versions])
                for b, version, n, labels, created, source, versions in self._run(work, read=True)]

    def history(self, bot_id: str) -> list[dict]:
        def work(conn):
            try:
                return conn.execute(
                    f"SELECT action, version, previous, at, source FROM {S}.history "
                    "WHERE bot_id = %s ORDER BY id", (bot_id,)).fetchall()
            except _NO_SCHEMA:
                return []

        keys = ("action", "version", "previous", "at", "source")
        return [dict(zip(keys, r)) for r in self._run(work, read=True)]

    def load(self, bot_id: str, version: int) -> Head:
        def work(conn):
            try:
                with conn.cursor(binary=True) as cur:
                    cur.execute(
                        f"SELECT v.n_classes, b.name, b.data, b.sha256 FROM {S}.versions v "
                        f"LEFT JOIN {S}.blobs b ON b.bot_id = v.bot_id AND b.version = v.version "
                        "WHERE v.bot_id = %s AND v.version = %s", (bot_id, version))
                    return cur.fetchall()
            except _NO_SCHEMA:
                return []

        rows = self._run(work, read=True)
        label = f"head '{bot_id}' v{version}"
        if not rows:
            raise HeadLoadError(f"{label} is not in the store")
        n = int(rows[0][0])
        blobs = {name: (bytes(data), digest) for _, name, data, digest in rows if name is not None}
        for name in BLOB_NAMES:
            if name not in blobs:
                raise HeadLoadError(f"{label}: blob '{name}' is missing")
            data, digest = blobs[name]
            if hashlib.sha256(data).hexdigest() != digest:
                raise HeadLoadError(f"{label}: blob '{name}' is corrupt (sha256 mismatch)")
        try:
            weights = _decode_floats(blobs["weights"][0], (FEATURE_DIM, n), "weights")
            biases = _decode_floats(blobs["biases"][0], (n,), "biases")
            labels = _decode_labels(blobs["labels"][0])
            return Head(bot_id, version, labels, weights, biases)
        except InvalidHead as exc:
            raise HeadLoadError(f"{label}: {exc}") from None

    # -- writing -------------------------------------------------------------------------------

    def _ensure_schema(self, conn: psycopg.Connection) -> None:
        if self._schema_ready:
            return
        # DDL is transactional: the tables exist all together or not at all. Check first, so
        # that a role allowed to write rows but not to create schemas works once they exist.
        if conn.execute(f"SELECT to_regclass('{S}.state')").fetchone()[0] is None:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK_KEY,))
                for statement in _DDL:
                    conn.execute(statement)
        self._schema_ready = True

    @staticmethod
    def _begin_write(conn: psycopg.Connection) -> int:
        """The first statement of every write transaction: takes the store's writer lock (the
        state row) until commit and returns this transaction's change_seq."""
        row = conn.execute(
            f"UPDATE {S}.state SET change_seq = change_seq + 1 RETURNING change_seq").fetchone()
        return int(row[0])

    @staticmethod
    def _notify(conn: psycopg.Connection, seq: int) -> None:
        # Queued now, delivered to every listener at COMMIT, dropped on rollback.
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(seq)))

    @staticmethod
    def _active_version(conn: psycopg.Connection, bot_id: str) -> int | None:
        row = conn.execute(f"SELECT active_version FROM {S}.bots WHERE bot_id = %s",
                           (bot_id,)).fetchone()
        return None if row is None else int(row[0])

    @staticmethod
    def _history(conn, bot_id, action, version, previous, at, source) -> None:
        conn.execute(f"INSERT INTO {S}.history (bot_id, action, version, previous, at, source) "
                     "VALUES (%s, %s, %s, %s, %s, %s)",
                     (bot_id, action, version, previous, at, source))

    def add_version(self, bot_id: str, weights: np.ndarray, biases: np.ndarray,
                    labels: tuple[str, ...], source: str, step: Step) -> int:
        n = int(weights.shape[1])
        blobs = {
            "weights": np.ascontiguousarray(weights, dtype=_FLOAT).tobytes(),
            "biases": np.ascontiguousarray(biases, dtype=_FLOAT).tobytes(),
            "labels": json.dumps(list(labels), ensure_ascii=False).encode("utf-8"),
        }
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()}

        def work(conn):
            self._ensure_schema(conn)
            with conn.transaction():
                seq = self._begin_write(conn)
                previous = self._active_version(conn, bot_id)
                row = conn.execute(
                    f"SELECT GREATEST((SELECT max(version) FROM {S}.history "
                    "WHERE bot_id = %s AND action = 'register'), "
                    f"(SELECT max(version) FROM {S}.versions WHERE bot_id = %s))",
                    (bot_id, bot_id)).fetchone()
                version = 1 + int(row[0] or 0)
                created = utc_now()
                conn.execute(f"INSERT INTO {S}.versions VALUES (%s, %s, %s, %s, %s, %s)",
                             (bot_id, version, n, Jsonb(list(labels)), created, source))
                with conn.cursor() as cur:
                    cur.executemany(f"INSERT INTO {S}.blobs VALUES (%s, %s, %s, %s, %s)",
                                    [(bot_id, version, name, blobs[name], digests[name])
                                     for name in BLOB_NAMES])
                step("written")
                conn.execute(
                    f"INSERT INTO {S}.bots VALUES (%s, %s, %s) ON CONFLICT (bot_id) DO UPDATE "
                    "SET active_version = excluded.active_version, updated = excluded.updated",
                    (bot_id, version, created))
                self._history(conn, bot_id, "register", version, previous, created, source)
                self._notify(conn, seq)
                step("rows_added")
            return version, seq

        version, seq = self._run(work, read=False)
        self.saw(seq)  # our own write: no need to wait for its notification
        return version

    def remove(self, bot_id: str) -> None:
        def work(conn):
            self._ensure_schema(conn)
            with conn.transaction():
                seq = self._begin_write(conn)
                previous = self._active_version(conn, bot_id)
                if previous is None:
                    raise UnknownBot(bot_id)
                conn.execute(f"DELETE FROM {S}.bots WHERE bot_id = %s", (bot_id,))
                # The blobs go with their versions (ON DELETE CASCADE).
                conn.execute(f"DELETE FROM {S}.versions WHERE bot_id = %s", (bot_id,))
                self._history(conn, bot_id, "remove", None, previous, utc_now(), None)
                self._notify(conn, seq)
            return seq

        self.saw(self._run(work, read=False))

    def rollback(self, bot_id: str, choose: Callable[[int, list[int]], int]) -> int:
        def work(conn):
            self._ensure_schema(conn)
            committed = None
            with conn.transaction():
                seq = self._begin_write(conn)
                active = self._active_version(conn, bot_id)
                if active is None:
                    raise UnknownBot(bot_id)
                versions = [int(r[0]) for r in conn.execute(
                    f"SELECT version FROM {S}.versions WHERE bot_id = %s ORDER BY version",
                    (bot_id,))]
                target = choose(active, versions)
                if target == active:
                    raise psycopg.Rollback()  # nothing changes: no change_seq, no notification
                at = utc_now()
                conn.execute(f"UPDATE {S}.bots SET active_version = %s, updated = %s "
                             "WHERE bot_id = %s", (target, at, bot_id))
                self._history(conn, bot_id, "rollback", target, active, at, None)
                self._notify(conn, seq)
                committed = seq
            return target, committed

        target, seq = self._run(work, read=False)
        if seq is not None:
            self.saw(seq)
        return target

    # -- housekeeping --------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
            idle, self._idle = self._idle, []
        if listener is not None:
            listener.stop()
        for conn in idle:
            conn.close()


def _decode_floats(data: bytes, shape: tuple[int, ...], name: str) -> np.ndarray:
    expected = int(np.prod(shape)) * _FLOAT.itemsize
    if len(data) != expected:
        raise InvalidHead(f"blob '{name}' has {len(data)} bytes, expected {expected} for "
                          f"float32 {list(shape)}")
    # Read-only, backed by the fetched bytes: no copy (on a little-endian machine).
    return np.frombuffer(data, dtype=_FLOAT).reshape(shape).astype(np.float32, copy=False)


def _decode_labels(data: bytes) -> tuple[str, ...]:
    try:
        labels = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise InvalidHead("blob 'labels' is not a UTF-8 JSON array") from None
    if not isinstance(labels, list):
        raise InvalidHead("blob 'labels' is not a JSON array")
    return validate_labels(labels)


class _Listener:
    """The background thread that LISTENs for changes on its own connection (see the module
    docstring). `stop()` wakes it through a socket pair and joins it."""

    def __init__(self, backend: PgBackend) -> None:
        self._backend = backend
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="multihead-pg-listener",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._wake_lock:
            if self._wake_w.fileno() != -1:
                try:
                    self._wake_w.send(b"x")
                except OSError:
                    pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        backend = self._backend
        delay = backend.reconnect_min_s
        try:
            while not self._stop.is_set():
                conn = None
                try:
                    conn = backend.connect()
                    if self._stop.is_set():
                        break
                    conn.execute(f"LISTEN {CHANNEL}")
                    # After LISTEN: a commit before it is in this seq, one after it notifies.
                    backend.connected(backend.read_seq(conn))
                    delay = backend.reconnect_min_s
                    self._listen(conn)
                except (psycopg.Error, StoreUnavailable, OSError) as exc:
                    if self._stop.is_set():
                        break
                    backend.disconnected(exc)
                finally:
                    if conn is not None:
                        conn.close()
                if self._stop.wait(delay):
                    break
                delay = min(delay * 2, backend.reconnect_max_s)
        finally:
            with self._wake_lock:
                self._wake_r.close()
                self._wake_w.close()

    def _listen(self, conn: psycopg.Connection) -> None:
        """Returns when stopped; raises psycopg.Error when the connection is lost."""
        backend = self._backend
        poll_due = time.monotonic() + backend.poll_s
        fd = conn.fileno()
        while not self._stop.is_set():
            # Drain what arrived (also what a query below left in psycopg's backlog).
            payloads = [n.payload for n in conn.notifies(timeout=0)]
            if payloads:
                try:
                    backend.saw(max(int(p) for p in payloads))
                except ValueError:  # not ours: look the number up
                    backend.saw(backend.read_seq(conn))
            timeout = max(0.0, poll_due - time.monotonic())
            ready, _, _ = select.select([fd, self._wake_r], [], [], timeout)
            if self._wake_r in ready:
                return
            if not ready:
                # The fallback poll: a lost notification, or a connection that died silently
                # (the query fails and we reconnect).
                backend.saw(backend.read_seq(conn))
                poll_due = time.monotonic() + backend.poll_s
