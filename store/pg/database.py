"""The transactions of a PostgreSQL store, shared by its bots and accounts parts: reads on a
pooled connection, and the one shape of every write transaction.

A write transaction starts by taking the store's writer lock (`begin_write`: the `state` row,
whose change_seq it increments) and ends with `NOTIFY multihead_heads, '<change_seq>'`
(`store.pg.listener.notify`), delivered to the listeners of every process at COMMIT. A writer
killed at any point leaves nothing visible: the server rolls its transaction back.
"""
from __future__ import annotations

from collections.abc import Callable

import psycopg

from accounts.rows import Rows
from store.pg.listener import Changes, notify
from store.pg.pool import Pool
from store.pg.schema import NO_SCHEMA, ensure_schema
from store.pg.schema import SCHEMA as S


class Unchanged(Exception):
    """Raised by a write that finds nothing to change: its transaction rolls back (no
    change_seq, no notification) and `Database.write` returns `result`."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self.result = result


def rows(conn: psycopg.Connection) -> Rows:
    """The tenants, keys, owners and audit rows (`accounts.rows`) through `conn`."""
    return Rows(conn, prefix=f"{S}.", missing=lambda exc: isinstance(exc, NO_SCHEMA))


def begin_write(conn: psycopg.Connection) -> int:
    """The first statement of every write transaction: takes the store's writer lock (the
    state row) until commit and returns this transaction's change_seq."""
    row = conn.execute(
        f"UPDATE {S}.state SET change_seq = change_seq + 1 RETURNING change_seq").fetchone()
    return int(row[0])


class Database:
    """Reads and write transactions of one store. Thread-safe."""

    def __init__(self, pool: Pool, changes: Changes) -> None:
        self.pool = pool
        self._changes = changes
        self._schema_ready = False

    def read(self, work: Callable[[psycopg.Connection], object]) -> object:
        """`work(conn)` on a pooled autocommit connection (`Pool.run`: StoreUnavailable)."""
        return self.pool.run(work, read=True)

    def read_rows(self, read: Callable[[Rows], object]) -> object:
        return self.read(lambda conn: read(rows(conn)))

    def write(self, change: Callable[[psycopg.Connection], object], *,
              before_commit: Callable[[], None] | None = None) -> object:
        """`change(conn)` in one write transaction that notifies every process, creating the
        schema first if the store has none. Returns what `change` returns; if it raises,
        nothing is written (`Unchanged`: its result is returned).

        Args:
            before_commit: called after the notification, just before COMMIT (a test seam's
                last step).
        """
        def work(conn):
            self.ensure_schema(conn)
            try:
                with conn.transaction():
                    seq = begin_write(conn)
                    result = change(conn)
                    notify(conn, seq)
                    if before_commit is not None:
                        before_commit()
            except Unchanged as exc:
                return exc.result, None
            return result, seq

        result, seq = self.pool.run(work, read=False)
        if seq is not None:
            self._changes.saw(seq)  # our own write: no need to wait for its notification
        return result

    def ensure_schema(self, conn: psycopg.Connection) -> None:
        if not self._schema_ready:
            ensure_schema(conn)
            self._schema_ready = True
