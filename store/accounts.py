"""The accounts part of a store backend: tenants and their limits, API keys, the audit log.

The records and their rules are `accounts.tenants`; the SQL both backends run for them is
`accounts.rows` (`Rows`), called inside each backend's own transactions, so that a change and
its audit record commit together. Every change here is a change other processes see (the data
version moves, PostgreSQL notifies), except `mark_used`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from accounts.tenants import ApiKey, AuditRecord, TenantInfo, TenantLimits


class Accounts(ABC):
    """The tenants, keys and audit rows of one store. Thread-safe; every method may block on
    I/O. Names and values come validated (`HeadStore`)."""

    @abstractmethod
    def add_tenant(self, name: str, *, actor: str,
                   limits: TenantLimits | None = None) -> TenantInfo:
        """Add a tenant, with its limits if given (audited). Raises TenantExists."""

    @abstractmethod
    def tenants(self) -> list[TenantInfo]:
        """Every tenant (DEFAULT_TENANT always) with its live bot count and limits, ordered by
        name."""

    @abstractmethod
    def set_limits(self, name: str, changes: dict, *, actor: str) -> TenantLimits:
        """Change a tenant's limits (`accounts.rows.Rows.set_limits`), audited. Raises
        UnknownTenant, InvalidLimits."""

    @abstractmethod
    def tenant_limits(self) -> dict[str, TenantLimits]:
        """{tenant: limits} of every tenant (DEFAULT_TENANT always), read now."""

    @abstractmethod
    def remove_tenant(self, name: str, *, force: bool, actor: str) -> None:
        """In one transaction: with `force`, remove its bots; revoke its keys; delete it; each
        change audited. Raises UnknownTenant, TenantNotEmpty (bots left and not `force`)."""

    @abstractmethod
    def add_key(self, key: ApiKey, *, actor: str) -> None:
        """Store a new key (audited). Raises UnknownTenant."""

    @abstractmethod
    def keys(self, tenant: str | None = None, *, live_only: bool = False) -> list[ApiKey]:
        """Keys ordered by creation; only `tenant`'s, only unrevoked ones, if asked."""

    @abstractmethod
    def revoke_key(self, key_id: str, *, actor: str) -> ApiKey:
        """Revoke a key (audited; nothing written if it was revoked already). Raises
        UnknownKey."""

    @abstractmethod
    def mark_used(self, used: dict[str, str]) -> None:
        """Set last_used of keys ({key id: at}); no audit record, not a change others see."""

    @abstractmethod
    def record_refusal(self, *, at: str, actor: str, tenant: str, bot_id: str,
                       detail: str) -> None:
        """Append a "refused" audit record: `actor` of `tenant` asked to change `bot_id`, which
        it does not see (unknown to it, or another tenant's: recorded alike), or to register an
        id that is taken. Not a change others see (no data version move, no notification)."""

    @abstractmethod
    def audit(self, *, tenant: str | None, since: str | None, limit: int) -> list[AuditRecord]:
        """The newest `limit` audit records matching, oldest first."""
