"""`PgBackend`: the rows of each read and write transaction of a PostgreSQL store.

A registration is ONE transaction (rows, blobs, `NOTIFY multihead_heads, '<change_seq>'`): a
writer killed at any point leaves nothing visible, and the notification is delivered at commit.
Every write transaction starts by taking the store's writer lock (`_begin_write`: the `state`
row) and ends by notifying the listeners of every process (`store.pg.listener.notify`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import psycopg
from psycopg.types.json import Jsonb

from accounts.candidates import CandidateInfo, CandidateMode, required_candidate
from accounts.errors import BotOwnedElsewhere, UnknownKey, UnknownTenant
from accounts.rows import Rows
from accounts.tenants import (
    DEFAULT_TENANT,
    OPERATOR,
    ApiKey,
    AuditRecord,
    TenantInfo,
    TenantLimits,
    combine_digests,
    utc_now,
)
from heads.errors import HeadLoadError, UnknownBot
from heads.head import Head
from store.backend import POSTGRESQL, Step, StoreBackend, VersionRow, redact_url
from store.errors import StoreUnavailable
from store.pg import blobs
from store.pg.listener import Changes, Listener, notify
from store.pg.pool import Pool
from store.pg.schema import NO_SCHEMA, ensure_schema
from store.pg.schema import SCHEMA as S
from store.schema import BLOB_NAMES, STORING_ACTIONS


def _rows(conn: psycopg.Connection) -> Rows:
    return Rows(conn, prefix=f"{S}.", missing=lambda exc: isinstance(exc, NO_SCHEMA))


class PgBackend(StoreBackend):
    """A head store in a PostgreSQL database (see `store.pg`)."""

    kind = POSTGRESQL
    read_errors = (StoreUnavailable,)
    # Of the listener, read when it starts (the first `data_version()`).
    reconnect_min_s = 0.1
    reconnect_max_s = 2.0
    poll_s = 5.0

    def __init__(self, url: str) -> None:
        self._where = redact_url(url)
        self._pool = Pool(url, self._where)
        self._changes = Changes(self._pool, self._where)
        self._lock = threading.Lock()  # guards the two below
        self._closed = False
        self._listener: Listener | None = None
        self._schema_ready = False

    def describe(self) -> str:
        return self._where

    # -- reading -------------------------------------------------------------------------------

    def data_version(self) -> object:
        with self._lock:
            if self._closed:
                raise RuntimeError("the head store is closed")
            if self._listener is None:
                self._listener = Listener(self._pool, self._changes, poll_s=self.poll_s,
                                          reconnect_min_s=self.reconnect_min_s,
                                          reconnect_max_s=self.reconnect_max_s)
                self._listener.start()
        return self._changes.version()

    def active_map(self) -> dict[str, tuple[int, str]]:
        def work(conn):
            try:
                # One statement, one snapshot: bots and owners agree.
                rows = conn.execute(
                    f"SELECT b.bot_id, b.active_version, COALESCE(o.tenant, %s) "
                    f"FROM {S}.bots b LEFT JOIN {S}.owners o ON o.bot_id = b.bot_id",
                    (DEFAULT_TENANT,)).fetchall()
            except NO_SCHEMA:  # no schema, or one made before tenants (no owners table)
                try:
                    rows = [(b, v, DEFAULT_TENANT) for b, v in conn.execute(
                        f"SELECT bot_id, active_version FROM {S}.bots").fetchall()]
                except NO_SCHEMA:
                    return {}
            return {b: (int(v), t) for b, v, t in rows}

        return self._pool.run(work, read=True)

    def snapshot(self, bot_id: str | None = None
                 ) -> list[tuple[int, VersionRow, list[int], str]]:
        where, params = ("WHERE b.bot_id = %s", (bot_id,)) if bot_id is not None else ("", ())

        def query(owner: str, join: str) -> str:
            return (f"SELECT v.bot_id, v.version, v.n_classes, v.labels, v.created, v.source, "
                    f"ARRAY(SELECT w.version FROM {S}.versions w WHERE w.bot_id = b.bot_id "
                    f"ORDER BY w.version), {owner} "
                    f"FROM {S}.bots b JOIN {S}.versions v "
                    f"ON v.bot_id = b.bot_id AND v.version = b.active_version {join} {where} "
                    "ORDER BY b.bot_id")

        def work(conn):
            # One statement, one snapshot: the active rows, version lists and owners agree.
            try:
                return conn.execute(
                    query("COALESCE(o.tenant, %s)",
                          f"LEFT JOIN {S}.owners o ON o.bot_id = b.bot_id"),
                    (DEFAULT_TENANT, *params)).fetchall()
            except NO_SCHEMA:  # no schema, or one made before tenants (no owners table)
                try:
                    return conn.execute(query("%s::text", ""), (DEFAULT_TENANT, *params)).fetchall()
                except NO_SCHEMA:
                    return []

        return [(int(version), VersionRow(b, int(version), int(n), tuple(labels), created, source),
                 [int(x) for x in versions], tenant)
                for b, version, n, labels, created, source, versions, tenant
                in self._pool.run(work, read=True)]

    def history(self, bot_id: str) -> list[dict]:
        def work(conn):
            try:
                return conn.execute(
                    f"SELECT action, version, previous, at, source FROM {S}.history "
                    "WHERE bot_id = %s ORDER BY id", (bot_id,)).fetchall()
            except NO_SCHEMA:
                return []

        keys = ("action", "version", "previous", "at", "source")
        return [dict(zip(keys, r)) for r in self._pool.run(work, read=True)]

    def candidates(self, bot_id: str | None = None) -> dict[str, CandidateInfo]:
        where, params = ("AND c.bot_id = %s", (bot_id,)) if bot_id is not None else ("", ())

        def work(conn):
            try:
                return conn.execute(
                    "SELECT c.bot_id, c.version, c.mode, c.percent, v.n_classes, v.labels, "
                    f"v.created, v.source FROM {S}.candidates c "
                    f"JOIN {S}.bots b ON b.bot_id = c.bot_id "
                    f"JOIN {S}.versions v ON v.bot_id = c.bot_id AND v.version = c.version "
                    f"WHERE c.version <> b.active_version {where}", params).fetchall()
            except NO_SCHEMA:  # no schema, or one made before candidates
                return []

        return {b: CandidateInfo(b, int(v), CandidateMode(mode, percent), int(n), tuple(labels),
                                 created, source)
                for b, v, mode, percent, n, labels, created, source
                in self._pool.run(work, read=True)}

    def load(self, bot_id: str, version: int) -> Head:
        def work(conn):
            try:
                with conn.cursor(binary=True) as cur:
                    cur.execute(
                        f"SELECT v.n_classes, b.name, b.data, b.sha256 FROM {S}.versions v "
                        f"LEFT JOIN {S}.blobs b ON b.bot_id = v.bot_id AND b.version = v.version "
                        "WHERE v.bot_id = %s AND v.version = %s", (bot_id, version))
                    return cur.fetchall()
            except NO_SCHEMA:
                return []

        rows = self._pool.run(work, read=True)
        if not rows:
            raise HeadLoadError(f"head '{bot_id}' v{version} is not in the store")
        stored = {name: (bytes(data), digest) for _, name, data, digest in rows
                  if name is not None}
        return blobs.decode(bot_id, version, int(rows[0][0]), stored)

    # -- writing -------------------------------------------------------------------------------

    def add_version(self, bot_id: str, weights: np.ndarray, biases: np.ndarray,
                    labels: tuple[str, ...], source: str, step: Step, *,
                    tenant: str = DEFAULT_TENANT, actor: str = OPERATOR,
                    candidate: CandidateMode | None = None) -> int:
        n = int(weights.shape[1])
        encoded = blobs.encode(weights, biases, labels)
        digest = combine_digests({name: encoded[name][1] for name in BLOB_NAMES})

        def work(conn):
            self._ensure_schema(conn)
            with conn.transaction():
                seq = self._begin_write(conn)
                rows = _rows(conn)
                # Refusals first: nothing written (the transaction rolls back).
                if not rows.tenant_exists(tenant):
                    raise UnknownTenant(tenant)
                previous = self._active_version(conn, bot_id)
                if candidate is not None and previous is None:
                    raise UnknownBot(bot_id)  # a candidate is a candidate to a live version
                if previous is not None and rows.owner(bot_id) != tenant:
                    raise BotOwnedElsewhere(bot_id)
                row = conn.execute(
                    f"SELECT GREATEST((SELECT max(version) FROM {S}.history "
                    "WHERE bot_id = %s AND action = ANY(%s)), "
                    f"(SELECT max(version) FROM {S}.versions WHERE bot_id = %s))",
                    (bot_id, list(STORING_ACTIONS), bot_id)).fetchone()
                version = 1 + int(row[0] or 0)
                created = utc_now()
                conn.execute(f"INSERT INTO {S}.versions VALUES (%s, %s, %s, %s, %s, %s)",
                             (bot_id, version, n, Jsonb(list(labels)), created, source))
                with conn.cursor() as cur:
                    cur.executemany(f"INSERT INTO {S}.blobs VALUES (%s, %s, %s, %s, %s)",
                                    [(bot_id, version, name, *encoded[name])
                                     for name in BLOB_NAMES])
                step("written")
                if candidate is None:
                    conn.execute(
                        f"INSERT INTO {S}.bots VALUES (%s, %s, %s) ON CONFLICT (bot_id) DO "
                        "UPDATE SET active_version = excluded.active_version, "
                        "updated = excluded.updated", (bot_id, version, created))
                    self._history(conn, bot_id, "register", version, previous, created, source)
                    rows.set_owner(bot_id, tenant)
                    rows.record(at=created, actor=actor,
                                action="register" if previous is None else "replace",
                                tenant=tenant, bot_id=bot_id, version=version, digest=digest,
                                detail=source)
                else:
                    self._history(conn, bot_id, "candidate", version, previous, created, source)
                    replaced = self._candidate(conn, bot_id, previous)
                    if replaced is not None:
                        self._drop_candidate(conn, bot_id, replaced[0], created)
                        rows.record(at=created, actor=actor, action="candidate_discard",
                                    tenant=tenant, bot_id=bot_id, version=replaced[0],
                                    detail=f"{replaced[1]}, replaced by v{version}")
                    conn.execute(
                        f"INSERT INTO {S}.candidates VALUES (%s, %s, %s, %s, %s) "
                        "ON CONFLICT (bot_id) DO UPDATE SET version = excluded.version, "
                        "mode = excluded.mode, percent = excluded.percent, "
                        "created = excluded.created",
                        (bot_id, version, candidate.mode, candidate.percent, created))
                    rows.record(at=created, actor=actor, action="candidate_add",
                                tenant=tenant, bot_id=bot_id, version=version, digest=digest,
                                detail=f"{candidate}, {source}")
                notify(conn, seq)
                step("rows_added")
            return version, seq

        version, seq = self._pool.run(work, read=False)
        self._changes.saw(seq)  # our own write: no need to wait for its notification
        return version

    @staticmethod
    def _candidate(conn: psycopg.Connection, bot_id: str,
                   active: int | None) -> tuple[int, CandidateMode] | None:
        """(version, mode) of the bot's candidate, or None (also for a row naming the active
        version, which a build without candidates may leave after rolling back to it)."""
        row = conn.execute(f"SELECT version, mode, percent FROM {S}.candidates "
                           "WHERE bot_id = %s", (bot_id,)).fetchone()
        if row is None or int(row[0]) == active:
            return None
        return int(row[0]), CandidateMode(row[1], row[2])

    def _drop_candidate(self, conn: psycopg.Connection, bot_id: str, version: int,
                        at: str) -> None:
        """The candidate row and its version (its blobs cascade) go; history "discard"."""
        conn.execute(f"DELETE FROM {S}.candidates WHERE bot_id = %s", (bot_id,))
        conn.execute(f"DELETE FROM {S}.versions WHERE bot_id = %s AND version = %s",
                     (bot_id, version))
        self._history(conn, bot_id, "discard", version, None, at, None)

    def _digest(self, conn: psycopg.Connection, bot_id: str, version: int) -> str | None:
        digests = dict(conn.execute(
            f"SELECT name, sha256 FROM {S}.blobs WHERE bot_id = %s AND version = %s",
            (bot_id, version)).fetchall())
        return combine_digests(digests) if digests else None

    def _required_candidate(self, conn: psycopg.Connection, bot_id: str
                            ) -> tuple[int, int, CandidateMode]:
        return required_candidate(bot_id, self._active_version(conn, bot_id),
                                  lambda active: self._candidate(conn, bot_id, active))

    def promote(self, bot_id: str, *, actor: str = OPERATOR) -> tuple[int, int]:
        def change(conn, rows):
            active, version, mode = self._required_candidate(conn, bot_id)
            at = utc_now()
            conn.execute(f"DELETE FROM {S}.candidates WHERE bot_id = %s", (bot_id,))
            conn.execute(f"UPDATE {S}.bots SET active_version = %s, updated = %s "
                         "WHERE bot_id = %s", (version, at, bot_id))
            self._history(conn, bot_id, "promote", version, active, at, None)
            rows.record(at=at, actor=actor, action="candidate_promote", tenant=rows.owner(bot_id),
                        bot_id=bot_id, version=version,
                        digest=self._digest(conn, bot_id, version),
                        detail=f"{mode}, from v{active}")
            return active, version

        return self._write(change)

    def discard(self, bot_id: str, *, actor: str = OPERATOR) -> int:
        def change(conn, rows):
            active, version, mode = self._required_candidate(conn, bot_id)
            at = utc_now()
            digest = self._digest(conn, bot_id, version)
            self._drop_candidate(conn, bot_id, version, at)
            rows.record(at=at, actor=actor, action="candidate_discard",
                        tenant=rows.owner(bot_id), bot_id=bot_id, version=version,
                        digest=digest, detail=str(mode))
            return version

        return self._write(change)

    def remove(self, bot_id: str, *, actor: str = OPERATOR) -> None:
        def work(conn):
            self._ensure_schema(conn)
            with conn.transaction():
                seq = self._begin_write(conn)
                if self._active_version(conn, bot_id) is None:
                    raise UnknownBot(bot_id)
                self._remove_bot(conn, bot_id, utc_now(), actor)
                notify(conn, seq)
            return seq

        self._changes.saw(self._pool.run(work, read=False))

    def _remove_bot(self, conn: psycopg.Connection, bot_id: str, at: str, actor: str) -> None:
        rows = _rows(conn)
        previous, tenant = self._active_version(conn, bot_id), rows.owner(bot_id)
        # The owners and candidates rows go with the bots row, the blobs with their versions
        # (ON DELETE CASCADE).
        conn.execute(f"DELETE FROM {S}.bots WHERE bot_id = %s", (bot_id,))
        conn.execute(f"DELETE FROM {S}.versions WHERE bot_id = %s", (bot_id,))
        self._history(conn, bot_id, "remove", None, previous, at, None)
        rows.record(at=at, actor=actor, action="remove", tenant=tenant, bot_id=bot_id,
                    version=previous)

    def rollback(self, bot_id: str, choose: Callable[[int, list[int]], int], *,
                 actor: str = OPERATOR) -> int:
        def work(conn):
            self._ensure_schema(conn)
            committed = None
            with conn.transaction():
                seq = self._begin_write(conn)
                active = self._active_version(conn, bot_id)
                if active is None:
                    raise UnknownBot(bot_id)
                candidate = self._candidate(conn, bot_id, active)
                versions = [int(r[0]) for r in conn.execute(
                    f"SELECT version FROM {S}.versions WHERE bot_id = %s ORDER BY version",
                    (bot_id,)) if candidate is None or int(r[0]) != candidate[0]]
                target = choose(active, versions)
                if target == active:
                    raise psycopg.Rollback()  # nothing changes: no change_seq, no notification
                at = utc_now()
                conn.execute(f"UPDATE {S}.bots SET active_version = %s, updated = %s "
                             "WHERE bot_id = %s", (target, at, bot_id))
                self._history(conn, bot_id, "rollback", target, active, at, None)
                rows = _rows(conn)
                rows.record(at=at, actor=actor, action="rollback", tenant=rows.owner(bot_id),
                            bot_id=bot_id, version=target,
                            digest=self._digest(conn, bot_id, target),
                            detail=f"from v{active}")
                notify(conn, seq)
                committed = seq
            return target, committed

        target, seq = self._pool.run(work, read=False)
        if seq is not None:
            self._changes.saw(seq)
        return target

    # -- tenants, keys, audit ------------------------------------------------------------------

    def _write(self, change: Callable[[psycopg.Connection, Rows], object]) -> object:
        """`change(conn, rows)` in one write transaction that notifies every process (unless it
        raises: then nothing is written)."""
        def work(conn):
            self._ensure_schema(conn)
            out = (None, None)
            with conn.transaction():
                seq = self._begin_write(conn)
                result = change(conn, _rows(conn))  # psycopg.Rollback: nothing changes
                notify(conn, seq)
                out = (result, seq)
            return out

        result, seq = self._pool.run(work, read=False)
        if seq is not None:
            self._changes.saw(seq)
        return result

    def _read_rows(self, read: Callable[[Rows], object]) -> object:
        return self._pool.run(lambda conn: read(_rows(conn)), read=True)

    def add_tenant(self, name: str, *, actor: str,
                   limits: TenantLimits | None = None) -> TenantInfo:
        return self._write(lambda conn, rows: rows.create_tenant(name, actor, limits))

    def tenants(self) -> list[TenantInfo]:
        return self._read_rows(lambda rows: rows.tenants())

    def set_limits(self, name: str, changes: dict, *, actor: str) -> TenantLimits:
        return self._write(lambda conn, rows: rows.set_limits(name, changes, actor))

    def tenant_limits(self) -> dict[str, TenantLimits]:
        return self._read_rows(lambda rows: rows.tenant_limits())

    def remove_tenant(self, name: str, *, force: bool, actor: str) -> None:
        self._write(lambda conn, rows: rows.drop_tenant(
            name, force=force, actor=actor,
            remove_bot=lambda bot_id, at: self._remove_bot(conn, bot_id, at, actor)))

    def add_key(self, key: ApiKey, *, actor: str) -> None:
        self._write(lambda conn, rows: rows.create_key(key, actor))

    def keys(self, tenant: str | None = None, *, live_only: bool = False) -> list[ApiKey]:
        return self._read_rows(lambda rows: rows.keys(tenant, live_only=live_only))

    def revoke_key(self, key_id: str, *, actor: str) -> ApiKey:
        key = self._read_rows(lambda rows: rows.key(key_id))  # unknown or revoked: no write
        if key is None:
            raise UnknownKey(key_id)
        if key.revoked is not None:
            return key
        return self._write(lambda conn, rows: rows.revoke(key_id, actor))

    def mark_used(self, used: dict[str, str]) -> None:
        # Not a change other processes need to see: no writer lock, no change_seq, no NOTIFY.
        def work(conn):
            try:
                with conn.transaction():
                    _rows(conn).mark_used(used)
            except NO_SCHEMA:
                pass  # no keys in this store

        self._pool.run(work, read=False)

    def audit(self, *, tenant: str | None, since: str | None, limit: int) -> list[AuditRecord]:
        return self._read_rows(lambda rows: rows.audit(tenant=tenant, since=since, limit=limit))

    def _ensure_schema(self, conn: psycopg.Connection) -> None:
        if not self._schema_ready:
            ensure_schema(conn)
            self._schema_ready = True

    @staticmethod
    def _begin_write(conn: psycopg.Connection) -> int:
        """The first statement of every write transaction: takes the store's writer lock (the
        state row) until commit and returns this transaction's change_seq."""
        row = conn.execute(
            f"UPDATE {S}.state SET change_seq = change_seq + 1 RETURNING change_seq").fetchone()
        return int(row[0])

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

    # -- housekeeping --------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()
        self._pool.close()
