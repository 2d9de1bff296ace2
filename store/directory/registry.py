"""The SQLite registry of a directory store: which version of each bot is active, with
history (stdlib sqlite3, WAL). (`store.pg` keeps the same tables in PostgreSQL.)

Tables (`registry.sqlite` in the store), rendered from `store.schema`:

    bots(bot_id PRIMARY KEY, active_version, updated)        one row per live bot
    versions(bot_id, version, n_classes, labels, created, source)   every committed version
    history(id, bot_id, action, version, previous, at, source)      append-only audit trail;
                                                                    also keeps version numbers
                                                                    from ever being reused
    tenants, tenant_limits, api_keys,       tenants, their limits, keys, bot owners and the
    owners, audit                           audit log (`accounts.rows`); a registry made
                                            before them gains them at its next write, and an
                                            audit or history table whose check lacks a newer
                                            action is made again then
                                            (`store.schema.rebuild_statements`)
    candidates(bot_id, version, mode, percent, created)   the candidate of a bot, if any
                                            (`accounts.candidates`), likewise added

Readers and the writer use separate connections: WAL lets readers go on while a registration
writes, and `PRAGMA data_version` on the reader connection changes whenever another connection
(the writer here, or another process such as the admin CLI) commits, which is the store's cheap
change detection. Writers across processes are serialised by an exclusive `flock` on
`registry.lock`, held across the whole registration (files and row), so crash leftovers can be
swept safely by the next writer.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from accounts.candidates import CandidateInfo, CandidateMode
from accounts.rows import Rows
from accounts.tenants import DEFAULT_TENANT
from store.backend import SQLITE
from store.bots import BotRow, VersionRow
from store.schema import (
    GROWING_CHECKS,
    STORING_ACTIONS,
    create_statements,
    rebuild_statements,
    stale_check,
)

log = logging.getLogger(__name__)

_BUSY_TIMEOUT_S = 30.0


def _version_row(row: tuple) -> VersionRow:
    bot_id, version, n_classes, labels, created, source = row
    return VersionRow(bot_id, int(version), int(n_classes), tuple(json.loads(labels)), created,
                      source)


class Transaction:
    """The write side of one registry transaction (inside `Registry.write()`)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.committed = False
        self.rows = rows_of(conn)  # tenants, keys, owners, audit

    @property
    def conn(self) -> sqlite3.Connection:
        """The connection of this transaction (`store.directory.dump` writes rows as they
        are through it)."""
        return self._conn

    def active_version(self, bot_id: str) -> int | None:
        row = self._conn.execute(
            "SELECT active_version FROM bots WHERE bot_id = ?", (bot_id,)
        ).fetchone()
        return None if row is None else int(row[0])

    def versions(self, bot_id: str) -> list[int]:
        rows = self._conn.execute(
            "SELECT version FROM versions WHERE bot_id = ? ORDER BY version", (bot_id,)
        )
        return [int(r[0]) for r in rows]

    def max_version_ever(self, bot_id: str) -> int:
        stored = ", ".join(f"'{a}'" for a in STORING_ACTIONS)
        row = self._conn.execute(
            f"SELECT MAX(version) FROM history WHERE bot_id = ? AND action IN ({stored})",
            (bot_id,)).fetchone()
        return int(row[0] or 0)

    def add_version(self, row: VersionRow, *, at: str, active: bool = True) -> None:
        """Store `row`; make it active (history "register"), or not (history "candidate":
        the caller records it as the bot's candidate)."""
        previous = self.active_version(row.bot_id)
        self._conn.execute(
            "INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?)",
            (row.bot_id, row.version, row.n_classes, json.dumps(list(row.labels)), row.created,
             row.source),
        )
        if active:
            self._set_active(row.bot_id, row.version, at)
        self._history(row.bot_id, "register" if active else "candidate", row.version, previous,
                      at, row.source)

    def candidate(self, bot_id: str) -> tuple[int, CandidateMode] | None:
        """(version, mode) of the bot's candidate, or None."""
        row = self._conn.execute(
            "SELECT version, mode, percent FROM candidates WHERE bot_id = ?", (bot_id,)
        ).fetchone()
        return None if row is None else (int(row[0]), CandidateMode(row[1], row[2]))

    def set_candidate(self, bot_id: str, version: int, mode: CandidateMode, *, at: str) -> None:
        self._conn.execute(
            "INSERT INTO candidates VALUES (?, ?, ?, ?, ?) ON CONFLICT (bot_id) DO UPDATE SET "
            "version = excluded.version, mode = excluded.mode, percent = excluded.percent, "
            "created = excluded.created", (bot_id, version, mode.mode, mode.percent, at))

    def promote(self, bot_id: str, version: int, *, at: str) -> None:
        """The candidate `version` becomes active (history "promote"); no candidate left."""
        self._conn.execute("DELETE FROM candidates WHERE bot_id = ?", (bot_id,))
        self.set_active(bot_id, version, at=at, action="promote")

    def discard(self, bot_id: str, version: int, *, at: str) -> None:
        """The candidate and its version row go (history "discard")."""
        self._conn.execute("DELETE FROM candidates WHERE bot_id = ?", (bot_id,))
        self._conn.execute("DELETE FROM versions WHERE bot_id = ? AND version = ?",
                           (bot_id, version))
        self._history(bot_id, "discard", version, None, at, None)

    def delete_version(self, bot_id: str, version: int) -> None:
        """A version row goes (a version pruned by its tenant's max_versions: no history row,
        its number is never given again all the same: the history keeps its registration)."""
        self._conn.execute("DELETE FROM versions WHERE bot_id = ? AND version = ?",
                           (bot_id, version))

    def set_active(self, bot_id: str, version: int, *, at: str, action: str = "rollback") -> None:
        previous = self.active_version(bot_id)
        self._set_active(bot_id, version, at)
        self._history(bot_id, action, version, previous, at, None)

    def delete_bot(self, bot_id: str, *, at: str) -> None:
        previous = self.active_version(bot_id)
        self._conn.execute("DELETE FROM versions WHERE bot_id = ?", (bot_id,))
        self._conn.execute("DELETE FROM bots WHERE bot_id = ?", (bot_id,))
        self._conn.execute("DELETE FROM candidates WHERE bot_id = ?", (bot_id,))
        self._history(bot_id, "remove", None, previous, at, None)

    def commit(self) -> None:
        self._conn.execute("COMMIT")
        self.committed = True

    def _set_active(self, bot_id: str, version: int, at: str) -> None:
        self._conn.execute(
            "INSERT INTO bots VALUES (?, ?, ?) ON CONFLICT (bot_id) DO UPDATE SET "
            "active_version = excluded.active_version, updated = excluded.updated",
            (bot_id, version, at),
        )

    def _history(self, bot_id, action, version, previous, at, source) -> None:
        self._conn.execute(
            "INSERT INTO history (bot_id, action, version, previous, at, source) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (bot_id, action, version, previous, at, source),
        )


def _no_schema_yet(exc: BaseException) -> bool:
    """The registry file exists but its first writer has not committed the tables yet (or, for
    the tables of tenants, a registry made before them)."""
    return isinstance(exc, sqlite3.OperationalError) and str(exc).startswith("no such table")


def rows_of(conn: sqlite3.Connection) -> Rows:
    return Rows(conn, qmark=True, missing=_no_schema_yet)


class Registry:
    """Thread-safe access to `registry.sqlite`. Creates nothing on disk until the first write."""

    def __init__(self, db_path: Path, lock_path: Path) -> None:
        self.db_path = Path(db_path)
        self.lock_path = Path(lock_path)
        self._read_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._reader: sqlite3.Connection | None = None
        self._writer: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._closed = False

    # -- reading -----------------------------------------------------------------------------

    def _reader_locked(self) -> sqlite3.Connection | None:
        if self._closed:
            raise RuntimeError("the head store is closed")
        if self._reader is None:
            if not self.db_path.exists():
                return None  # an empty store: nothing registered yet, and nothing created
            # mode=rw: never create the file from the read side.
            self._reader = sqlite3.connect(
                f"file:{self.db_path}?mode=rw", uri=True, timeout=_BUSY_TIMEOUT_S,
                isolation_level=None, check_same_thread=False,
            )
        return self._reader

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection | None]:
        """A consistent snapshot (one read transaction), or None for a store with no registry."""
        with self._read_lock:
            conn = self._reader_locked()
            if conn is None:
                yield None
                return
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")

    def data_version(self) -> int | None:
        """Changes whenever another connection committed; None while no registry exists."""
        with self._read_lock:
            conn = self._reader_locked()
            return None if conn is None else int(conn.execute("PRAGMA data_version").fetchone()[0])

    def active_map(self) -> dict[str, tuple[int, str]]:
        """{bot id: (active version, owner tenant)}."""
        with self._read() as conn:
            if conn is None:
                return {}
            try:
                rows = conn.execute("SELECT bot_id, active_version FROM bots").fetchall()
            except sqlite3.OperationalError as exc:
                if _no_schema_yet(exc):  # file created, schema not committed yet
                    return {}
                raise  # a locked or broken database is not an empty store
            owners = dict(rows_of(conn).owner_map())
            return {b: (int(v), owners.get(b, DEFAULT_TENANT)) for b, v in rows}

    def rows(self, bot_id: str | None = None) -> list[BotRow]:
        """Every live bot (only `bot_id` if given) with all its committed versions, ordered by
        bot id."""
        with self._read() as conn:
            if conn is None:
                return []
            where, params = ("WHERE b.bot_id = ?", (bot_id,)) if bot_id is not None else ("", ())
            try:
                active = conn.execute(
                    "SELECT v.bot_id, v.version, v.n_classes, v.labels, v.created, v.source "
                    "FROM bots b JOIN versions v "
                    f"ON v.bot_id = b.bot_id AND v.version = b.active_version {where} "
                    "ORDER BY b.bot_id", params,
                ).fetchall()
                where_v = "WHERE bot_id = ?" if bot_id is not None else ""
                all_versions: dict[str, list[int]] = {}
                for b, v in conn.execute(
                    f"SELECT bot_id, version FROM versions {where_v} ORDER BY bot_id, version",
                    params,
                ):
                    all_versions.setdefault(b, []).append(int(v))
            except sqlite3.OperationalError as exc:
                if not _no_schema_yet(exc):
                    raise
                return []
            owners = dict(rows_of(conn).owner_map())
        return [BotRow(_version_row(r), all_versions.get(r[0], []),
                       owners.get(r[0], DEFAULT_TENANT)) for r in active]

    def candidates(self, bot_id: str | None = None) -> dict[str, CandidateInfo]:
        """{bot id: its candidate} of the live bots that have one (only `bot_id`'s if given);
        {} for a registry made before candidates, until its next write."""
        with self._read() as conn:
            if conn is None:
                return {}
            where, params = ("AND c.bot_id = ?", (bot_id,)) if bot_id is not None else ("", ())
            try:
                rows = conn.execute(
                    "SELECT c.bot_id, c.version, c.mode, c.percent, v.n_classes, v.labels, "
                    "v.created, v.source FROM candidates c JOIN bots b ON b.bot_id = c.bot_id "
                    "JOIN versions v ON v.bot_id = c.bot_id AND v.version = c.version "
                    f"WHERE c.version <> b.active_version {where}", params).fetchall()
            except sqlite3.OperationalError as exc:
                if not _no_schema_yet(exc):
                    raise
                return {}
        return {b: CandidateInfo(b, int(v), CandidateMode(mode, percent), int(n),
                                 tuple(json.loads(labels)), created, source)
                for b, v, mode, percent, n, labels, created, source in rows}

    @contextmanager
    def reading(self) -> Iterator[Rows | None]:
        """The tenants, keys and audit rows in one read transaction (None: no registry yet)."""
        with self._read() as conn:
            yield None if conn is None else rows_of(conn)

    def history(self, bot_id: str) -> list[dict]:
        with self._read() as conn:
            if conn is None:
                return []
            try:
                rows = conn.execute(
                    "SELECT action, version, previous, at, source FROM history WHERE bot_id = ? "
                    "ORDER BY id", (bot_id,),
                ).fetchall()
            except sqlite3.OperationalError as exc:
                if not _no_schema_yet(exc):
                    raise
                rows = []
        keys = ("action", "version", "previous", "at", "source")
        return [dict(zip(keys, r)) for r in rows]

    # -- writing -----------------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[Transaction]:
        """An exclusive write transaction, across threads and processes.

        Commits when the block ends (unless it committed already); rolls back on any exception,
        including a crash: SQLite discards a transaction that was never committed.
        """
        with self._write_lock:
            conn = self._writer_locked()
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                conn.execute("BEGIN IMMEDIATE")
                tx = Transaction(conn)
                try:
                    yield tx
                except BaseException:
                    if not tx.committed:
                        conn.execute("ROLLBACK")
                    raise
                if not tx.committed:
                    tx.commit()
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _writer_locked(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError("the head store is closed")
        if self._writer is None:
            self.db_path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            conn = sqlite3.connect(
                self.db_path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                check_same_thread=False,
            )
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                conn.execute("PRAGMA journal_mode=WAL")  # persistent; a no-op once set
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for statement in create_statements(SQLITE):
                        conn.execute(statement)
                    self._renew_checks(conn)
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            # A registration's rows must survive a power loss just like its fsynced files.
            conn.execute("PRAGMA synchronous=FULL")
            self._writer = conn
        return self._writer

    def _renew_checks(self, conn: sqlite3.Connection) -> None:
        """Make again each table whose check lacks a value this version writes (the audit
        table of a registry written before "tenant_set"): in the caller's write transaction."""
        for table in GROWING_CHECKS:
            row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
                               (table,)).fetchone()
            if row is not None and stale_check(table, row[0]):
                for statement in rebuild_statements(table):
                    conn.execute(statement)
                log.info("registry %s: table %s made again, its check allowing what this "
                         "version writes (rows kept)", self.db_path, table)

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            self._closed = True
            for conn in (self._reader, self._writer):
                if conn is not None:
                    conn.close()
            self._reader = self._writer = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
