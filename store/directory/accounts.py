"""The accounts of a directory store: `accounts.rows` run in the SQLite registry's
transactions (`store.directory.registry`), writes under its writer lock like the bots'."""
from __future__ import annotations

from accounts.errors import UnknownKey
from accounts.tenants import DEFAULT_TENANT, ApiKey, AuditRecord, TenantInfo, TenantLimits
from store.accounts import Accounts
from store.directory.blobs import DirectoryBlobs
from store.directory.bots import DirectoryBots
from store.directory.registry import Registry


class DirectoryAccounts(Accounts):
    """The tenants, keys and audit rows of a directory store. A registry file that does not
    exist yet reads as a store with the default tenant alone."""

    def __init__(self, registry: Registry, bots: DirectoryBots, blobs: DirectoryBlobs) -> None:
        self._registry = registry
        self._bots = bots  # a tenant removed with its bots removes them through it
        self._blobs = blobs

    def add_tenant(self, name: str, *, actor: str,
                   limits: TenantLimits | None = None) -> TenantInfo:
        with self._registry.write() as tx:
            return tx.rows.create_tenant(name, actor, limits)

    def tenants(self) -> list[TenantInfo]:
        with self._registry.reading() as rows:
            return rows.tenants() if rows is not None else [TenantInfo(DEFAULT_TENANT, None, 0)]

    def set_limits(self, name: str, changes: dict, *, actor: str) -> TenantLimits:
        with self._registry.write() as tx:
            return tx.rows.set_limits(name, changes, actor)

    def tenant_limits(self) -> dict[str, TenantLimits]:
        with self._registry.reading() as rows:
            return rows.tenant_limits() if rows is not None \
                else {DEFAULT_TENANT: TenantLimits()}

    def remove_tenant(self, name: str, *, force: bool, actor: str) -> None:
        with self._registry.write() as tx:
            bots = tx.rows.drop_tenant(
                name, force=force, actor=actor,
                remove_bot=lambda bot_id, at: self._bots.unregister(tx, bot_id, at, actor))
            tx.commit()
            for bot_id in bots:  # as a bot's removal: under the writer lock, after the commit
                self._blobs.drop(bot_id)

    def add_key(self, key: ApiKey, *, actor: str) -> None:
        with self._registry.write() as tx:
            tx.rows.create_key(key, actor)

    def keys(self, tenant: str | None = None, *, live_only: bool = False) -> list[ApiKey]:
        with self._registry.reading() as rows:
            return rows.keys(tenant, live_only=live_only) if rows is not None else []

    def revoke_key(self, key_id: str, *, actor: str) -> ApiKey:
        with self._registry.reading() as rows:  # an unknown or revoked key: no write
            key = rows.key(key_id) if rows is not None else None
        if key is None:
            raise UnknownKey(key_id)
        if key.revoked is not None:
            return key
        with self._registry.write() as tx:
            return tx.rows.revoke(key_id, actor)

    def mark_used(self, used: dict[str, str]) -> None:
        with self._registry.reading() as rows:
            if rows is None:
                return  # no registry: no keys
        with self._registry.write() as tx:
            tx.rows.mark_used(used)

    def record_refusal(self, *, at: str, actor: str, tenant: str, bot_id: str,
                       detail: str) -> None:
        with self._registry.write() as tx:
            tx.rows.record(at=at, actor=actor, action="refused", tenant=tenant, bot_id=bot_id,
                           detail=detail)

    def audit(self, *, tenant: str | None, since: str | None, limit: int) -> list[AuditRecord]:
        with self._registry.reading() as rows:
            return rows.audit(tenant=tenant, since=since, limit=limit) if rows is not None \
                else []
