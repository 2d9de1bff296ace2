"""One schema description (`store.schema.TABLES`), two backends: the live schema of a real SQLite
registry and of a real PostgreSQL store, introspected, match it; stores written before the
description existed (commit 42dd771, whose DDL is kept here verbatim) open and work unchanged;
and stores written before tenant limits (d17eb97: an audit check without "tenant_set") gain
the new check at their first write, their audit records kept."""
from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from accounts import BotOwnedElsewhere, CandidateMode
from accounts.tenants import AUDIT_ACTIONS, TenantLimits
from heads import files
from store import open_store
from store.backend import POSTGRESQL, SQLITE
from store.schema import (
    BIGINT,
    DIALECTS,
    LEASE_TABLE,
    SERIAL,
    TABLES,
    Table,
    create_statements,
    stale_check,
    tables,
)
from tests.support.heads import pg_execute, random_head, store_digest, tree_digest

# -- introspection ---------------------------------------------------------------------------


def expected_schema(dialect: str, of: list[Table] | None = None) -> dict:
    """What `store.schema` says a store of `dialect` has (only the tables `of` if given), in the
    shape the introspection gives."""
    d = DIALECTS[dialect]
    out = {}
    for t in tables(dialect) if of is None else of:
        out[t.name] = {
            # (name, declared type, nullable, default, identity)
            "columns": [(c.name, d.types[BIGINT if c.type == SERIAL else c.type], c.nullable,
                         c.default, c.type == SERIAL) for c in t.columns],
            "primary_key": list(t.primary_key),
            "checks": sorted(c.name for c in t.columns if c.check is not None),
            "foreign_keys": sorted((list(fk.columns), fk.table, fk.on_delete_cascade)
                                   for fk in t.foreign_keys) if d.foreign_keys else [],
            "indexes": {i.name: list(i.columns) for i in t.indexes},
            "external": sorted(c.name for c in t.columns
                               if not c.compressible and d.storage_hint is not None),
        }
    return out


def sqlite_schema(db: Path) -> dict:
    conn = sqlite3.connect(db)
    try:
        out = {}
        for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' "
                                      "AND name NOT LIKE 'sqlite_%'"):
            info = conn.execute(f"PRAGMA table_info({name})").fetchall()
            # cid, name, type, notnull, dflt_value, pk
            identity = [r[1] for r in info if r[5] and r[2] == "INTEGER"
                        and "AUTOINCREMENT" in sql]
            out[name] = {
                "columns": [(r[1], r[2], not (r[3] or r[1] in identity), r[4], r[1] in identity)
                            for r in info],
                "primary_key": [r[1] for r in sorted(info, key=lambda r: r[5]) if r[5]],
                # SQLite keeps checks only in the table's SQL: find each column's.
                "checks": sorted(r[1] for r in info
                                 if any(line.strip().startswith(f"{r[1]} ")
                                        and "CHECK (" in line for line in sql.splitlines())),
                "foreign_keys": sorted(
                    ([r[3] for r in rows], rows[0][2], rows[0][6] == "CASCADE")
                    for rows in _group(conn.execute(f"PRAGMA foreign_key_list({name})"))),
                "indexes": {i[1]: [c[2] for c in conn.execute(f"PRAGMA index_info({i[1]})")]
                            for i in conn.execute(f"PRAGMA index_list({name})") if i[3] == "c"},
                "external": [],
            }
        return out
    finally:
        conn.close()


def _group(rows) -> list[list[tuple]]:
    groups: dict[int, list[tuple]] = {}
    for r in rows:
        groups.setdefault(r[0], []).append(r)
    return list(groups.values())


def pg_schema(url: str) -> dict:
    def q(sql, *params):
        return pg_execute(url, sql, params)

    out = {}
    for (name,) in q("SELECT tablename FROM pg_tables WHERE schemaname = 'multihead'"):
        rel = f"multihead.{name}"
        columns = q(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod) || CASE WHEN co.collname "
            "IS NOT NULL AND co.collname <> 'default' THEN ' COLLATE \"' || co.collname || '\"' "
            "ELSE '' END, NOT a.attnotnull, pg_get_expr(d.adbin, d.adrelid), "
            "a.attidentity = 'a', a.attstorage FROM pg_attribute a "
            "LEFT JOIN pg_collation co ON co.oid = a.attcollation "
            "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
            "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped "
            "ORDER BY a.attnum", rel)

        def names(attnums, relid=rel):
            return [q("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND "
                      "attnum = %s", relid, n)[0][0] for n in attnums]

        constraints = q("SELECT contype, conkey, confrelid::regclass::text, confdeltype "
                        "FROM pg_constraint WHERE conrelid = %s::regclass", rel)
        out[name] = {
            "columns": [c[:5] for c in columns],
            "primary_key": next(names(k) for t, k, _, _ in constraints if t == "p"),
            "checks": sorted(n for t, k, _, _ in constraints if t == "c" for n in names(k)),
            "foreign_keys": sorted((names(k), ref.removeprefix("multihead."), action == "c")
                                   for t, k, ref, action in constraints if t == "f"),
            "indexes": {i: names(k) for i, k in q(
                "SELECT c.relname, i.indkey::int2[] FROM pg_index i JOIN pg_class c "
                "ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass AND NOT "
                "i.indisprimary", rel)},
            "external": sorted(c[0] for c in columns if c[5] == "e"),
        }
    return out


# -- fresh stores follow the description ----------------------------------------------------------


def test_the_description_holds_both_backends_tables_with_their_constraints():
    assert [t.name for t in TABLES] == ["state", "versions", "blobs", "bots", "history",
                                        "tenants", "tenant_limits", "tenant_storage_limits",
                                        "tenant_latency_limits", "api_keys", "owners", "audit", "candidates",
                                        "serving_processes"]
    assert [t.name for t in tables(SQLITE)] == ["versions", "bots", "history", "tenants",
                                                "tenant_limits", "tenant_storage_limits",
                                                "tenant_latency_limits", "api_keys", "owners", "audit", "candidates"]
    assert [t.name for t in tables(POSTGRESQL)] == [t.name for t in TABLES]
    # Referenced tables come first: the statements run in this order.
    for i, t in enumerate(TABLES):
        assert all(fk.table in [u.name for u in TABLES[:i]] for fk in t.foreign_keys), t.name


def test_a_directory_store_has_the_described_tables(store):
    store.register("acme", *random_head(3, seed=1))
    assert sqlite_schema(store.root / "registry.sqlite") == expected_schema(SQLITE)


def test_a_directory_stores_leases_have_the_described_table_in_a_file_of_their_own(store):
    store.processes.join()
    assert sqlite_schema(store.root / "processes.sqlite") == expected_schema(
        SQLITE, [LEASE_TABLE])


@pytest.mark.postgresql
def test_a_postgresql_store_has_the_described_tables(pg_url):
    with open_store(pg_url) as s:
        s.register("acme", *random_head(3, seed=1))
    assert pg_schema(pg_url) == expected_schema(POSTGRESQL)


def test_the_sqlite_checks_refuse_what_the_description_forbids(store):
    store.register("acme", *random_head(3, seed=1))
    conn = sqlite3.connect(store.root / "registry.sqlite")
    try:
        for sql in ["INSERT INTO versions VALUES ('b', 0, 3, '[]', 'x', 'y')",
                    "INSERT INTO versions VALUES ('b', 1, 1, '[]', 'x', 'y')",
                    "INSERT INTO history (bot_id, action, at) VALUES ('b', 'drop', 'x')",
                    f"INSERT INTO api_keys VALUES ('k', 't', 'root', '{'0' * 64}', 'x', NULL, "
                    "NULL)",
                    "INSERT INTO api_keys VALUES ('k', 't', 'infer', 'short', 'x', NULL, NULL)",
                    "INSERT INTO audit (at, actor, action) VALUES ('x', 'y', 'drop')",
                    "INSERT INTO candidates VALUES ('b', 2, 'blue-green', NULL, 'x')",
                    "INSERT INTO candidates VALUES ('b', 2, 'canary', 0, 'x')",
                    "INSERT INTO candidates VALUES ('b', 2, 'canary', 100, 'x')",
                    "INSERT INTO candidates VALUES ('b', 0, 'shadow', NULL, 'x')",
                    *(f"INSERT INTO tenant_limits (name, {column}, updated) VALUES ('t', "
                      f"{value}, 'x')" for column, value in [
                          ("weight", 0), ("weight", -1), ("weight", 1000.5), ("rate", 0),
                          ("rate", 1e6 + 1), ("burst", 0), ("burst", 1_000_001),
                          ("max_queued", -5), ("max_queued", 10**7)]),
                    *(f"INSERT INTO tenant_storage_limits (name, {column}, updated) VALUES "
                      f"('t', {value}, 'x')" for column, value in [
                          ("max_bots", 0), ("max_versions", 1001), ("max_head_bytes", 0),
                          ("max_head_bytes", 10**12 + 1), ("registrations_per_minute", -1)]),
                    *(f"INSERT INTO tenant_latency_limits (name, deadline_ms, updated) VALUES "
                      f"('t', {value}, 'x')" for value in (0, -1, 3_600_000.5))]:
            with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
                conn.execute(sql)
    finally:
        conn.close()


# -- stores written by 42dd771 open unchanged --------------------------------------------------

# registry.py's _SCHEMA at 42dd771, verbatim.
SQLITE_DDL_42DD771 = """
CREATE TABLE IF NOT EXISTS bots (
    bot_id TEXT PRIMARY KEY,
    active_version INTEGER NOT NULL,
    updated TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    bot_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    n_classes INTEGER NOT NULL,
    labels TEXT NOT NULL,
    created TEXT NOT NULL,
    source TEXT NOT NULL,
    PRIMARY KEY (bot_id, version)
);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    bot_id TEXT NOT NULL,
    action TEXT NOT NULL,
    version INTEGER,
    previous INTEGER,
    at TEXT NOT NULL,
    source TEXT
);
CREATE INDEX IF NOT EXISTS history_by_bot ON history (bot_id, version);
"""

# store/pg.py's _DDL at 42dd771, verbatim (S = SCHEMA = "multihead", SCHEMA_VERSION = 1).
S = "multihead"
SCHEMA_VERSION = 1
PG_DDL_42DD771 = [
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

# What the old store holds: acme v1 and v2 (v1 active after a rollback), beta v1.
OLD_VERSIONS = [("acme", 1, 1), ("acme", 2, 2), ("beta", 1, 3)]  # bot, version, seed
OLD_ACTIVE = {"acme": 1, "beta": 1}
OLD_HISTORY = [("acme", "register", 1, None, "api"), ("acme", "register", 2, 1, "api"),
               ("beta", "register", 1, None, "api"), ("acme", "rollback", 1, 2, None)]
AT = "2026-01-01T00:00:00.000+00:00"


def _old_rows(insert_version, insert_bot, insert_history) -> None:
    for bot, version, seed in OLD_VERSIONS:
        insert_version(bot, version, seed)
    for bot, version in OLD_ACTIVE.items():
        insert_bot(bot, version)
    for row in OLD_HISTORY:
        insert_history(*row)


# The tables tenants added: a store of 42dd771 gains them, empty, at its first write.
TENANT_TABLES = ("tenants", "tenant_limits", "api_keys", "owners", "audit")
# ... and the tables added since (candidates, storage and latency limits; and PostgreSQL's leases, which a
# directory store keeps in processes.sqlite: test_leases.py).
ADDED_TABLES = (*TENANT_TABLES, "candidates", "tenant_storage_limits", "tenant_latency_limits")
PG_ADDED_TABLES = (*ADDED_TABLES, "serving_processes")


def _in_the_default_tenant(s) -> None:
    """Every bot of an old store belongs to the default tenant, before any write."""
    assert [(i.bot_id, i.tenant) for i in s.list()] == [("acme", "default"), ("beta", "default")]
    assert [i.bot_id for i in s.list(tenant="default")] == ["acme", "beta"]
    assert s.list(tenant="other") == []
    assert (s.owner("acme"), s.owner("beta"), s.info("acme").tenant) == ("default",) * 3
    assert [t.to_dict() for t in s.tenants()] == [{"name": "default", "created": None,
                                                   "bots": 2,
                                                   "limits": TenantLimits().to_dict()}]
    assert s.keys() == [] and s.key_table() == {} and s.audit() == []
    assert s.tenant_limits() == {"default": TenantLimits()}


def _works_with_the_new_code(location) -> None:
    """Reads what the old code wrote, then writes on top of it."""
    with open_store(location) as s:
        _in_the_default_tenant(s)
        assert [(i.bot_id, i.version, i.versions) for i in s.list()] == [
            ("acme", 1, [1, 2]), ("beta", 1, [1])]
        for bot, version, seed in OLD_VERSIONS:
            s.rollback(bot, to=version)
            head = s.get(bot)
            w, b, labels = random_head(3, seed=seed)
            assert (head.version, head.labels) == (version, tuple(labels))
            np.testing.assert_array_equal(head.weights, w)
            np.testing.assert_array_equal(head.biases, b)
        assert [(h["action"], h["version"]) for h in s.history("acme")][:4] == [
            ("register", 1), ("register", 2), ("rollback", 1), ("rollback", 2)]
        assert s.register("acme", *random_head(3, seed=4)) == 3
        assert s.rollback("acme") == 2
        s.remove("beta")
        assert s.register("beta", *random_head(3, seed=5)) == 2  # numbers never reused
        # The tenants' tables exist now: a tenant of its own, whose bot beta cannot be.
        s.add_tenant("t1")
        assert s.register("gamma", *random_head(3, seed=6), tenant="t1") == 1
        with pytest.raises(BotOwnedElsewhere):
            s.register("beta", *random_head(3, seed=7), tenant="t1")
    with open_store(location) as fresh:
        assert [(i.bot_id, i.version, i.versions, i.tenant) for i in fresh.list()] == [
            ("acme", 2, [1, 2, 3], "default"), ("beta", 2, [2], "default"),
            ("gamma", 1, [1], "t1")]
        np.testing.assert_array_equal(fresh.get("beta").weights, random_head(3, seed=5)[0])
        assert [(t.name, t.bots) for t in fresh.tenants()] == [("default", 2), ("t1", 1)]
        # Only what the new code did is audited: the old history is not rewritten.
        assert [(r.action, r.bot_id, r.version) for r in fresh.audit()][-6:] == [
            ("replace", "acme", 3), ("rollback", "acme", 2), ("remove", "beta", 1),
            ("register", "beta", 2), ("tenant_add", None, None), ("register", "gamma", 1)]


def test_a_directory_store_written_by_42dd771_opens_unchanged(tmp_path):
    root = tmp_path / "store"
    (root / "heads").mkdir(parents=True)
    conn = sqlite3.connect(root / "registry.sqlite", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(SQLITE_DDL_42DD771)

    def insert_version(bot, version, seed):
        w, b, labels = random_head(3, seed=seed)
        vdir = root / "heads" / bot / f"v{version}"
        vdir.mkdir(parents=True)
        files.write_version_dir(vdir, bot_id=bot, version=version, weights=w, biases=b,
                                labels=labels, created=AT, source="api")
        conn.execute("INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?)",
                     (bot, version, 3, json.dumps(labels), AT, "api"))

    _old_rows(insert_version,
              lambda bot, v: conn.execute("INSERT INTO bots VALUES (?, ?, ?)", (bot, v, AT)),
              lambda bot, action, v, prev, source: conn.execute(
                  "INSERT INTO history (bot_id, action, version, previous, at, source) "
                  "VALUES (?, ?, ?, ?, ?, ?)", (bot, action, v, prev, AT, source)))
    conn.close()
    db = root / "registry.sqlite"
    old_schema = sqlite_schema(db)
    before = tree_digest(root)

    with open_store(root) as s:  # reading changes nothing, not a byte
        assert [i.bot_id for i in s.list()] == ["acme", "beta"] and s.get("acme").version == 1
        _in_the_default_tenant(s)
    assert tree_digest(root) == before
    _works_with_the_new_code(root)
    # No rewrite but history's: the other old tables are kept as they were, the new ones were
    # added; history (no check at all) was made again with its check, rows kept (above).
    new_schema = sqlite_schema(db)
    assert {t: new_schema[t] for t in old_schema if t != "history"} == {
        t: v for t, v in old_schema.items() if t != "history"}
    assert new_schema["history"] == expected_schema(SQLITE)["history"]
    assert not stale_check("history", _table_sql(db, "history"))
    assert set(new_schema) - set(old_schema) == set(ADDED_TABLES)
    assert {t: new_schema[t] for t in ADDED_TABLES} == {
        t: expected_schema(SQLITE)[t] for t in ADDED_TABLES}
    # The old tables differ from the description only in what the description added: the
    # checks, and NOT NULL on bots.bot_id (which SQLite's inline PRIMARY KEY did not imply).
    new = {t: v for t, v in expected_schema(SQLITE).items() if t not in ADDED_TABLES}
    assert {t: {k: v for k, v in old_schema[t].items() if k != "checks"} for t in old_schema} \
        == {t: {k: v if k != "columns" else [c if (t, c[0]) != ("bots", "bot_id")
                                             else (*c[:2], True, *c[3:]) for c in v]
                for k, v in new[t].items() if k != "checks"} for t in new}
    assert all(old_schema[t]["checks"] == [] for t in old_schema)


@pytest.mark.postgresql
def test_a_postgresql_store_written_by_42dd771_opens_unchanged(pg_url):
    for statement in PG_DDL_42DD771:
        pg_execute(pg_url, statement)

    def insert_version(bot, version, seed):
        w, b, labels = random_head(3, seed=seed)
        pg_execute(pg_url, f"INSERT INTO {S}.versions VALUES (%s, %s, %s, %s, %s, %s)",
                   (bot, version, 3, json.dumps(labels), AT, "api"))
        for name, data in [("weights", w.astype("<f4").tobytes()),
                           ("biases", b.astype("<f4").tobytes()),
                           ("labels", json.dumps(labels, ensure_ascii=False).encode())]:
            pg_execute(pg_url, f"INSERT INTO {S}.blobs VALUES (%s, %s, %s, %s, %s)",
                       (bot, version, name, data, hashlib.sha256(data).hexdigest()))

    _old_rows(insert_version,
              lambda bot, v: pg_execute(pg_url, f"INSERT INTO {S}.bots VALUES (%s, %s, %s)",
                                        (bot, v, AT)),
              lambda bot, action, v, prev, source: pg_execute(
                  pg_url, f"INSERT INTO {S}.history (bot_id, action, version, previous, at, "
                  "source) VALUES (%s, %s, %s, %s, %s, %s)", (bot, action, v, prev, AT, source)))
    pg_execute(pg_url, f"UPDATE {S}.state SET change_seq = 4")
    # The DDL of 42dd771 and the description make the same tables, constraint for constraint
    # (but for the tables tenants added).
    assert pg_schema(pg_url) == {t: v for t, v in expected_schema(POSTGRESQL).items()
                                 if t not in PG_ADDED_TABLES}

    _works_with_the_new_code(pg_url)
    assert pg_schema(pg_url) == expected_schema(POSTGRESQL)
    assert pg_execute(pg_url, f"SELECT schema_version, change_seq FROM {S}.state") == [
        (1, 4 + 7)]  # + a rollback that changed something, register, rollback, remove, register,
    # tenant_add, register


# -- stores written by d17eb97 (before tenant limits) gain the new audit check -------------------

# The audit table as d17eb97 made it, verbatim: its check lacks "tenant_set". The other tables of
# that version are the ones of today but tenant_limits, which did not exist.
OLD_ACTIONS = ("register", "replace", "rollback", "remove", "tenant_add", "tenant_remove",
               "key_add", "key_revoke")
SQLITE_AUDIT_D17EB97 = """CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('register', 'replace', 'rollback', 'remove', \
'tenant_add', 'tenant_remove', 'key_add', 'key_revoke')),
    tenant TEXT,
    bot_id TEXT,
    version INTEGER,
    digest TEXT,
    detail TEXT
)"""
PG_AUDIT_D17EB97 = f"""CREATE TABLE IF NOT EXISTS {S}.audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at text NOT NULL,
    actor text NOT NULL,
    action text NOT NULL CHECK (action IN ('register', 'replace', 'rollback', 'remove', \
'tenant_add', 'tenant_remove', 'key_add', 'key_revoke')),
    tenant text COLLATE "C",
    bot_id text COLLATE "C",
    version integer,
    digest text,
    detail text
)"""
AUDIT_INDEX = "CREATE INDEX IF NOT EXISTS audit_by_tenant ON {prefix}audit (tenant, id)"
# The history table as every version from the first checks (d17eb97's time) to 3d50dba made it,
# verbatim: its check lacks the candidates' actions.
HISTORY_3D50DBA = {SQLITE: """CREATE TABLE IF NOT EXISTS {prefix}history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    bot_id TEXT NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('register', 'rollback', 'remove')),
    version INTEGER,
    previous INTEGER,
    at TEXT NOT NULL,
    source TEXT
)""", POSTGRESQL: """CREATE TABLE IF NOT EXISTS {prefix}history (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    bot_id text COLLATE "C" NOT NULL,
    action text NOT NULL CHECK (action IN ('register', 'rollback', 'remove')),
    version integer,
    previous integer,
    at text NOT NULL,
    source text
)"""}
HISTORY_INDEX = "CREATE INDEX IF NOT EXISTS history_by_bot ON {prefix}history (bot_id, version)"
# Three records, the last one deleted: the next id is 4 (a counter outlives its rows).
OLD_RECORDS = [(AT, "operator", "tenant_add", "t1", None), (AT, "key:k1", "key_add", "t1",
                                                             "key k1 scope infer"),
               (AT, "operator", "tenant_add", "t2", None)]


def _d17eb97_statements(dialect: str, prefix: str, audit: str) -> list[str]:
    """The DDL of a store written by d17eb97: today's tables but tenant_limits and candidates,
    its audit, and its history (whose check lacks the candidates' actions)."""
    today = create_statements(dialect, prefix, only={t.name for t in tables(dialect)}
                              - {"audit", "tenant_limits", "candidates", "history",
                                 "tenant_storage_limits", "tenant_latency_limits"})
    return [*today, HISTORY_3D50DBA[dialect].format(prefix=prefix),
            HISTORY_INDEX.format(prefix=prefix), audit, AUDIT_INDEX.format(prefix=prefix)]


def _old_audit(execute, prefix: str) -> None:
    execute(f"INSERT INTO {prefix}tenants (name, created) VALUES ('t1', '{AT}')")
    for record in OLD_RECORDS:
        execute(f"INSERT INTO {prefix}audit (at, actor, action, tenant, detail) "
                "VALUES (%s, %s, %s, %s, %s)", record)
    execute(f"DELETE FROM {prefix}audit WHERE id = 3")


def _gains_tenant_set(location) -> None:
    """Reads the old store unchanged, then writes a tenant_set record on top of it."""
    with open_store(location) as s:
        assert s.tenant_limits() == {"default": TenantLimits(), "t1": TenantLimits()}
        assert [t.limits for t in s.tenants()] == [TenantLimits()] * 2
        assert [(r.id, r.action) for r in s.audit()] == [(1, "tenant_add"), (2, "key_add")]
        assert s.set_tenant_limits("t1", weight=2, max_queued=50) == TenantLimits(
            weight=2, max_queued=50)
        s.set_tenant_limits("default", rate=100)
        s.add_tenant("t3", limits=TenantLimits(burst=8))
    with open_store(location) as fresh:  # as another process sees it
        assert fresh.tenant_limits() == {"default": TenantLimits(rate=100),
                                         "t1": TenantLimits(weight=2, max_queued=50),
                                         "t3": TenantLimits(burst=8)}
        assert [(r.id, r.at, r.actor, r.action, r.tenant, r.detail)
                for r in fresh.audit()] == [
            (1, *OLD_RECORDS[0][:4], None), (2, *OLD_RECORDS[1]),
            (4, fresh.audit()[2].at, "operator", "tenant_set", "t1", "weight=2 max_queued=50"),
            (5, fresh.audit()[3].at, "operator", "tenant_set", "default", "rate=100"),
            (6, fresh.audit()[4].at, "operator", "tenant_add", "t3", "burst=8")]


def test_a_directory_store_written_by_d17eb97_gains_the_tenant_set_action(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    db = root / "registry.sqlite"
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for statement in _d17eb97_statements(SQLITE, "", SQLITE_AUDIT_D17EB97):
        conn.execute(statement)
    _old_audit(lambda sql, params=(): conn.execute(sql.replace("%s", "?"), params), "")
    with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
        conn.execute("INSERT INTO audit (at, actor, action) VALUES ('x', 'y', 'tenant_set')")
    conn.close()
    old_schema = sqlite_schema(db)
    assert stale_check("audit", _table_sql(db, "audit"))
    before = tree_digest(root)

    with open_store(root) as s:  # reading changes nothing
        assert [(r.id, r.action) for r in s.audit()] == [(1, "tenant_add"), (2, "key_add")]
        assert s.tenant_limits()["t1"] == TenantLimits()
    assert tree_digest(root) == before
    _gains_tenant_set(root)
    assert not stale_check("audit", _table_sql(db, "audit"))
    assert all(f"'{action}'" in _table_sql(db, "audit") for action in AUDIT_ACTIONS)
    # The store now has the described tables; the others are as they were.
    assert sqlite_schema(db) == expected_schema(SQLITE)
    assert {t: v for t, v in old_schema.items() if t != "audit"} == {
        t: v for t, v in expected_schema(SQLITE).items()
        if t not in ("audit", "tenant_limits", "candidates", "tenant_storage_limits",
                     "tenant_latency_limits")}
    # Made again once: a later writer finds the check current and leaves the table alone.
    sql = _table_sql(db, "audit")
    with open_store(root) as s:
        s.set_tenant_limits("t1", weight=None)
        assert s.audit()[-1].id == 7
    assert _table_sql(db, "audit") == sql
    conn = sqlite3.connect(db)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
            conn.execute("INSERT INTO audit (at, actor, action) VALUES ('x', 'y', 'drop')")
    finally:
        conn.close()


def _table_sql(db: Path, table: str) -> str:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
                            (table,)).fetchone()[0]
    finally:
        conn.close()


def _pg_audit_check(url: str) -> list[tuple[str, str]]:
    return pg_execute(url, "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                           f"WHERE conrelid = '{S}.audit'::regclass AND contype = 'c'")


@pytest.mark.postgresql
def test_a_postgresql_store_written_by_d17eb97_gains_the_tenant_set_action(pg_url):
    pg_execute(pg_url, f"CREATE SCHEMA {S}")
    for statement in _d17eb97_statements(POSTGRESQL, f"{S}.", PG_AUDIT_D17EB97):
        pg_execute(pg_url, statement)
    pg_execute(pg_url, f"INSERT INTO {S}.state (schema_version, change_seq) VALUES (1, 2)")
    _old_audit(lambda sql, params=(): pg_execute(pg_url, sql, params), f"{S}.")
    ((name, old_check),) = _pg_audit_check(pg_url)
    assert name == "audit_action_check" and stale_check("audit", old_check)
    assert pg_schema(pg_url) == {t: v for t, v in expected_schema(POSTGRESQL).items()
                                 if t not in ("tenant_limits", "candidates",
                                              "tenant_storage_limits", "tenant_latency_limits")}

    _gains_tenant_set(pg_url)
    ((name, check),) = _pg_audit_check(pg_url)
    assert name == "audit_action_check" and not stale_check("audit", check)
    assert pg_schema(pg_url) == expected_schema(POSTGRESQL)
    assert pg_execute(pg_url, f"SELECT change_seq FROM {S}.state") == [(2 + 3,)]
    with pytest.raises(Exception, match="audit_action_check"):
        pg_execute(pg_url, f"INSERT INTO {S}.audit (at, actor, action) VALUES ('x', 'y', 'drop')")


# -- stores written by 3d50dba (before candidates) gain them at their first write ----------------

# The audit table as 3d50dba made it, verbatim: its check lacks the candidates' actions.
AUDIT_3D50DBA = {SQLITE: """CREATE TABLE IF NOT EXISTS {prefix}audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('register', 'replace', 'rollback', 'remove', \
'tenant_add', 'tenant_remove', 'tenant_set', 'key_add', 'key_revoke')),
    tenant TEXT,
    bot_id TEXT,
    version INTEGER,
    digest TEXT,
    detail TEXT
)""", POSTGRESQL: """CREATE TABLE IF NOT EXISTS {prefix}audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at text NOT NULL,
    actor text NOT NULL,
    action text NOT NULL CHECK (action IN ('register', 'replace', 'rollback', 'remove', \
'tenant_add', 'tenant_remove', 'tenant_set', 'key_add', 'key_revoke')),
    tenant text COLLATE "C",
    bot_id text COLLATE "C",
    version integer,
    digest text,
    detail text
)"""}
# table -> (its DDL at 3d50dba, its index, the column that identifies a row's author)
_OLD_TABLES = {"history": (HISTORY_3D50DBA, HISTORY_INDEX, "history_by_bot", "bot_id"),
               "audit": (AUDIT_3D50DBA, AUDIT_INDEX, "audit_by_tenant", "actor")}


def _as_3d50dba_wrote_it(location: str) -> None:
    """A store of this version made into the one 3d50dba writes: no candidates table, and its
    history and audit tables as 3d50dba made them (their rows and ids kept). What 3d50dba wrote
    in them (registrations, rollbacks, tenants) it wrote as this version does."""
    if location.startswith("postgresql"):
        pg_execute(location, f"DROP TABLE {S}.candidates")
        for table, (ddl, index, index_name, _) in _OLD_TABLES.items():
            pg_execute(location, f"ALTER TABLE {S}.{table} RENAME TO {table}_old")
            pg_execute(location, f"ALTER INDEX {S}.{index_name} RENAME TO {table}_old_index")
            pg_execute(location, ddl[POSTGRESQL].format(prefix=f"{S}."))
            pg_execute(location, f"INSERT INTO {S}.{table} OVERRIDING SYSTEM VALUE "
                                 f"SELECT * FROM {S}.{table}_old")
            pg_execute(location, f"SELECT setval(pg_get_serial_sequence('{S}.{table}', 'id'), "
                                 f"(SELECT max(id) FROM {S}.{table}))")
            pg_execute(location, f"DROP TABLE {S}.{table}_old")
            pg_execute(location, index.format(prefix=f"{S}."))
        return
    conn = sqlite3.connect(Path(location) / "registry.sqlite", isolation_level=None)
    try:
        conn.execute("DROP TABLE candidates")
        for table, (ddl, index, _, _) in _OLD_TABLES.items():
            conn.execute(f"ALTER TABLE {table} RENAME TO {table}_old")
            conn.execute(ddl[SQLITE].format(prefix=""))
            conn.execute(f"INSERT INTO {table} SELECT * FROM {table}_old")
            conn.execute(f"DROP TABLE {table}_old")
            conn.execute(index.format(prefix=""))
    finally:
        conn.close()


def _schema_of(location: str) -> dict:
    if location.startswith("postgresql"):
        return pg_schema(location)
    return sqlite_schema(Path(location) / "registry.sqlite")


def _refuses(location: str, table: str, action: str) -> bool:
    """Whether the store's `table` refuses a row of `action` (its check); nothing is kept."""
    author = _OLD_TABLES[table][3]
    if location.startswith("postgresql"):
        import psycopg

        with psycopg.connect(location, autocommit=True) as conn:
            try:
                with conn.transaction():
                    conn.execute(f"INSERT INTO {S}.{table} (at, {author}, action) "
                                 "VALUES ('x', 'y', %s)", (action,))
                    raise psycopg.Rollback()
            except psycopg.errors.CheckViolation:
                return True
        return False
    conn = sqlite3.connect(Path(location) / "registry.sqlite", isolation_level=None)
    try:
        conn.execute("BEGIN")
        try:
            conn.execute(f"INSERT INTO {table} (at, {author}, action) VALUES ('x', 'y', ?)",
                         (action,))
        except sqlite3.IntegrityError:
            return True
        finally:
            conn.execute("ROLLBACK")
        return False
    finally:
        conn.close()


def test_a_store_written_by_3d50dba_gains_candidates_at_its_first_write(location):
    with open_store(location) as s:
        s.add_tenant("t1")
        s.register("acme", *random_head(3, seed=1), tenant="t1")
        s.register("acme", *random_head(3, seed=2), tenant="t1")
        s.rollback("acme")
        s.register("beta", *random_head(3, seed=3))
        old_audit = [(r.id, r.action, r.bot_id, r.version) for r in s.audit()]
    _as_3d50dba_wrote_it(location)
    expected = expected_schema(POSTGRESQL if location.startswith("postgresql") else SQLITE)
    assert _schema_of(location) == {t: v for t, v in expected.items() if t != "candidates"}
    assert _refuses(location, "history", "candidate") and _refuses(location, "audit",
                                                                  "candidate_add")
    assert not _refuses(location, "history", "rollback")  # (the test's probe works)
    before = store_digest(location)

    with open_store(location) as s:  # reading: no candidate anywhere, nothing written
        assert [(i.bot_id, i.version, i.versions, i.candidate) for i in s.list()] == [
            ("acme", 1, [1, 2], None), ("beta", 1, [1], None)]
        assert s.candidate("acme") is None and not s.has_candidate("beta")
    assert store_digest(location) == before

    with open_store(location) as s:
        assert s.register("acme", *random_head(4, seed=4), tenant="t1",
                          candidate="canary:25") == 3
        assert s.info("acme").candidate.mode == CandidateMode("canary", 25.0)
        assert s.promote("acme") == (1, 3)
        assert s.register("acme", *random_head(3, seed=5), tenant="t1", candidate="shadow") == 4
        assert s.discard("acme") == 4
        assert s.register("beta", *random_head(3, seed=6), candidate="shadow") == 2
    with open_store(location) as fresh:  # as another process sees it
        assert [(h["action"], h["version"], h["previous"]) for h in fresh.history("acme")] == [
            ("register", 1, None), ("register", 2, 1), ("rollback", 1, 2), ("candidate", 3, 1),
            ("promote", 3, 1), ("candidate", 4, 3), ("discard", 4, None)]
        audit = [(r.id, r.action, r.bot_id, r.version) for r in fresh.audit()]
        assert audit[:len(old_audit)] == old_audit  # rows and ids kept
        assert [a[1:] for a in audit[len(old_audit):]] == [
            ("candidate_add", "acme", 3), ("candidate_promote", "acme", 3),
            ("candidate_add", "acme", 4), ("candidate_discard", "acme", 4),
            ("candidate_add", "beta", 2)]
        assert [a[0] for a in audit] == sorted({a[0] for a in audit})  # ids still grow
        assert fresh.candidate("beta").head.version == 2 and fresh.info("acme").candidate is None
        np.testing.assert_array_equal(fresh.get("acme").weights, random_head(4, seed=4)[0])
        assert fresh.rollback("acme") == 2  # the promoted version's predecessor is kept
    assert _schema_of(location) == expected
    assert not _refuses(location, "history", "discard")
    assert _refuses(location, "audit", "drop")
