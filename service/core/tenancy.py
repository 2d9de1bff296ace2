"""Tenants at serving time: their limits as the engine reads them (fair share, quota, queue
cap: from memory, per request and per batch row), the registrations-per-minute bucket and the
serve defaults of the storage limits (which the store applies in a registration's
transaction), and the operator's changes to tenants, keys and the audit log, off the event
loop. No access rule here: a call reaches this through
`service.core.caller.Caller`, which applies them."""
from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable

from accounts.tenants import OPERATOR as OPERATOR_ACTOR
from accounts.tenants import ApiKey, AuditRecord, TenantInfo, TenantLimits
from service.core.errors import RegistrationRateLimited
from service.core.quota import Quotas
from service.core.settings import Settings
from service.core.threads import Threads
from store import HeadStore


class Tenancy:
    """The tenants of one process's store.

    Args:
        settings: the serve defaults of every limit a tenant leaves unset, and under Ray the
            quota divisor (the replicas sharing one tenant's traffic).
        store: the store; outside Ray its serving processes (`HeadStore.processes`, counted
            from memory) are the quota divisor (`service.core.quota`).
        threads: where the store is read and written, off the event loop.
    """

    def __init__(self, settings: Settings, store: HeadStore, threads: Threads, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._threads = threads
        # Fair sharing: each tenant's settings from the store (read from memory, re-read when
        # the store changes), the serve flags for what a tenant leaves unset.
        self._defaults = TenantLimits(
            weight=settings.tenant_weight, rate=settings.tenant_rate,
            burst=settings.tenant_burst, max_queued=settings.tenant_max_queued,
            max_bots=settings.tenant_max_bots, max_versions=settings.tenant_max_versions,
            max_head_bytes=settings.tenant_max_head_bytes,
            registrations_per_minute=settings.tenant_registrations_per_minute,
            deadline_ms=settings.tenant_deadline_ms)
        self._table: dict | None = None
        self._filled: dict[str, TenantLimits] = {}
        # Under Ray the replica count; else the processes serving this store, as last counted.
        divisor = settings.quota_divisor if settings.ray else store.processes.count
        self.quotas = Quotas(self.rate, divisor=divisor, clock=clock)
        # Registrations per minute: a bucket of one minute's worth per tenant, divided alike.
        self.registrations = Quotas(self._registration_rate, divisor=divisor, clock=clock,
                                    refuse=_registration_refused)

    # -- limits (from memory: called per request and per batch row) --------------------------------

    def limits(self, tenant: str) -> TenantLimits:
        """`tenant`'s limits, each its own or else the serve default (`TenantLimits.filled`).
        Called per request and per batch row: kept per tenant until the store's table of
        limits is re-read (`HeadStore.tenant_limits` returns the same dict until then)."""
        table = self._store.tenant_limits()
        if table is not self._table:
            self._table, self._filled = table, {}
        filled = self._filled.get(tenant)
        if filled is None:
            own = table.get(tenant) or TenantLimits()
            filled = self._filled[tenant] = own.filled(self._defaults)
        return filled

    def weight(self, tenant: str) -> float:
        """`tenant`'s share of the trunk relative to the others' (the batcher's)."""
        return self.limits(tenant).weight

    def rate(self, tenant: str) -> tuple[float | None, int | None]:
        """(images per second, burst): None is no quota, and the quota's default burst."""
        limits = self.limits(tenant)
        return limits.rate, limits.burst

    def deadline_ms(self, tenant: str) -> float | None:
        """The deadline of `tenant`'s requests that give none, in ms (None: none but
        --request-timeout-s)."""
        return self.limits(tenant).deadline_ms

    def max_queued(self, tenant: str) -> int | None:
        """`tenant`'s own cap on queued images (the batcher's), None for none."""
        return self.limits(tenant).max_queued

    @property
    def defaults(self) -> TenantLimits:
        """The serve defaults of every limit (the store applies the storage ones in the
        registration's transaction: `HeadStore.register(defaults=...)`)."""
        return self._defaults

    def _registration_rate(self, tenant: str) -> tuple[float | None, int | None]:
        per_minute = self.limits(tenant).registrations_per_minute
        return (None, None) if per_minute is None else (per_minute / 60.0, per_minute)

    def refuse_early(self, tenant: str, kind: str,
                     n: float = 1.0) -> contextlib.AbstractContextManager:
        """Before a request's body is read: raises the refusal its tenant's bucket would give
        it anyway, when it cannot hold `n` (what its head says it costs at least) beside the
        tenant's requests already past this door and not yet charged (`kind`: "images", the
        quota; or "registrations", where `n` is 1); else the request's claim
        (`Quotas.claim`), held while it runs. A flood of requests refused anyway then costs
        the server their heads, not their bodies. Takes nothing."""
        if kind == "images":
            return self.quotas.claim(tenant, n)
        return self.registrations.claim(tenant)

    def take_registration(self, tenant: str) -> None:
        """Count one registration of `tenant` against its registrations_per_minute: a token
        bucket holding one minute's worth, refilled continuously, divided between the
        processes serving the store as the quotas are. Raises RegistrationRateLimited (429 +
        Retry-After) when the bucket is empty."""
        self.registrations.take(tenant, 1)

    # -- tenants, keys, audit (the operator's; a manage key reads its tenant's audit) --------------

    async def tenants(self) -> list[TenantInfo]:
        return await self._threads.blocking(self._store.tenants)

    async def add_tenant(self, name: str, *, actor: str = OPERATOR_ACTOR,
                         limits: TenantLimits | None = None) -> TenantInfo:
        return await self._threads.blocking(functools.partial(
            self._store.add_tenant, name, actor=actor, limits=limits))

    async def set_tenant_limits(self, name: str, *, actor: str = OPERATOR_ACTOR,
                                **changes: float | int | None) -> TenantLimits:
        """Changes a tenant's limits (`HeadStore.set_tenant_limits`: None is back to the serve
        default, a limit not given keeps its value); returns them."""
        return await self._threads.blocking(functools.partial(
            self._store.set_tenant_limits, name, actor=actor, **changes))

    async def remove_tenant(self, name: str, *, force: bool = False,
                            actor: str = OPERATOR_ACTOR) -> None:
        await self._threads.blocking(functools.partial(
            self._store.remove_tenant, name, force=force, actor=actor))

    async def keys(self, tenant: str | None = None) -> list[ApiKey]:
        return await self._threads.blocking(self._store.keys, tenant)

    async def add_key(self, tenant: str, scope: str, *,
                      actor: str = OPERATOR_ACTOR) -> tuple[ApiKey, str]:
        return await self._threads.blocking(functools.partial(
            self._store.add_key, tenant, scope, actor=actor))

    async def revoke_key(self, key_id: str, *, actor: str = OPERATOR_ACTOR) -> ApiKey:
        return await self._threads.blocking(functools.partial(
            self._store.revoke_key, key_id, actor=actor))

    async def audit(self, *, tenant: str | None = None, since: str | None = None,
                    limit: int = 1000) -> list[AuditRecord]:
        return await self._threads.blocking(functools.partial(
            self._store.audit, tenant=tenant, since=since, limit=limit))


def _registration_refused(tenant: str, wait: float, rate: float) -> RegistrationRateLimited:
    return RegistrationRateLimited(
        wait, f"tenant {tenant!r} is at its registrations_per_minute={rate * 60:g} in this "
              f"process: retry after {math.ceil(wait)} s")
