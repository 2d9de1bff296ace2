"""The leases part of a PostgreSQL store (`store.leases`): the table `serving_processes` of the
schema `multihead`, made by `store.pg.schema.ensure_schema` like every other (a store made
before it gains it at the first beat). A beat is not a write of the store's data: it takes no
writer lock, moves no change_seq and notifies nobody. Time: the database's clock, one for
every machine."""
from __future__ import annotations

import psycopg

from store.leases import Lease, Leases
from store.pg.database import Database
from store.pg.schema import SCHEMA as S

_NOW = "extract(epoch FROM clock_timestamp())::double precision"


class PgLeases(Leases):
    """The leases of the serving processes of one PostgreSQL store."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def beat(self, lease: Lease, ttl_s: float) -> int:
        def work(conn: psycopg.Connection) -> int:
            self._db.ensure_schema(conn)
            with conn.transaction():
                conn.execute(
                    f"INSERT INTO {S}.serving_processes VALUES (%s, %s, %s, %s, {_NOW}) "
                    "ON CONFLICT (id) DO UPDATE SET seen = excluded.seen",
                    (lease.id, lease.host, lease.pid, lease.started))
                conn.execute(f"DELETE FROM {S}.serving_processes WHERE seen < {_NOW} - %s",
                             (float(ttl_s),))
                row = conn.execute(f"SELECT count(*) FROM {S}.serving_processes").fetchone()
            return int(row[0])

        return self._db.pool.run(work, read=False)

    def leave(self, lease_id: str) -> None:
        self._db.pool.run(lambda conn: conn.execute(
            f"DELETE FROM {S}.serving_processes WHERE id = %s", (lease_id,)), read=False)
