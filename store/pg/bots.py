"""The bots of a PostgreSQL store: the registry rows, each write one transaction of
`store.pg.database` (writer lock, rows, blobs, audit record, NOTIFY at commit)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import psycopg
from psycopg.types.json import Jsonb

from accounts.candidates import CandidateInfo, CandidateMode, required_candidate
from accounts.errors import BotOwnedElsewhere, UnknownTenant
from accounts.tenants import DEFAULT_TENANT, OPERATOR, TenantLimits, utc_now
from heads.errors import UnknownBot
from store.bots import BotRow, Bots, Step, VersionRow
from store.pg.blobs import PgBlobs
from store.pg.database import Database, Unchanged, rows
from store.pg.schema import NO_SCHEMA
from store.pg.schema import SCHEMA as S
from store.schema import STORING_ACTIONS


def active_version(conn: psycopg.Connection, bot_id: str) -> int | None:
    row = conn.execute(f"SELECT active_version FROM {S}.bots WHERE bot_id = %s",
                       (bot_id,)).fetchone()
    return None if row is None else int(row[0])


def _history(conn, bot_id, action, version, previous, at, source) -> None:
    conn.execute(f"INSERT INTO {S}.history (bot_id, action, version, previous, at, source) "
                 "VALUES (%s, %s, %s, %s, %s, %s)",
                 (bot_id, action, version, previous, at, source))


def _candidate(conn: psycopg.Connection, bot_id: str,
               active: int | None) -> tuple[int, CandidateMode] | None:
    """(version, mode) of the bot's candidate, or None (also for a row naming the active
    version, which a build without candidates may leave after rolling back to it)."""
    row = conn.execute(f"SELECT version, mode, percent FROM {S}.candidates "
                       "WHERE bot_id = %s", (bot_id,)).fetchone()
    if row is None or int(row[0]) == active:
        return None
    return int(row[0]), CandidateMode(row[1], row[2])


def _drop_candidate(conn: psycopg.Connection, bot_id: str, version: int, at: str) -> None:
    """The candidate row and its version (its blobs cascade) go; history "discard"."""
    conn.execute(f"DELETE FROM {S}.candidates WHERE bot_id = %s", (bot_id,))
    conn.execute(f"DELETE FROM {S}.versions WHERE bot_id = %s AND version = %s",
                 (bot_id, version))
    _history(conn, bot_id, "discard", version, None, at, None)


def _required_candidate(conn: psycopg.Connection, bot_id: str
                        ) -> tuple[int, int, CandidateMode]:
    return required_candidate(bot_id, active_version(conn, bot_id),
                              lambda active: _candidate(conn, bot_id, active))


class PgBots(Bots):
    """The registry rows of a PostgreSQL store; the blobs are `blobs`'."""

    def __init__(self, db: Database, blobs: PgBlobs) -> None:
        self._db = db
        self._blobs = blobs

    # -- reads ------------------------------------------------------------------------------------

    def active_map(self) -> dict[str, tuple[int, str]]:
        def work(conn):
            try:
                # One statement, one snapshot: bots and owners agree.
                found = conn.execute(
                    f"SELECT b.bot_id, b.active_version, COALESCE(o.tenant, %s) "
                    f"FROM {S}.bots b LEFT JOIN {S}.owners o ON o.bot_id = b.bot_id",
                    (DEFAULT_TENANT,)).fetchall()
            except NO_SCHEMA:  # no schema, or one made before tenants (no owners table)
                try:
                    found = [(b, v, DEFAULT_TENANT) for b, v in conn.execute(
                        f"SELECT bot_id, active_version FROM {S}.bots").fetchall()]
                except NO_SCHEMA:
                    return {}
            return {b: (int(v), t) for b, v, t in found}

        return self._db.read(work)

    def rows(self, bot_id: str | None = None) -> list[BotRow]:
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

        return [BotRow(VersionRow(b, int(version), int(n), tuple(labels), created, source),
                       [int(x) for x in versions], tenant)
                for b, version, n, labels, created, source, versions, tenant
                in self._db.read(work)]

    def history(self, bot_id: str) -> list[dict]:
        def work(conn):
            try:
                return conn.execute(
                    f"SELECT action, version, previous, at, source FROM {S}.history "
                    "WHERE bot_id = %s ORDER BY id", (bot_id,)).fetchall()
            except NO_SCHEMA:
                return []

        keys = ("action", "version", "previous", "at", "source")
        return [dict(zip(keys, r)) for r in self._db.read(work)]

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
                for b, v, mode, percent, n, labels, created, source in self._db.read(work)}

    # -- writes -----------------------------------------------------------------------------------

    def add_version(self, bot_id: str, weights: np.ndarray, biases: np.ndarray,
                    labels: tuple[str, ...], source: str, step: Step, *,
                    tenant: str = DEFAULT_TENANT, actor: str = OPERATOR,
                    candidate: CandidateMode | None = None,
                    defaults: TenantLimits | None = None) -> int:
        n = int(weights.shape[1])

        def change(conn):
            accounts = rows(conn)
            # Refusals first: nothing written (the transaction rolls back).
            if not accounts.tenant_exists(tenant):
                raise UnknownTenant(tenant)
            previous = active_version(conn, bot_id)
            if candidate is not None and previous is None:
                raise UnknownBot(bot_id)  # a candidate is a candidate to a live version
            if previous is not None and accounts.owner(bot_id) != tenant:
                raise BotOwnedElsewhere(bot_id)
            row = conn.execute(
                f"SELECT GREATEST((SELECT max(version) FROM {S}.history "
                "WHERE bot_id = %s AND action = ANY(%s)), "
                f"(SELECT max(version) FROM {S}.versions WHERE bot_id = %s))",
                (bot_id, list(STORING_ACTIONS), bot_id)).fetchone()
            version = 1 + int(row[0] or 0)
            live = _candidate(conn, bot_id, previous) if previous is not None else None
            pruned = accounts.storage_plan(
                tenant, bot_id, version=version, n_classes=n, previous=previous,
                candidate=None if live is None else live[0],
                as_candidate=candidate is not None, defaults=defaults)
            note = f"; pruned {', '.join(f'v{v}' for v in pruned)}" if pruned else ""
            created = utc_now()
            conn.execute(f"INSERT INTO {S}.versions VALUES (%s, %s, %s, %s, %s, %s)",
                         (bot_id, version, n, Jsonb(list(labels)), created, source))
            digest = self._blobs.write(conn, bot_id, version, weights, biases, labels,
                                       created=created, source=source, step=step)
            # Pruned versions go with their blobs (ON DELETE CASCADE), in this transaction.
            for old in pruned:
                conn.execute(f"DELETE FROM {S}.versions WHERE bot_id = %s AND version = %s",
                             (bot_id, old))
            if candidate is None:
                conn.execute(
                    f"INSERT INTO {S}.bots VALUES (%s, %s, %s) ON CONFLICT (bot_id) DO "
                    "UPDATE SET active_version = excluded.active_version, "
                    "updated = excluded.updated", (bot_id, version, created))
                _history(conn, bot_id, "register", version, previous, created, source)
                accounts.set_owner(bot_id, tenant)
                accounts.record(at=created, actor=actor,
                                action="register" if previous is None else "replace",
                                tenant=tenant, bot_id=bot_id, version=version, digest=digest,
                                detail=source + note)
            else:
                _history(conn, bot_id, "candidate", version, previous, created, source)
                replaced = _candidate(conn, bot_id, previous)
                if replaced is not None:
                    _drop_candidate(conn, bot_id, replaced[0], created)
                    accounts.record(at=created, actor=actor, action="candidate_discard",
                                    tenant=tenant, bot_id=bot_id, version=replaced[0],
                                    detail=f"{replaced[1]}, replaced by v{version}")
                conn.execute(
                    f"INSERT INTO {S}.candidates VALUES (%s, %s, %s, %s, %s) "
                    "ON CONFLICT (bot_id) DO UPDATE SET version = excluded.version, "
                    "mode = excluded.mode, percent = excluded.percent, "
                    "created = excluded.created",
                    (bot_id, version, candidate.mode, candidate.percent, created))
                accounts.record(at=created, actor=actor, action="candidate_add",
                                tenant=tenant, bot_id=bot_id, version=version, digest=digest,
                                detail=f"{candidate}, {source}{note}")
            return version

        # "rows_added": registry rows and NOTIFY done, before COMMIT.
        return self._db.write(change, before_commit=lambda: step("rows_added"))

    def promote(self, bot_id: str, *, actor: str = OPERATOR) -> tuple[int, int]:
        def change(conn):
            active, version, mode = _required_candidate(conn, bot_id)
            at = utc_now()
            conn.execute(f"DELETE FROM {S}.candidates WHERE bot_id = %s", (bot_id,))
            conn.execute(f"UPDATE {S}.bots SET active_version = %s, updated = %s "
                         "WHERE bot_id = %s", (version, at, bot_id))
            _history(conn, bot_id, "promote", version, active, at, None)
            accounts = rows(conn)
            accounts.record(at=at, actor=actor, action="candidate_promote",
                            tenant=accounts.owner(bot_id), bot_id=bot_id, version=version,
                            digest=self._blobs.digest(conn, bot_id, version),
                            detail=f"{mode}, from v{active}")
            return active, version

        return self._db.write(change)

    def discard(self, bot_id: str, *, actor: str = OPERATOR) -> int:
        def change(conn):
            active, version, mode = _required_candidate(conn, bot_id)
            at = utc_now()
            digest = self._blobs.digest(conn, bot_id, version)
            _drop_candidate(conn, bot_id, version, at)
            accounts = rows(conn)
            accounts.record(at=at, actor=actor, action="candidate_discard",
                            tenant=accounts.owner(bot_id), bot_id=bot_id, version=version,
                            digest=digest, detail=str(mode))
            return version

        return self._db.write(change)

    def remove(self, bot_id: str, *, actor: str = OPERATOR) -> None:
        def change(conn):
            if active_version(conn, bot_id) is None:
                raise UnknownBot(bot_id)
            self.unregister(conn, bot_id, utc_now(), actor)

        self._db.write(change)

    def unregister(self, conn: psycopg.Connection, bot_id: str, at: str, actor: str) -> None:
        """The rows of live bot `bot_id` go, audited "remove", in the write transaction of
        `conn` (the owners and candidates rows with the bots row, the blobs with their versions:
        ON DELETE CASCADE). Also the accounts part's, for a tenant removed with its bots."""
        accounts = rows(conn)
        previous, tenant = active_version(conn, bot_id), accounts.owner(bot_id)
        conn.execute(f"DELETE FROM {S}.bots WHERE bot_id = %s", (bot_id,))
        conn.execute(f"DELETE FROM {S}.versions WHERE bot_id = %s", (bot_id,))
        _history(conn, bot_id, "remove", None, previous, at, None)
        accounts.record(at=at, actor=actor, action="remove", tenant=tenant, bot_id=bot_id,
                        version=previous)

    def rollback(self, bot_id: str, choose: Callable[[int, list[int]], int], *,
                 actor: str = OPERATOR) -> int:
        def change(conn):
            active = active_version(conn, bot_id)
            if active is None:
                raise UnknownBot(bot_id)
            candidate = _candidate(conn, bot_id, active)
            versions = [int(r[0]) for r in conn.execute(
                f"SELECT version FROM {S}.versions WHERE bot_id = %s ORDER BY version",
                (bot_id,)) if candidate is None or int(r[0]) != candidate[0]]
            target = choose(active, versions)
            if target == active:
                raise Unchanged(target)  # no change_seq, no notification
            at = utc_now()
            conn.execute(f"UPDATE {S}.bots SET active_version = %s, updated = %s "
                         "WHERE bot_id = %s", (target, at, bot_id))
            _history(conn, bot_id, "rollback", target, active, at, None)
            accounts = rows(conn)
            accounts.record(at=at, actor=actor, action="rollback",
                            tenant=accounts.owner(bot_id), bot_id=bot_id, version=target,
                            digest=self._blobs.digest(conn, bot_id, target),
                            detail=f"from v{active}")
            return target

        return self._db.write(change)
