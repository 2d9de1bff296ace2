"""The rows of tenants, their limits, API keys, bot owners and the audit log: the SQL both
backends run.

`Rows` wraps one connection of either backend (a sqlite3 connection in a `Registry.write()` or
read transaction, a psycopg connection inside `conn.transaction()` or in autocommit for reads);
each backend keeps its own transactions, locks and change notification, and calls these inside
them, so that a change and its audit record commit together.

A store written before tenants existed lacks these tables until its next write: reads treat a
missing table as empty (`missing`), and a bot without an owners row belongs to DEFAULT_TENANT.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from accounts.errors import (
    InvalidTenant,
    TenantExists,
    TenantLimitExceeded,
    TenantNotEmpty,
    UnknownKey,
    UnknownTenant,
)
from accounts.tenants import (
    DEFAULT_TENANT,
    FAIR_LIMIT_NAMES,
    HEAD_BYTES_PER_CLASS,
    LATENCY_LIMIT_NAMES,
    LATENCY_TABLE,
    STORAGE_LIMIT_NAMES,
    STORAGE_TABLE,
    TOKEN_PREFIX,
    ApiKey,
    AuditRecord,
    TenantInfo,
    TenantLimits,
    describe_limits,
    utc_now,
    versions_to_prune,
)

_KEY_COLUMNS = "id, tenant, scope, hash, created, last_used, revoked"
_AUDIT_COLUMNS = "id, at, actor, action, tenant, bot_id, version, digest, detail"
# Each table of limits and its columns.
_LIMIT_TABLES = {"tenant_limits": FAIR_LIMIT_NAMES, STORAGE_TABLE: STORAGE_LIMIT_NAMES,
                 LATENCY_TABLE: LATENCY_LIMIT_NAMES}


def _api_key(row: Sequence) -> ApiKey:
    key_id, tenant, scope, digest, created, last_used, revoked = row
    return ApiKey(key_id, tenant, scope, f"{TOKEN_PREFIX}{key_id}", created, last_used, revoked,
                  digest)


class Rows:
    """Tenants, keys, owners and audit rows through `conn`.

    Args:
        conn: has `execute(sql, params)` returning a cursor (sqlite3 or psycopg).
        prefix: before every table name ("multihead." for PostgreSQL).
        qmark: the connection takes `?` placeholders (sqlite3) instead of `%s`.
        missing: whether an exception says that a table does not exist (an older store).
    """

    def __init__(self, conn, *, prefix: str = "", qmark: bool = False,
                 missing: Callable[[BaseException], bool]) -> None:
        self._conn = conn
        self.p = prefix
        self._qmark = qmark
        self._missing = missing

    def _x(self, sql: str, params: Sequence = ()):
        if self._qmark:
            sql = sql.replace("%s", "?")
        return self._conn.execute(sql, tuple(params))

    def _read(self, sql: str, params: Sequence = ()) -> list:
        """Every row, or [] if a table is missing (a store made before these tables)."""
        try:
            return self._x(sql, params).fetchall()
        except Exception as exc:
            if self._missing(exc):
                return []
            raise

    # -- reads -----------------------------------------------------------------------------------

    def tenant_exists(self, name: str) -> bool:
        return name == DEFAULT_TENANT or bool(self._read(
            f"SELECT 1 FROM {self.p}tenants WHERE name = %s", (name,)))

    def owner(self, bot_id: str) -> str:
        """The tenant of `bot_id` (call it for a live bot)."""
        rows = self._read(f"SELECT tenant FROM {self.p}owners WHERE bot_id = %s", (bot_id,))
        return rows[0][0] if rows else DEFAULT_TENANT

    def owner_map(self) -> dict[str, str]:
        """{bot id: tenant} of the bots with an owners row (the others: DEFAULT_TENANT)."""
        return dict(self._read(f"SELECT bot_id, tenant FROM {self.p}owners"))

    def owned_bots(self, tenant: str) -> list[str]:
        """The live bots of `tenant`, ordered by id."""
        try:
            rows = self._x(
                f"SELECT b.bot_id FROM {self.p}bots b LEFT JOIN {self.p}owners o "
                f"ON o.bot_id = b.bot_id WHERE COALESCE(o.tenant, %s) = %s ORDER BY b.bot_id",
                (DEFAULT_TENANT, tenant)).fetchall()
        except Exception as exc:
            if not self._missing(exc):
                raise
            rows = (self._read(f"SELECT bot_id FROM {self.p}bots ORDER BY bot_id")
                    if tenant == DEFAULT_TENANT else [])
        return [r[0] for r in rows]

    def _limit_values(self, name: str | None = None) -> dict[str, dict]:
        """{tenant: {limit: value}} from every table of limits (a missing table: none)."""
        found: dict[str, dict] = {}
        where, params = ("WHERE name = %s", (name,)) if name is not None else ("", ())
        for table, columns in _LIMIT_TABLES.items():
            for row in self._read(f"SELECT name, {', '.join(columns)} FROM {self.p}{table} "
                                  f"{where}", params):
                found.setdefault(row[0], {}).update(zip(columns, row[1:]))
        return found

    def limits(self) -> dict[str, TenantLimits]:
        """The limits of the tenants that have a limits row (the others have every default)."""
        return {name: TenantLimits(**values) for name, values in self._limit_values().items()}

    def limits_of(self, name: str) -> TenantLimits:
        values = self._limit_values(name).get(name)
        return TenantLimits(**values) if values else TenantLimits()

    def tenant_limits(self) -> dict[str, TenantLimits]:
        """{tenant: its limits} of every tenant, DEFAULT_TENANT always."""
        limits = self.limits()
        names = {DEFAULT_TENANT, *(r[0] for r in self._read(f"SELECT name FROM {self.p}tenants"))}
        return {name: limits.get(name, TenantLimits()) for name in sorted(names)}

    def tenants(self) -> list[TenantInfo]:
        """Every tenant with its live bot count and limits, ordered by name; DEFAULT_TENANT
        always."""
        limits = self.limits()
        created = dict(self._read(f"SELECT name, created FROM {self.p}tenants"))
        try:
            counts = dict(self._x(
                f"SELECT COALESCE(o.tenant, %s), count(*) FROM {self.p}bots b "
                f"LEFT JOIN {self.p}owners o ON o.bot_id = b.bot_id "
                "GROUP BY 1", (DEFAULT_TENANT,)).fetchall())
        except Exception as exc:
            if not self._missing(exc):
                raise
            counts = dict((DEFAULT_TENANT, n) for (n,) in
                          self._read(f"SELECT count(*) FROM {self.p}bots"))
        names = sorted({DEFAULT_TENANT, *created}, key=lambda n: n.encode())
        return [TenantInfo(n, created.get(n), int(counts.get(n, 0)),
                           limits.get(n, TenantLimits())) for n in names]

    def keys(self, tenant: str | None = None, *, live_only: bool = False) -> list[ApiKey]:
        """Keys ordered by (created, id); only `tenant`'s if given, only unrevoked ones if
        `live_only`."""
        where, params = [], []
        if tenant is not None:
            where.append("tenant = %s")
            params.append(tenant)
        if live_only:
            where.append("revoked IS NULL")
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        return [_api_key(r) for r in self._read(
            f"SELECT {_KEY_COLUMNS} FROM {self.p}api_keys {clause}ORDER BY created, id",
            params)]

    def key(self, key_id: str) -> ApiKey | None:
        rows = self._read(f"SELECT {_KEY_COLUMNS} FROM {self.p}api_keys WHERE id = %s",
                          (key_id,))
        return _api_key(rows[0]) if rows else None

    def audit(self, *, tenant: str | None, since: str | None, limit: int) -> list[AuditRecord]:
        """The newest `limit` records matching, oldest first."""
        where, params = [], []
        if tenant is not None:
            where.append("tenant = %s")
            params.append(tenant)
        if since is not None:
            where.append("at >= %s")
            params.append(since)
        clause = f"WHERE {' AND '.join(where)} " if where else ""
        rows = self._read(f"SELECT {_AUDIT_COLUMNS} FROM {self.p}audit {clause}"
                          f"ORDER BY id DESC LIMIT %s", (*params, int(limit)))
        return [AuditRecord(int(r[0]), r[1], r[2], r[3], r[4], r[5],
                            None if r[6] is None else int(r[6]), r[7], r[8])
                for r in reversed(rows)]

    # -- writes (inside the backend's write transaction) ---------------------------------------

    def add_tenant(self, name: str, created: str) -> None:
        self._x(f"INSERT INTO {self.p}tenants (name, created) VALUES (%s, %s)", (name, created))

    def delete_tenant(self, name: str) -> None:
        self._x(f"DELETE FROM {self.p}tenants WHERE name = %s", (name,))
        self.delete_limits(name)

    def delete_limits(self, name: str) -> None:
        for table in _LIMIT_TABLES:
            self._x(f"DELETE FROM {self.p}{table} WHERE name = %s", (name,))

    def write_limits(self, name: str, limits: TenantLimits, at: str) -> None:
        values = limits.to_dict()
        for table, columns in _LIMIT_TABLES.items():
            self._x(f"INSERT INTO {self.p}{table} (name, {', '.join(columns)}, updated) "
                    f"VALUES (%s, {', '.join(['%s'] * len(columns))}, %s) "
                    f"ON CONFLICT (name) DO UPDATE "
                    f"SET {', '.join(f'{n} = excluded.{n}' for n in columns)}, "
                    "updated = excluded.updated",
                    (name, *(values[n] for n in columns), at))

    # -- storage limits (inside a registration's write transaction) ---------------------------

    def head_bytes(self, tenant: str) -> int:
        """The head bytes of every stored version of `tenant`'s live bots
        (`HEAD_BYTES_PER_CLASS` per class)."""
        rows = self._x(
            f"SELECT COALESCE(sum(v.n_classes), 0) FROM {self.p}versions v "
            f"JOIN {self.p}bots b ON b.bot_id = v.bot_id "
            f"LEFT JOIN {self.p}owners o ON o.bot_id = v.bot_id "
            "WHERE COALESCE(o.tenant, %s) = %s", (DEFAULT_TENANT, tenant)).fetchall()
        return int(rows[0][0]) * HEAD_BYTES_PER_CLASS

    def version_classes(self, bot_id: str) -> dict[int, int]:
        """{version: n_classes} of every stored version of `bot_id`."""
        return {int(v): int(n) for v, n in self._x(
            f"SELECT version, n_classes FROM {self.p}versions WHERE bot_id = %s",
            (bot_id,)).fetchall()}

    def storage_plan(self, tenant: str, bot_id: str, *, version: int, n_classes: int,
                     previous: int | None, candidate: int | None, as_candidate: bool,
                     defaults: TenantLimits | None) -> list[int]:
        """The versions of `bot_id` to prune for registering `version` (`n_classes`) of it in
        `tenant`, as `accounts.tenants.versions_to_prune` picks them, after checking the
        tenant's max_bots (a new bot) and max_head_bytes (the bytes after pruning, and after
        dropping a candidate the new one replaces). Each limit is the tenant's own, else
        `defaults`' (the serve defaults; None: none). Call it before writing the new version.

        Args:
            previous: the bot's active version (None: a new bot).
            candidate: the bot's candidate now (None: none); a new candidate replaces it.
            as_candidate: the new version becomes the candidate, not the active one.
        Raises:
            TenantLimitExceeded.
        """
        limits = self.limits_of(tenant).filled(defaults or TenantLimits())
        if previous is None and limits.max_bots is not None \
                and len(self.owned_bots(tenant)) >= limits.max_bots:
            raise TenantLimitExceeded("max_bots", limits.max_bots,
                                      f"tenant {tenant!r} owns {limits.max_bots} bot(s)")
        stored = self.version_classes(bot_id) if previous is not None else {}
        dropped = [candidate] if as_candidate and candidate is not None else []
        kept = [v for v in stored if v not in dropped]
        pruned = versions_to_prune(
            sorted([*kept, version]), active=version if not as_candidate else previous,
            candidate=version if as_candidate else candidate, previous=previous,
            max_versions=limits.max_versions)
        if limits.max_head_bytes is not None:
            freed = sum(stored[v] for v in (*dropped, *pruned)) * HEAD_BYTES_PER_CLASS
            total = self.head_bytes(tenant) - freed + n_classes * HEAD_BYTES_PER_CLASS
            if total > limits.max_head_bytes:
                raise TenantLimitExceeded(
                    "max_head_bytes", limits.max_head_bytes,
                    f"this head of {n_classes} classes would bring tenant {tenant!r} to "
                    f"{total} stored head bytes")
        return pruned

    def set_owner(self, bot_id: str, tenant: str) -> None:
        self._x(f"INSERT INTO {self.p}owners (bot_id, tenant) VALUES (%s, %s) "
                "ON CONFLICT (bot_id) DO UPDATE SET tenant = excluded.tenant", (bot_id, tenant))

    def delete_owner(self, bot_id: str) -> None:
        self._x(f"DELETE FROM {self.p}owners WHERE bot_id = %s", (bot_id,))

    def add_key(self, key: ApiKey) -> None:
        self._x(f"INSERT INTO {self.p}api_keys ({_KEY_COLUMNS}) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (key.id, key.tenant, key.scope, key.hash, key.created, None, None))

    def revoke_key(self, key_id: str, at: str) -> None:
        self._x(f"UPDATE {self.p}api_keys SET revoked = %s WHERE id = %s AND revoked IS NULL",
                (at, key_id))

    def mark_used(self, used: dict[str, str]) -> None:
        """last_used = the later of the stored one and the given one, per key (in id order, so
        that two writers never wait on each other's rows in opposite orders)."""
        for key_id, at in sorted(used.items()):
            self._x(f"UPDATE {self.p}api_keys SET last_used = %s WHERE id = %s "
                    "AND (last_used IS NULL OR last_used < %s)", (at, key_id, at))

    def record(self, *, at: str, actor: str, action: str, tenant: str | None = None,
               bot_id: str | None = None, version: int | None = None,
               digest: str | None = None, detail: str | None = None) -> None:
        """Append one audit record."""
        self._x(f"INSERT INTO {self.p}audit (at, actor, action, tenant, bot_id, version, digest, "
                "detail) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (at, actor, action, tenant, bot_id, version, digest, detail))

    # -- the changes: checks, rows and their audit record (inside a write transaction) ---------

    def create_tenant(self, name: str, actor: str,
                      limits: TenantLimits | None = None) -> TenantInfo:
        """Adds tenant `name`, with `limits` if given (the audit record's detail names them).
        Raises TenantExists."""
        if self.tenant_exists(name):
            raise TenantExists(name)
        at = utc_now()
        self.add_tenant(name, at)
        # NOTE: a version before limits removed tenants without their limits row: a new tenant
        # of the same name must not inherit it.
        self.delete_limits(name)
        given = {} if limits is None else {n: v for n, v in limits.to_dict().items()
                                           if v is not None}
        if given:
            self.write_limits(name, limits, at)
        self.record(at=at, actor=actor, action="tenant_add", tenant=name,
                    detail=describe_limits(given) or None)
        return TenantInfo(name, at, 0, limits if limits is not None else TenantLimits())

    def set_limits(self, name: str, changes: dict, actor: str) -> TenantLimits:
        """Changes the limits of tenant `name` (DEFAULT_TENANT too): each limit in `changes`
        takes its value (None: back to the serve default), the others keep theirs; audited as
        "tenant_set" with the changes as detail. Returns the limits now.

        Raises:
            UnknownTenant; InvalidLimits (a value or name `accounts.tenants.validate_limit`
            refuses).
        """
        if not self.tenant_exists(name):
            raise UnknownTenant(name)
        limits = self.limits_of(name).changed(**changes)
        at = utc_now()
        self.write_limits(name, limits, at)
        self.record(at=at, actor=actor, action="tenant_set", tenant=name,
                    detail=describe_limits({n: getattr(limits, n) for n in changes}))
        return limits

    def drop_tenant(self, name: str, *, force: bool, actor: str,
                    remove_bot: Callable[[str, str], None]) -> list[str]:
        """Removes tenant `name`, revoking its keys; with `force` also its bots (each through
        the backend's `remove_bot(bot_id, at)`). Returns the bots removed.

        Raises:
            InvalidTenant (the default tenant), UnknownTenant, TenantNotEmpty (bots, no force).
        """
        if name == DEFAULT_TENANT:
            raise InvalidTenant("the default tenant cannot be removed")
        if not self.tenant_exists(name):
            raise UnknownTenant(name)
        bots = self.owned_bots(name)
        if bots and not force:
            raise TenantNotEmpty(name, len(bots))
        at = utc_now()
        for bot_id in bots:
            remove_bot(bot_id, at)
        keys = self.keys(name, live_only=True)
        for key in keys:
            self.revoke_key(key.id, at)
            self.record(at=at, actor=actor, action="key_revoke", tenant=name,
                        detail=f"key {key.id} scope {key.scope}")
        self.delete_tenant(name)
        self.record(at=at, actor=actor, action="tenant_remove", tenant=name,
                    detail=f"with {len(bots)} bot(s) and {len(keys)} key(s)")
        return bots

    def create_key(self, key: ApiKey, actor: str) -> None:
        """Stores `key` (its hash only). Raises UnknownTenant."""
        if not self.tenant_exists(key.tenant):
            raise UnknownTenant(key.tenant)
        self.add_key(key)
        self.record(at=key.created, actor=actor, action="key_add", tenant=key.tenant,
                    detail=f"key {key.id} scope {key.scope}")

    def revoke(self, key_id: str, actor: str) -> ApiKey:
        """Revokes key `key_id` (an already revoked one is left as it is); returns it.
        Raises UnknownKey."""
        key = self.key(key_id)
        if key is None:
            raise UnknownKey(key_id)
        if key.revoked is None:
            at = utc_now()
            self.revoke_key(key_id, at)
            self.record(at=at, actor=actor, action="key_revoke", tenant=key.tenant,
                        detail=f"key {key.id} scope {key.scope}")
            key = self.key(key_id)
        return key
