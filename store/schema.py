"""The store's tables, described once as data; each backend renders its DDL from here.

    TABLES          bots, versions, history, tenants, tenant_limits, api_keys, owners, audit,
                    candidates (both backends); state, blobs (PostgreSQL only: its writer lock
                    and change counter, and the tensors that a directory store keeps as files);
                    serving_processes (the serving processes' leases, `store.leases`: in the
                    schema of PostgreSQL, in a file of its own in a directory store)
    create_statements(dialect, prefix="")   the CREATE statements of one dialect
    GROWING_CHECKS, stale_check(...)        checks whose allowed values grow with the code
    rebuild_statements(table)               SQLite: a table made again under its new checks

Column types are logical (`KEY`, `TEXT`, `INT`, ...) and `DIALECTS` maps them to each
database's: a bot id is `TEXT` in SQLite (whose default collation already orders by bytes) and
`text COLLATE "C"` in PostgreSQL, so that both list bots in the same (byte) order; labels are a
JSON array, `TEXT` in SQLite and `jsonb` in PostgreSQL. Checks are SQL both dialects accept.

Foreign keys are declared in PostgreSQL only: SQLite enforces them only on connections that
turn them on, and a declaration nothing enforces would promise what it does not keep.

Every statement is `CREATE ... IF NOT EXISTS`: running them on an existing store changes
nothing, so stores written by earlier versions open as they are (tests/store/test_schema.py
keeps such stores, verbatim, and checks the live schemas of both backends against `TABLES`).
That is also the whole migration to tenants: a store written before them gains the empty
tables tenants, tenant_limits, api_keys, owners and audit at its next write, and a live bot
without an owners row belongs to `accounts.tenants.DEFAULT_TENANT` (no row is rewritten). Until
that write, readers take the missing tables as empty.

Candidates (`accounts.candidates`) came the same way: the table `candidates` is created empty at
the next write of an older store, and until then readers take a bot to have no candidate. So did
`serving_processes`, created by a serving process's first lease (PostgreSQL:
`store.pg.schema.ensure_schema`; a directory store: in `processes.sqlite`, made then beside the
registry, so that the leases' writes every few seconds move neither the registry's
`PRAGMA data_version`, which would make every process read its rows again, nor its writer lock).

One migration rewrites something: the checks on `audit.action` and `history.action` list
`AUDIT_ACTIONS` and `ACTIONS`, so a store written before an action existed ("tenant_set", with
tenant limits; "candidate_add", "candidate", ... with candidates) refuses it. Its first writer
of this version replaces the check, in the transaction that creates the missing tables
(`GROWING_CHECKS`, `stale_check`): PostgreSQL drops and adds the constraint; SQLite, which
cannot alter a check, makes the table again (`rebuild_statements`: rows and ids kept; a
history table of a store older than the checks, which has none, gains its check so).
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from accounts.candidates import MODES
from accounts.tenants import AUDIT_ACTIONS, LATENCY_TABLE, LIMITS, SCOPES, STORAGE_TABLE
from store.backend import POSTGRESQL, SQLITE

# Logical column types.
KEY = "key"        # an id compared and ordered byte by byte
TEXT = "text"
INT = "int"        # 32 bits
REAL = "real"      # a 64-bit float
BIGINT = "bigint"  # 64 bits
SERIAL = "serial"  # a growing 64-bit id, given by the database: the table's primary key
JSON = "json"
BYTES = "bytes"
BOOL = "bool"


@dataclass(frozen=True)
class Column:
    """One column. `check` is an SQL expression over this column; `default` an SQL literal;
    `compressible=False` asks a database that compresses large values not to try."""

    name: str
    type: str
    nullable: bool = False
    check: str | None = None
    default: str | None = None
    compressible: bool = True


@dataclass(frozen=True)
class ForeignKey:
    columns: tuple[str, ...]
    table: str  # references that table's primary key
    on_delete_cascade: bool = False


@dataclass(frozen=True)
class Index:
    name: str
    columns: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...]
    foreign_keys: tuple[ForeignKey, ...] = ()
    indexes: tuple[Index, ...] = ()
    dialects: frozenset[str] = frozenset({SQLITE, POSTGRESQL})


BLOB_NAMES = ("weights", "biases", "labels")
# History actions: "candidate" stores a version without making it active, "promote" makes the
# candidate active, "discard" deletes it (accounts.candidates).
ACTIONS = ("register", "rollback", "remove", "candidate", "promote", "discard")
# The history actions that stored a new version: their numbers are never given again.
STORING_ACTIONS = ("register", "candidate")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _limit_column(name: str) -> Column:
    """A column of tenant_limits: NULL (the serve default) or a value in the limit's range."""
    limit = LIMITS[name]
    maximum = int(limit.maximum) if limit.integer else float(limit.maximum)
    kind = (BIGINT if limit.maximum > 2**31 - 1 else INT) if limit.integer else REAL
    return Column(name, kind, nullable=True,
                  check=f"{name} > 0 AND {name} <= {maximum!r}")


TABLES: tuple[Table, ...] = (
    # One row: schema_version, and change_seq, which grows by one per write transaction (its
    # row lock serialises writers, as the flock of a directory store does).
    Table("state", (
        Column("singleton", BOOL, check="singleton", default="true"),
        Column("schema_version", INT),
        Column("change_seq", BIGINT),
    ), primary_key=("singleton",), dialects=frozenset({POSTGRESQL})),
    # Every stored version.
    Table("versions", (
        Column("bot_id", KEY),
        Column("version", INT, check="version > 0"),
        Column("n_classes", INT, check="n_classes >= 2"),
        Column("labels", JSON),
        Column("created", TEXT),
        Column("source", TEXT),
    ), primary_key=("bot_id", "version")),
    # The tensors and labels of each version (see store.pg.blobs).
    Table("blobs", (
        Column("bot_id", KEY),
        Column("version", INT),
        Column("name", TEXT, check=_one_of("name", BLOB_NAMES)),
        # float32 tensors do not compress: store them out of line without trying.
        Column("data", BYTES, compressible=False),
        Column("sha256", TEXT, check="length(sha256) = 64"),
    ), primary_key=("bot_id", "version", "name"),
        foreign_keys=(ForeignKey(("bot_id", "version"), "versions", on_delete_cascade=True),),
        dialects=frozenset({POSTGRESQL})),
    # One row per live bot.
    Table("bots", (
        Column("bot_id", KEY),
        Column("active_version", INT),
        Column("updated", TEXT),
    ), primary_key=("bot_id",),
        foreign_keys=(ForeignKey(("bot_id", "active_version"), "versions"),)),
    # Append-only audit trail; also keeps version numbers from ever being reused.
    Table("history", (
        Column("id", SERIAL),
        Column("bot_id", KEY),
        Column("action", TEXT, check=_one_of("action", ACTIONS)),
        Column("version", INT, nullable=True),
        Column("previous", INT, nullable=True),
        Column("at", TEXT),
        Column("source", TEXT, nullable=True),
    ), primary_key=("id",), indexes=(Index("history_by_bot", ("bot_id", "version")),)),
    # Tenants other than the default one (which exists without a row).
    Table("tenants", (
        Column("name", KEY),
        Column("created", TEXT),
    ), primary_key=("name",)),
    # The limits of a tenant (fair sharing: accounts.tenants.TenantLimits); a NULL is the serve
    # default, a tenant without a row has every default. The default tenant may have a row.
    Table("tenant_limits", (
        Column("name", KEY),
        *(_limit_column(name) for name, limit in LIMITS.items()
          if limit.table == "tenant_limits"),
        Column("updated", TEXT),
    ), primary_key=("name",)),
    # The storage limits of a tenant (max_bots, max_versions, max_head_bytes,
    # registrations_per_minute), as tenant_limits: a table of their own, so that a store
    # written before them gains it empty at its next write (no column added to a table).
    Table(STORAGE_TABLE, (
        Column("name", KEY),
        *(_limit_column(name) for name, limit in LIMITS.items() if limit.table == STORAGE_TABLE),
        Column("updated", TEXT),
    ), primary_key=("name",)),
    # The latency limits of a tenant (deadline_ms), as the storage limits: a table of their own.
    Table(LATENCY_TABLE, (
        Column("name", KEY),
        *(_limit_column(name) for name, limit in LIMITS.items() if limit.table == LATENCY_TABLE),
        Column("updated", TEXT),
    ), primary_key=("name",)),
    # API keys: only the sha256 of each token (see accounts.tenants). No foreign key to tenants:
    # the default tenant has no row, and a removed tenant's keys stay listed, revoked.
    Table("api_keys", (
        Column("id", KEY),
        Column("tenant", KEY),
        Column("scope", TEXT, check=_one_of("scope", SCOPES)),
        Column("hash", TEXT, check="length(hash) = 64"),
        Column("created", TEXT),
        Column("last_used", TEXT, nullable=True),
        Column("revoked", TEXT, nullable=True),
    ), primary_key=("id",), indexes=(Index("api_keys_by_tenant", ("tenant",)),)),
    # The tenant of each live bot; a live bot without a row belongs to the default tenant.
    Table("owners", (
        Column("bot_id", KEY),
        Column("tenant", KEY),
    ), primary_key=("bot_id",),
        foreign_keys=(ForeignKey(("bot_id",), "bots", on_delete_cascade=True),),
        indexes=(Index("owners_by_tenant", ("tenant",)),)),
    # Append-only audit log: every change to bots, tenants and keys, in the change's own
    # transaction.
    Table("audit", (
        Column("id", SERIAL),
        Column("at", TEXT),
        Column("actor", TEXT),
        Column("action", TEXT, check=_one_of("action", AUDIT_ACTIONS)),
        Column("tenant", KEY, nullable=True),
        Column("bot_id", KEY, nullable=True),
        Column("version", INT, nullable=True),
        Column("digest", TEXT, nullable=True),
        Column("detail", TEXT, nullable=True),
    ), primary_key=("id",), indexes=(Index("audit_by_tenant", ("tenant", "id")),)),
    # The candidate of a live bot (at most one): a stored version that is not active, and how
    # it is scored (accounts.candidates). Goes with the bot and with its version.
    Table("candidates", (
        Column("bot_id", KEY),
        Column("version", INT, check="version > 0"),
        Column("mode", TEXT, check=_one_of("mode", MODES)),
        Column("percent", REAL, nullable=True, check="percent > 0 AND percent < 100"),
        Column("created", TEXT),
    ), primary_key=("bot_id",),
        foreign_keys=(ForeignKey(("bot_id",), "bots", on_delete_cascade=True),
                      ForeignKey(("bot_id", "version"), "versions", on_delete_cascade=True))),
    # The lease of each serving process (`store.leases`): renewed every few seconds, live while
    # `seen` (seconds since the epoch, by the clock of the database or of the store's machine)
    # is within the TTL. A directory store keeps it in processes.sqlite (`LEASE_TABLE`).
    Table("serving_processes", (
        Column("id", KEY),
        Column("host", TEXT),
        Column("pid", INT),
        Column("started", TEXT),
        Column("seen", REAL),
    ), primary_key=("id",), dialects=frozenset({POSTGRESQL})),
)
LEASE_TABLE = TABLES[-1]


@dataclass(frozen=True)
class Dialect:
    """How one database spells the logical types, and what it declares."""

    types: dict[str, str]
    serial: str  # the whole column definition after the name
    foreign_keys: bool
    storage_hint: str | None  # ALTER TABLE ... {hint}: a column that does not compress


DIALECTS = {
    SQLITE: Dialect(
        types={KEY: "TEXT", TEXT: "TEXT", INT: "INTEGER", REAL: "REAL", BIGINT: "INTEGER",
               JSON: "TEXT", BYTES: "BLOB", BOOL: "BOOLEAN"},
        serial="INTEGER PRIMARY KEY AUTOINCREMENT",
        foreign_keys=False, storage_hint=None),
    POSTGRESQL: Dialect(
        types={KEY: 'text COLLATE "C"', TEXT: "text", INT: "integer", REAL: "double precision",
               BIGINT: "bigint", JSON: "jsonb", BYTES: "bytea", BOOL: "boolean"},
        serial="bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
        foreign_keys=True, storage_hint="SET STORAGE EXTERNAL"),
}


def tables(dialect: str) -> list[Table]:
    """The tables a store of `dialect` has, in creation order (referenced tables first)."""
    return [t for t in TABLES if dialect in t.dialects]


def column_type(dialect: str, column: Column) -> str:
    """The declared type of `column` in `dialect` (collation included)."""
    d = DIALECTS[dialect]
    return d.serial if column.type == SERIAL else d.types[column.type]


def _column_sql(d: Dialect, column: Column) -> str:
    if column.type == SERIAL:
        return f"{column.name} {d.serial}"
    parts = [column.name, d.types[column.type]]
    if not column.nullable:
        parts.append("NOT NULL")
    if column.default is not None:
        parts.append(f"DEFAULT {column.default}")
    if column.check is not None:
        parts.append(f"CHECK ({column.check})")
    return " ".join(parts)


def _create_table(d: Dialect, table: Table, prefix: str, name: str | None = None) -> str:
    lines = [_column_sql(d, c) for c in table.columns]
    if not any(c.type == SERIAL for c in table.columns):
        lines.append(f"PRIMARY KEY ({', '.join(table.primary_key)})")
    if d.foreign_keys:
        for fk in table.foreign_keys:
            target = next(t for t in TABLES if t.name == fk.table)
            lines.append(
                f"FOREIGN KEY ({', '.join(fk.columns)}) REFERENCES {prefix}{fk.table} "
                f"({', '.join(target.primary_key)})"
                + (" ON DELETE CASCADE" if fk.on_delete_cascade else ""))
    body = ",\n    ".join(lines)
    return f"CREATE TABLE IF NOT EXISTS {prefix}{name or table.name} (\n    {body}\n)"


def lease_statements(dialect: str) -> list[str]:
    """The CREATE statement of `LEASE_TABLE` in `dialect` (SQLite: in processes.sqlite)."""
    return [_create_table(DIALECTS[dialect], LEASE_TABLE, "")]


def _create_indexes(table: Table, prefix: str) -> list[str]:
    return [f"CREATE INDEX IF NOT EXISTS {index.name} ON {prefix}{table.name} "
            f"({', '.join(index.columns)})" for index in table.indexes]


def create_statements(dialect: str, prefix: str = "",
                      only: Collection[str] | None = None) -> list[str]:
    """CREATE TABLE / CREATE INDEX (and storage hints) for every table of `dialect`.

    Args:
        prefix: put before every table name (PostgreSQL: the schema, e.g. "multihead.").
        only: just these tables' statements (those missing from an existing store).
    """
    d = DIALECTS[dialect]
    out = []
    for table in tables(dialect):
        if only is not None and table.name not in only:
            continue
        out.append(_create_table(d, table, prefix))
        if d.storage_hint is not None:
            out += [f"ALTER TABLE {prefix}{table.name} ALTER COLUMN {c.name} {d.storage_hint}"
                    for c in table.columns if not c.compressible]
        out += _create_indexes(table, prefix)
    return out


# -- checks whose allowed values grow ------------------------------------------------------------

# table -> (column, the values its check allows now): a store written by an earlier version may
# hold a check that lacks some of them.
GROWING_CHECKS: dict[str, tuple[str, tuple[str, ...]]] = {"history": ("action", ACTIONS),
                                                          "audit": ("action", AUDIT_ACTIONS)}


def stale_check(table: str, definition: str) -> bool:
    """Whether the SQL text of `table`'s check (PostgreSQL: `pg_get_constraintdef`; SQLite: the
    table's CREATE statement) lacks a value the check must allow now (`GROWING_CHECKS`)."""
    _, values = GROWING_CHECKS[table]
    return any(f"'{value}'" not in definition for value in values)


def check_constraint(table: str) -> tuple[str, str]:
    """(the name PostgreSQL gives a column check, its expression) of a `GROWING_CHECKS` table:
    what an existing store's stale check is replaced by."""
    column, _ = GROWING_CHECKS[table]
    (col,) = [c for c in next(t for t in TABLES if t.name == table).columns if c.name == column]
    return f"{table}_{column}_check", col.check


def rebuild_statements(table_name: str) -> list[str]:
    """SQLite: make `table_name` again as the description says (its checks now), keeping its rows
    and their ids (and the AUTOINCREMENT counter); run them in one write transaction.

    SQLite cannot alter a check: the table is created under a new name, filled, the old one
    dropped and the new one renamed (https://www.sqlite.org/lang_altertable.html, "making
    other kinds of table schema changes"); the indexes go with the old table and are made again.
    """
    d = DIALECTS[SQLITE]
    table = next(t for t in tables(SQLITE) if t.name == table_name)
    new = f"{table.name}_new"
    columns = ", ".join(c.name for c in table.columns)
    out = [f"DROP TABLE IF EXISTS {new}", _create_table(d, table, "", name=new),
           f"INSERT INTO {new} ({columns}) SELECT {columns} FROM {table.name}"]
    serial = any(c.type == SERIAL for c in table.columns)
    if serial:  # the counter outlives deleted rows: keep it, not just max(id)
        old_seq = f"(SELECT seq FROM sqlite_sequence WHERE name = '{table.name}')"
        out += [f"INSERT INTO sqlite_sequence (name, seq) SELECT '{new}', 0 WHERE NOT EXISTS "
                f"(SELECT 1 FROM sqlite_sequence WHERE name = '{new}')",
                f"UPDATE sqlite_sequence SET seq = max(seq, COALESCE({old_seq}, 0)) "
                f"WHERE name = '{new}'"]
    out += [f"DROP TABLE {table.name}", f"ALTER TABLE {new} RENAME TO {table.name}",
            *_create_indexes(table, "")]
    return out
