"""A PostgreSQL store as the source or the destination of a copy (`store.ops.dump`).

Its snapshot (`PgSnapshot`) is one REPEATABLE READ, READ ONLY transaction, open until the
snapshot is closed: every row and every blob read is of the same moment, whatever is written
meanwhile, and nobody waits for it. As a destination (`PgTarget`), a few bots are one write
transaction of `store.pg.database` (writer lock, NOTIFY at commit): each one's versions rows
and blobs (`PgBlobs.write`), then its other rows; the tenants, keys, history and audit go last,
with their ids, and the identity counters are moved past them.
"""
from __future__ import annotations

import psycopg
from psycopg.types.json import Jsonb

from heads.head import Head
from store.backend import redact_url
from store.ops.dump import (
    DATA_TABLES,
    GLOBAL_TABLES,
    MARKER,
    MARKER_BOTS,
    MARKER_STATEMENTS,
    SERIAL_TABLES,
    BotRows,
    Snapshot,
    Target,
    columns,
    json_columns,
)
from store.pg.blobs import PgBlobs, decode
from store.pg.database import Database
from store.pg.listener import Changes
from store.pg.pool import Pool
from store.pg.schema import SCHEMA as S


def _present(conn: psycopg.Connection) -> set[str]:
    return {r[0] for r in conn.execute(
        "SELECT tablename FROM pg_catalog.pg_tables WHERE schemaname = %s", (S,))}


def _marker(conn: psycopg.Connection) -> tuple[str | None, dict[str, str]]:
    row = conn.execute(f"SELECT source FROM {S}.{MARKER}").fetchone()
    done = dict(conn.execute(f"SELECT bot_id, fingerprint FROM {S}.{MARKER_BOTS}").fetchall())
    return (row[0] if row is not None else "(unknown)"), done


class PgSnapshot(Snapshot):
    """One consistent read of a PostgreSQL store (see the module's docstring)."""

    def __init__(self, url: str) -> None:
        where = redact_url(url)
        self.identity = f"postgresql:{where}"
        self._conn = Pool(url, where).connect()
        try:
            self._conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            present = _present(self._conn)
            self.rows = {}
            for t in DATA_TABLES:
                names = columns(t.name)
                found = (self._conn.execute(
                    f"SELECT {', '.join(names)} FROM {S}.{t.name} "
                    f"ORDER BY {', '.join(t.primary_key)}").fetchall()
                    if t.name in present else [])
                self.rows[t.name] = [dict(zip(names, r)) for r in found]
            if MARKER in present:
                self.incomplete = _marker(self._conn)[0]
        except BaseException:
            self._conn.close()
            raise
        self._n_classes = {(r["bot_id"], int(r["version"])): int(r["n_classes"])
                           for r in self.rows["versions"]}

    def head(self, bot_id: str, version: int) -> Head:
        with self._conn.cursor(binary=True) as cur:
            cur.execute(f"SELECT name, data, sha256 FROM {S}.blobs "
                        "WHERE bot_id = %s AND version = %s", (bot_id, version))
            blobs = {name: (bytes(data), digest) for name, data, digest in cur.fetchall()}
        return decode(bot_id, version, self._n_classes.get((bot_id, version), 0), blobs)

    def orphans(self) -> list[str]:
        if "blobs" not in _present(self._conn):
            return []
        # Cannot happen (blobs reference their version, ON DELETE CASCADE): looked for anyway.
        return [f"blobs of {b} v{v}" for b, v in self._conn.execute(
            f"SELECT DISTINCT b.bot_id, b.version FROM {S}.blobs b WHERE NOT EXISTS "
            f"(SELECT 1 FROM {S}.versions v WHERE v.bot_id = b.bot_id "
            "AND v.version = b.version) ORDER BY 1, 2")]

    def close(self) -> None:
        if not self._conn.closed:
            self._conn.close()  # the read-only transaction ends with it


def _insert(conn: psycopg.Connection, name: str, rows: list[dict]) -> None:
    if not rows:
        return
    names = columns(name)
    encoded = json_columns(name)
    overriding = " OVERRIDING SYSTEM VALUE" if name in SERIAL_TABLES else ""
    with conn.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {S}.{name} ({', '.join(names)}){overriding} "
            f"VALUES ({', '.join(['%s'] * len(names))})",
            [tuple(Jsonb(r[n]) if n in encoded else r[n] for n in names) for r in rows])


def _delete(conn: psycopg.Connection, bot_id: str) -> None:
    # owners and candidates reference bots, bots references versions; blobs go with versions.
    for name in ("owners", "candidates", "bots", "versions", MARKER_BOTS):
        conn.execute(f"DELETE FROM {S}.{name} WHERE bot_id = %s", (bot_id,))


class PgTarget(Target):
    """A PostgreSQL store being written by a copy (nothing is created until `begin`)."""

    def __init__(self, url: str) -> None:
        self._where = redact_url(url)
        self._pool = Pool(url, self._where)
        self._db = Database(self._pool, Changes(self._pool, self._where))
        self._blobs = PgBlobs(self._db)

    def describe(self) -> str:
        return self._where

    def progress(self) -> tuple[str | None, dict[str, str]] | None:
        def work(conn):
            present = _present(conn)
            if MARKER in present and MARKER_BOTS in present:
                return _marker(conn)
            for t in DATA_TABLES:
                if t.name in present and conn.execute(
                        f"SELECT 1 FROM {S}.{t.name} LIMIT 1").fetchone() is not None:
                    return None, {}
            return None

        return self._pool.run(work, read=False)

    def begin(self, source: str, started: str) -> None:
        def change(conn):
            for statement in MARKER_STATEMENTS:
                conn.execute(statement.format(p=f"{S}."))
            conn.execute(f"DELETE FROM {S}.{MARKER}")
            conn.execute(f"INSERT INTO {S}.{MARKER} VALUES (%s, %s)", (source, started))

        self._db.write(change)

    def write_bots(self, batch: list[tuple[BotRows, list[Head]]]) -> None:
        def change(conn):
            for bot, heads in batch:
                _delete(conn, bot.bot_id)
                _insert(conn, "versions", bot.versions)
                for row, head in zip(bot.versions, heads, strict=True):
                    self._blobs.write(conn, bot.bot_id, int(row["version"]), head.weights,
                                      head.biases, head.labels, created=row["created"],
                                      source=row["source"], step=lambda name: None)
                _insert(conn, "bots", [bot.bot])
                _insert(conn, "owners", [bot.owner] if bot.owner else [])
                _insert(conn, "candidates", [bot.candidate] if bot.candidate else [])
                conn.execute(f"INSERT INTO {S}.{MARKER_BOTS} VALUES (%s, %s)",
                             (bot.bot_id, bot.fingerprint()))

        self._db.write(change)

    def drop_bot(self, bot_id: str) -> None:
        self._db.write(lambda conn: _delete(conn, bot_id))

    def finish(self, rows: dict[str, list[dict]]) -> None:
        def change(conn):
            for name in GLOBAL_TABLES:
                conn.execute(f"DELETE FROM {S}.{name}")
                _insert(conn, name, rows.get(name, []))
            for name in SERIAL_TABLES:
                conn.execute(
                    f"SELECT setval(pg_get_serial_sequence('{S}.{name}', 'id'), "
                    f"COALESCE((SELECT max(id) FROM {S}.{name}), 0) + 1, false)")
            conn.execute(f"DROP TABLE {S}.{MARKER_BOTS}")
            conn.execute(f"DROP TABLE {S}.{MARKER}")

        self._db.write(change)

    def close(self) -> None:
        self._pool.close()
