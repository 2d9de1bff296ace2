"""The accounts of a PostgreSQL store: `accounts.rows` run in the transactions of
`store.pg.database`; every change notifies every process, like a change to the bots."""
from __future__ import annotations

from accounts.errors import UnknownKey
from accounts.tenants import ApiKey, AuditRecord, TenantInfo, TenantLimits
from store.accounts import Accounts
from store.pg.bots import PgBots
from store.pg.database import Database, rows
from store.pg.schema import NO_SCHEMA


class PgAccounts(Accounts):
    """The tenants, keys and audit rows of a PostgreSQL store."""

    def __init__(self, db: Database, bots: PgBots) -> None:
        self._db = db
        self._bots = bots  # a tenant removed with its bots removes them through it

    def add_tenant(self, name: str, *, actor: str,
                   limits: TenantLimits | None = None) -> TenantInfo:
        return self._db.write(lambda conn: rows(conn).create_tenant(name, actor, limits))

    def tenants(self) -> list[TenantInfo]:
        return self._db.read_rows(lambda found: found.tenants())

    def set_limits(self, name: str, changes: dict, *, actor: str) -> TenantLimits:
        return self._db.write(lambda conn: rows(conn).set_limits(name, changes, actor))

    def tenant_limits(self) -> dict[str, TenantLimits]:
        return self._db.read_rows(lambda found: found.tenant_limits())

    def remove_tenant(self, name: str, *, force: bool, actor: str) -> None:
        self._db.write(lambda conn: rows(conn).drop_tenant(
            name, force=force, actor=actor,
            remove_bot=lambda bot_id, at: self._bots.unregister(conn, bot_id, at, actor)))

    def add_key(self, key: ApiKey, *, actor: str) -> None:
        self._db.write(lambda conn: rows(conn).create_key(key, actor))

    def keys(self, tenant: str | None = None, *, live_only: bool = False) -> list[ApiKey]:
        return self._db.read_rows(lambda found: found.keys(tenant, live_only=live_only))

    def revoke_key(self, key_id: str, *, actor: str) -> ApiKey:
        key = self._db.read_rows(lambda found: found.key(key_id))  # unknown or revoked: no write
        if key is None:
            raise UnknownKey(key_id)
        if key.revoked is not None:
            return key
        return self._db.write(lambda conn: rows(conn).revoke(key_id, actor))

    def mark_used(self, used: dict[str, str]) -> None:
        # Not a change other processes need to see: no writer lock, no change_seq, no NOTIFY.
        def work(conn):
            try:
                with conn.transaction():
                    rows(conn).mark_used(used)
            except NO_SCHEMA:
                pass  # no keys in this store

        self._db.pool.run(work, read=False)

    def record_refusal(self, *, at: str, actor: str, tenant: str, bot_id: str,
                       detail: str) -> None:
        # Not a change other processes need to see: no writer lock, no change_seq, no NOTIFY
        # (but the schema first: an older store's check on audit.action lacks "refused").
        def work(conn):
            self._db.ensure_schema(conn)
            with conn.transaction():
                rows(conn).record(at=at, actor=actor, action="refused", tenant=tenant,
                                  bot_id=bot_id, detail=detail)

        self._db.pool.run(work, read=False)

    def audit(self, *, tenant: str | None, since: str | None, limit: int) -> list[AuditRecord]:
        return self._db.read_rows(
            lambda found: found.audit(tenant=tenant, since=since, limit=limit))
