"""The store's tables, described once as data; each backend renders its DDL from here.

    TABLES          bots, versions, history, tenants, api_keys, owners, audit (both backends);
                    state, blobs (PostgreSQL only: its writer lock and change counter, and the
                    tensors that a directory store keeps as files)
    create_statements(dialect, prefix="")   the CREATE statements of one dialect

Column types are logical (`KEY`, `TEXT`, `INT`, ...) and `DIALECTS` maps them to each
database's: a bot id is `TEXT` in SQLite (whose default collation already orders by bytes) and
`text COLLATE "C"` in PostgreSQL, so that both list bots in the same (byte) order; labels are a
JSON array, `TEXT` in SQLite and `jsonb` in PostgreSQL. Checks are SQL both dialects accept.

Foreign keys are declared in PostgreSQL only: SQLite enforces them only on connections that
turn them on, and a declaration nothing enforces would promise what it does not keep.

Every statement is `CREATE ... IF NOT EXISTS`: running them on an existing store changes
nothing, so stores written by earlier versions open as they are (tests/heads/test_schema.py
keeps such stores, verbatim, and checks the live schemas of both backends against `TABLES`).
That is also the whole migration to tenants: a store written before them gains the empty
tables tenants, api_keys, owners and audit at its next write, and a live bot without an owners
row belongs to `heads.tenants.DEFAULT_TENANT` (no row is rewritten). Until that write, readers
take the missing tables as empty.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from heads.backend import POSTGRESQL, SQLITE
from heads.tenants import AUDIT_ACTIONS, SCOPES

# Logical column types.
KEY = "key"        # an id compared and ordered byte by byte
TEXT = "text"
INT = "int"        # 32 bits
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
ACTIONS = ("register", "rollback", "remove")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


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
    # The tensors and labels of each version (see heads.pg.blobs).
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
    # API keys: only the sha256 of each token (see heads.tenants). No foreign key to tenants:
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
)


@dataclass(frozen=True)
class Dialect:
    """How one database spells the logical types, and what it declares."""

    types: dict[str, str]
    serial: str  # the whole column definition after the name
    foreign_keys: bool
    storage_hint: str | None  # ALTER TABLE ... {hint}: a column that does not compress


DIALECTS = {
    SQLITE: Dialect(
        types={KEY: "TEXT", TEXT: "TEXT", INT: "INTEGER", BIGINT: "INTEGER", JSON: "TEXT",
               BYTES: "BLOB", BOOL: "BOOLEAN"},
        serial="INTEGER PRIMARY KEY AUTOINCREMENT",
        foreign_keys=False, storage_hint=None),
    POSTGRESQL: Dialect(
        types={KEY: 'text COLLATE "C"', TEXT: "text", INT: "integer", BIGINT: "bigint",
               JSON: "jsonb", BYTES: "bytea", BOOL: "boolean"},
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
        out.append(f"CREATE TABLE IF NOT EXISTS {prefix}{table.name} (\n    {body}\n)")
        if d.storage_hint is not None:
            out += [f"ALTER TABLE {prefix}{table.name} ALTER COLUMN {c.name} {d.storage_hint}"
                    for c in table.columns if not c.compressible]
        out += [f"CREATE INDEX IF NOT EXISTS {index.name} ON {prefix}{table.name} "
                f"({', '.join(index.columns)})" for index in table.indexes]
    return out
