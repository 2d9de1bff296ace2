"""Per-tenant storage limits in the registration's transaction, on both backends: max_bots,
max_head_bytes (refused, nothing written), max_versions (the oldest versions pruned with their
blobs, never the active one, the candidate, the previous active one or the rollback target)."""
from __future__ import annotations

import pytest

from accounts import TenantLimitExceeded, TenantLimits
from accounts.tenants import HEAD_BYTES_PER_CLASS, versions_to_prune
from store import UnknownVersion
from tests.support.heads import random_head, store_digest, stored_entries


def _versions(s, bot_id):
    info = s.info(bot_id)
    return info.version, info.versions, None if info.candidate is None else info.candidate.version


@pytest.mark.parametrize(("stored", "active", "candidate", "previous", "cap", "pruned"), [
    ([1, 2, 3], 3, None, 2, 2, [1]),
    ([1, 2, 3, 4, 5], 5, None, 4, 2, [1, 2, 3]),
    ([1, 2, 3], 3, None, 2, None, []),
    ([1, 2, 3, 4], 4, None, 2, 3, [1]),          # 2 was active before, 3 is rollback's pick
    ([1, 2, 3, 4, 5], 4, 5, 4, 1, [1, 2]),       # a new candidate: active 4, rollback 3 kept
    ([1, 2, 3, 4, 5], 5, None, 1, 1, [2, 3]),    # rolled back to 1 before: 1 and 4 kept
])
def test_which_versions_are_pruned(stored, active, candidate, previous, cap, pruned):
    assert versions_to_prune(stored, active=active, candidate=candidate, previous=previous,
                             max_versions=cap) == pruned


def test_max_bots_refuses_a_new_bot_and_writes_nothing(any_store, location):
    s = any_store
    s.add_tenant("acme", limits=TenantLimits(max_bots=2))
    s.add_tenant("globex")
    s.register("a1", *random_head(3, seed=1), tenant="acme")
    s.register("a2", *random_head(3, seed=2), tenant="acme")
    before = store_digest(location)
    with pytest.raises(TenantLimitExceeded, match="max_bots=2") as refused:
        s.register("a3", *random_head(3, seed=3), tenant="acme")
    assert (refused.value.limit, refused.value.value) == ("max_bots", 2)
    assert store_digest(location) == before
    assert s.register("a2", *random_head(3, seed=4), tenant="acme") == 2  # a new version: fine
    for i in range(3):
        s.register(f"g{i}", *random_head(3, seed=i), tenant="globex")  # another tenant: fine
    # The serve default applies when the tenant's own is unset; its own wins.
    with pytest.raises(TenantLimitExceeded, match="max_bots=3"):
        s.register("g3", *random_head(3, seed=9), tenant="globex",
                   defaults=TenantLimits(max_bots=3))
    s.set_tenant_limits("acme", max_bots=None)
    assert s.register("a3", *random_head(3, seed=3), tenant="acme") == 1


def test_max_versions_prunes_the_oldest_with_their_blobs(any_store, location):
    s = any_store
    s.add_tenant("acme", limits=TenantLimits(max_versions=2))
    for seed in range(1, 4):
        s.register("bot", *random_head(3, seed=seed), tenant="acme")
    assert _versions(s, "bot") == (3, [2, 3], None)
    assert stored_entries(location, "bot") == ["v2", "v3"]
    assert s.audit()[-1].detail == "api; pruned v1"
    # Roll back to v2, then register v4: v2 (active before) and v3 (rollback's pick) stay.
    s.rollback("bot", to=2)
    s.register("bot", *random_head(3, seed=4), tenant="acme")
    assert _versions(s, "bot") == (4, [2, 3, 4], None)
    # A candidate: the active v4, the rollback target v3 and the candidate v5 stay; v2 goes.
    s.register("bot", *random_head(3, seed=5), tenant="acme", candidate="shadow")
    assert _versions(s, "bot") == (4, [3, 4], 5)
    assert stored_entries(location, "bot") == ["v3", "v4", "v5"]
    assert s.rollback("bot") == 3 and s.get("bot").version == 3
    with pytest.raises(UnknownVersion):
        s.rollback("bot", to=1)
    # Numbers are never given again: the next version is 6.
    assert s.register("bot", *random_head(3, seed=6), tenant="acme") == 6
    assert s.history("bot")[-1]["version"] == 6


def test_max_head_bytes_counts_every_stored_version(any_store, location):
    s = any_store
    per3 = 3 * HEAD_BYTES_PER_CLASS
    s.add_tenant("acme", limits=TenantLimits(max_head_bytes=3 * per3))
    s.add_tenant("globex")
    s.register("a", *random_head(3, seed=1), tenant="acme")
    s.register("a", *random_head(3, seed=2), tenant="acme")
    s.register("b", *random_head(3, seed=3), tenant="acme")
    before = store_digest(location)
    with pytest.raises(TenantLimitExceeded, match="max_head_bytes"):
        s.register("b", *random_head(3, seed=4), tenant="acme")
    with pytest.raises(TenantLimitExceeded, match="max_head_bytes"):
        s.register("c", *random_head(2, seed=4), tenant="acme")
    assert store_digest(location) == before
    s.register("g", *random_head(30, seed=5), tenant="globex")  # another tenant: fine
    # Pruning frees room: with max_versions=1 a new version of "a" takes v1's bytes (v2 stays,
    # the rollback target).
    s.set_tenant_limits("acme", max_versions=1)
    assert s.register("a", *random_head(3, seed=6), tenant="acme") == 3
    assert _versions(s, "a") == (3, [2, 3], None)
    assert stored_entries(location, "a") == ["v2", "v3"]
    s.remove("b")
    assert s.register("c", *random_head(3, seed=7), tenant="acme") == 1


def test_the_registration_bucket_holds_a_minutes_worth_per_tenant(any_store):
    from service.core.errors import RegistrationRateLimited, error_status
    from service.core.settings import Settings
    from service.core.tenancy import Tenancy

    s = any_store
    s.add_tenant("acme", limits=TenantLimits(registrations_per_minute=3))
    now = [100.0]
    tenancy = Tenancy(Settings(store="unused", tenant_registrations_per_minute=None), s,
                      threads=None, clock=lambda: now[0])
    for _ in range(3):
        tenancy.take_registration("acme")
    with pytest.raises(RegistrationRateLimited) as refused:
        tenancy.take_registration("acme")
    assert refused.value.retry_after_s == pytest.approx(20.0)  # 3/min: one every 20 s
    assert error_status(refused.value) == (429, "registration_rate", {"Retry-After": "20"})
    now[0] = 120.0
    tenancy.take_registration("acme")  # refilled one
    for _ in range(50):
        tenancy.take_registration("globex")  # no bound by default: fine


def test_the_registration_bucket_is_divided_between_the_stores_serving_processes(any_store):
    """Two processes serving one store (two leases): each allows half a minute's worth
    (rounded up), so together they allow the tenant's registrations per minute, not twice."""
    from service.core.errors import RegistrationRateLimited
    from service.core.settings import Settings
    from service.core.tenancy import Tenancy

    s = any_store
    s.add_tenant("acme", limits=TenantLimits(registrations_per_minute=4))
    now = [100.0]
    s.processes.count = lambda: 2  # as two live leases count
    tenancy = Tenancy(Settings(store="unused", tenant_registrations_per_minute=None), s,
                      threads=None, clock=lambda: now[0])
    for _ in range(2):
        tenancy.take_registration("acme")
    with pytest.raises(RegistrationRateLimited) as refused:
        tenancy.take_registration("acme")
    assert refused.value.retry_after_s == pytest.approx(30.0)  # 2/min here: one every 30 s


def test_a_tenants_deadline_is_its_own_else_the_serve_default_and_survives_a_reopen(any_store):
    """deadline_ms is stored in a table of its own (SQLite and PostgreSQL alike), read back
    on reopen, and filled from --tenant-deadline-ms for a tenant that leaves it unset."""
    from service.core.settings import Settings
    from service.core.tenancy import Tenancy

    s = any_store
    s.add_tenant("acme", limits=TenantLimits(deadline_ms=150))
    s.add_tenant("globex")
    assert s.tenant_limits()["acme"].deadline_ms == 150.0
    tenancy = Tenancy(Settings(store="unused", tenant_deadline_ms=5000), s, threads=None)
    assert tenancy.deadline_ms("acme") == 150.0
    assert tenancy.deadline_ms("globex") == 5000.0
    assert Tenancy(Settings(store="unused"), s, threads=None).deadline_ms("globex") is None
    s.set_tenant_limits("acme", deadline_ms=None)
    assert tenancy.deadline_ms("acme") == 5000.0
    s.set_tenant_limits("acme", deadline_ms=2.5)
    assert s.audit()[-1].detail == "deadline_ms=2.5"
