"""The schema `multihead` of a PostgreSQL store: its tables (rendered from `store.schema`), the
one row of `state`, and creating them once, by the first writer.

    state(singleton, schema_version, change_seq)   one row; change_seq grows by one per write
                                                   transaction, which also takes its row lock
                                                   first (writers are serialised, as with the
                                                   flock of a directory store)
    versions(bot_id, version, n_classes, labels jsonb, created, source)   every stored version
    blobs(bot_id, version, name, data bytea, sha256)   per version: see `store.pg.blobs`
    bots(bot_id, active_version, updated)          one row per live bot
    history(id, bot_id, action, version, previous, at, source)   append-only audit trail; also
                                                   keeps version numbers from being reused
    tenants, tenant_limits, api_keys, owners,      tenants, their limits, keys and bots, and
    audit                                          the audit log (see `accounts.tenants`); added to
                                                   a store made before them by its next writer,
                                                   which also replaces a check on audit.action
                                                   or history.action that lacks a newer action
                                                   (`_stale_checks`)
    candidates(bot_id, version, mode, percent,     the candidate of a bot (`accounts.candidates`),
               created)                            likewise added
    serving_processes(id, host, pid, started,      the serving processes' leases
                      seen)                        (`store.leases`), likewise added, by the
                                                   first beat as well as by a writer
"""
from __future__ import annotations

import logging

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from store.backend import POSTGRESQL
from store.schema import GROWING_CHECKS, check_constraint, create_statements, stale_check, tables

log = logging.getLogger(__name__)

SCHEMA = "multihead"
SCHEMA_VERSION = 1
# pg_advisory_xact_lock key serialising schema creation between processes ("mhschema").
_DDL_LOCK_KEY = 0x6D68736368656D61
# A database in which no registration ever happened: reads see an empty store.
NO_SCHEMA = (pg_errors.UndefinedTable, pg_errors.InvalidSchemaName)


def ddl(only: set[str] | None = None) -> list[str]:
    """Every statement that creates the store's schema, in order (idempotent); with `only`, the
    statements of just those tables (the ones an existing store lacks)."""
    return [f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}",
            *create_statements(POSTGRESQL, prefix=f"{SCHEMA}.", only=only),
            f"INSERT INTO {SCHEMA}.state (schema_version, change_seq) "
            f"VALUES ({SCHEMA_VERSION}, 0) ON CONFLICT DO NOTHING"]


def ensure_schema(conn: psycopg.Connection) -> None:
    """Create the schema unless it exists, and renew its stale checks (on an autocommit
    connection)."""
    # DDL is transactional: the tables exist all together or not at all. Check first, so that a
    # role allowed to write rows but not to create schemas works once they exist.
    if not _missing(conn) and not _stale_checks(conn):
        return
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK_KEY,))
        # NOTE: check again under the lock. A writer that waited here while another created the
        # schema must not run the DDL too: its ALTER TABLE and CREATE INDEX would lock tables
        # that the other one's first registration is writing (a deadlock). For the same reason
        # a store made by an earlier version gets the statements of its missing tables only.
        missing = _missing(conn)
        if missing:
            everything = missing == {t.name for t in tables(POSTGRESQL)}
            for statement in ddl(None if everything else missing):
                conn.execute(statement)
        for table, old in _stale_checks(conn).items():
            # A store written before an audit action existed refuses it: replace the check
            # (ADD CONSTRAINT checks the rows there are, which the old check allowed already).
            name, check = check_constraint(table)
            conn.execute(sql.SQL("ALTER TABLE {}.{} DROP CONSTRAINT {}, ADD CONSTRAINT {} "
                                 "CHECK ({})").format(
                sql.Identifier(SCHEMA), sql.Identifier(table), sql.Identifier(old),
                sql.Identifier(name), sql.SQL(check)))
            log.info("PostgreSQL store: the check of %s.%s replaced, allowing what this version "
                     "writes", SCHEMA, table)


def _stale_checks(conn: psycopg.Connection) -> dict[str, str]:
    """{table: the name of its check} of each `GROWING_CHECKS` table whose check lacks a value
    this version writes (a store written before "tenant_set": its audit.action check)."""
    out = {}
    for table, (column, _) in GROWING_CHECKS.items():
        for name, definition in conn.execute(
                "SELECT c.conname, pg_get_constraintdef(c.oid) FROM pg_catalog.pg_constraint c "
                "JOIN pg_catalog.pg_class r ON r.oid = c.conrelid "
                "JOIN pg_catalog.pg_namespace n ON n.oid = r.relnamespace "
                "JOIN pg_catalog.pg_attribute a ON a.attrelid = r.oid "
                "AND a.attnum = ANY (c.conkey) "
                "WHERE n.nspname = %s AND r.relname = %s AND c.contype = 'c' AND a.attname = %s",
                (SCHEMA, table, column)):
            if stale_check(table, definition):
                out[table] = name
    return out


def _missing(conn: psycopg.Connection) -> set[str]:
    """The store's tables that do not exist (all of them before the first write)."""
    # NOTE: a query of the catalog, not to_regclass(): that one answers from this backend's
    # cache, which may still hold "no such schema" from before the lock was taken.
    present = {r[0] for r in conn.execute(
        "SELECT tablename FROM pg_catalog.pg_tables WHERE schemaname = %s", (SCHEMA,))}
    return {t.name for t in tables(POSTGRESQL)} - present


def read_seq(conn: psycopg.Connection) -> int:
    """The store's change_seq now (0 before the schema exists)."""
    try:
        row = conn.execute(f"SELECT change_seq FROM {SCHEMA}.state").fetchone()
    except NO_SCHEMA:
        return 0
    return int(row[0]) if row is not None else 0
