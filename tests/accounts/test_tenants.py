"""Tenants, their limits, API keys and the audit log of a store, on both backends
(`any_store`/`location`): what each method does and refuses, that every change and its audit
record commit together (also under a kill -9), that a key revoked elsewhere leaves `key_table()`
within a second with no store round trip per call, that a limits change made through one store
is served by another at its next poll, and that a token is never kept, shown or logged. Tokens:
their format, and `parse_token` on anything; limits: their validator on anything (hypothesis).
Stores written before tenants, or before tenant limits: test_schema.py."""
from __future__ import annotations

import hashlib
import logging
import math
import re
import secrets
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import accounts.rows
from accounts import (
    BotOwnedElsewhere,
    InvalidLimits,
    InvalidTenant,
    TenantExists,
    TenantNotEmpty,
    UnknownKey,
    UnknownTenant,
)
from accounts.tenants import (
    LIMIT_NAMES,
    LIMITS,
    OPERATOR,
    SECRET_CHARS,
    ApiKey,
    TenantLimits,
    describe_limits,
    new_token,
    parse_token,
    token_hash,
    validate_limit,
    validate_limits,
    validate_tenant,
)
from heads import UnknownBot
from store import StoreUnavailable, open_store
from store import front as store_front
from tests.support.heads import is_pg, listening, pg_execute, random_head, stored_entries
from tests.support.limits import LIMIT_VALUES, accepted_limit
from tests.support.polling import wait_until
from tests.support.stores import BackendReads

REPO = Path(__file__).resolve().parents[2]
TOKEN_RE = re.compile(r"mhk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")
NO_LIMITS = dict.fromkeys(LIMIT_NAMES)


def audit_rows(store, **kw) -> list[tuple]:
    return [(r.actor, r.action, r.tenant, r.bot_id, r.version) for r in store.audit(**kw)]


# -- tokens (pure) ------------------------------------------------------------------------------


def test_a_new_token_names_its_key_and_is_random():
    key_id, token = new_token()
    assert re.fullmatch(r"[0-9a-f]{12}", key_id) and TOKEN_RE.fullmatch(token)
    assert token.startswith(f"mhk_{key_id}_") and parse_token(token) == key_id
    assert token_hash(token) == hashlib.sha256(token.encode()).hexdigest()
    assert len({new_token()[1] for _ in range(200)}) == 200
    # The secret is the token's last SECRET_CHARS characters, "_" and all: the tests that look
    # for it in logs take it so (splitting at the last "_" once gave a one-letter fragment).
    for key_id, token in (new_token() for _ in range(200)):
        assert token == f"mhk_{key_id}_{token[-SECRET_CHARS:]}"
    assert any("_" in new_token()[1][-SECRET_CHARS:] for _ in range(200))


def test_parse_token_is_strict():
    key_id, token = new_token()
    body = token.removeprefix("mhk_")
    for bad in ["", "mhk_", token + "x", token[:-1], token + "\n", " " + token, "MHK_" + body,
                f"mhk_{key_id.upper()}_{body[13:]}", token.replace("_", "-", 1),
                f"mhk_{key_id}_{'a' * 42}!", f"mhk_{key_id}_{'é' * 43}",
                f"mhk_{'٣' * 12}_{'a' * 43}", f"mhk_{key_id}:{body[13:]}"]:
        assert parse_token(bad) is None, bad
    for not_str in [None, b"mhk_", 42, [token]]:
        assert parse_token(not_str) is None


@given(st.text(max_size=120))
def test_parse_token_never_raises_and_accepts_only_the_format(text):
    key_id = parse_token(text)
    assert key_id is None or (TOKEN_RE.fullmatch(text) and text[4:16] == key_id)


@given(st.from_regex(TOKEN_RE, fullmatch=True))
def test_parse_token_accepts_every_well_formed_token(token):
    assert parse_token(token) == token[4:16]


def test_a_key_never_shows_its_hash_or_token():
    key_id, token = new_token()
    key = ApiKey(key_id, "t1", "infer", f"mhk_{key_id}", "2026-01-01", None, None,
                 token_hash(token))
    for shown in (repr(key), str(key), str(key.to_dict())):
        assert token not in shown and token_hash(token) not in shown
        assert token[-SECRET_CHARS:] not in shown
    assert "hash" not in key.to_dict() and key.to_dict()["prefix"] == f"mhk_{key_id}"


def test_tenant_names_follow_the_bot_id_rules():
    assert validate_tenant("acme-corp.eu_1") == "acme-corp.eu_1"
    for bad in ["", "-x", "a/b", "../x", "a" * 65, "é", None, 3]:
        with pytest.raises(InvalidTenant):
            validate_tenant(bad)


# -- tenants ------------------------------------------------------------------------------------


def test_tenants_add_list_remove_and_refusals(any_store):
    s = any_store
    assert [t.to_dict() for t in s.tenants()] == [{"name": "default", "created": None,
                                                   "bots": 0, "limits": NO_LIMITS}]
    t1 = s.add_tenant("t1")
    assert (t1.name, t1.bots) == ("t1", 0) and t1.created
    s.add_tenant("Zeta")
    s.register("acme", *random_head(3, seed=1), tenant="t1")
    s.register("beta", *random_head(2, seed=2))
    assert [(t.name, t.bots) for t in s.tenants()] == [("Zeta", 0), ("default", 1), ("t1", 1)]
    for name in ("t1", "default"):
        with pytest.raises(TenantExists, match=name):
            s.add_tenant(name)
    with pytest.raises(InvalidTenant):
        s.add_tenant("../etc")
    with pytest.raises(UnknownTenant, match="nope"):
        s.remove_tenant("nope")
    with pytest.raises(InvalidTenant, match="default"):
        s.remove_tenant("default", force=True)
    with pytest.raises(TenantNotEmpty, match="1 bot"):
        s.remove_tenant("t1")
    assert s.owner("acme") == "t1"  # the refusal changed nothing
    s.remove_tenant("Zeta")
    assert [t.name for t in s.tenants()] == ["default", "t1"]
    assert audit_rows(s) == [
        (OPERATOR, "tenant_add", "t1", None, None), (OPERATOR, "tenant_add", "Zeta", None, None),
        (OPERATOR, "register", "t1", "acme", 1), (OPERATOR, "register", "default", "beta", 1),
        (OPERATOR, "tenant_remove", "Zeta", None, None)]
    with open_store(s.location) as other:  # as another process sees it
        assert [(t.name, t.bots) for t in other.tenants()] == [("default", 1), ("t1", 1)]


def test_removing_a_tenant_with_force_removes_its_bots_and_revokes_its_keys(any_store):
    s = any_store
    s.add_tenant("t1")
    s.register("acme", *random_head(3, seed=1), tenant="t1", actor="key:abc")
    s.register("acme", *random_head(3, seed=2), tenant="t1")
    s.register("beta", *random_head(3, seed=3), tenant="t1")
    s.register("keep", *random_head(3, seed=4))
    k1, _ = s.add_key("t1", "infer")
    k2, _ = s.add_key("t1", "manage")
    other, _ = s.add_key("default", "metrics")
    s.revoke_key(k2.id)
    s.remove_tenant("t1", force=True, actor="ops")
    assert [i.bot_id for i in s.list()] == ["keep"] and not s.exists("acme")
    with pytest.raises(UnknownBot):
        s.get("acme")
    assert stored_entries(s.location, "acme") == [] == stored_entries(s.location, "beta")
    assert set(s.key_table()) == {other.id}
    assert {k.id: bool(k.revoked) for k in s.keys()} == {k1.id: True, k2.id: True,
                                                         other.id: False}
    assert [t.name for t in s.tenants()] == ["default"]
    assert audit_rows(s)[-4:] == [
        ("ops", "remove", "t1", "acme", 2), ("ops", "remove", "t1", "beta", 1),
        ("ops", "key_revoke", "t1", None, None), ("ops", "tenant_remove", "t1", None, None)]
    # The name and the bot ids are free again; the old keys stay revoked.
    s.add_tenant("t1")
    assert s.register("acme", *random_head(3, seed=5), tenant="t1") == 3  # never reused
    assert s.key_table().keys() == {other.id}


# -- limits (pure) ------------------------------------------------------------------------------


def test_the_limits_and_their_ranges():
    assert LIMIT_NAMES == ("weight", "rate", "burst", "max_queued", "max_bots", "max_versions",
                           "max_head_bytes", "registrations_per_minute", "deadline_ms")
    assert {n: (lim.integer, lim.maximum) for n, lim in LIMITS.items()} == {
        "weight": (False, 1000), "rate": (False, 1e6), "burst": (True, 10**6),
        "max_queued": (True, 10**6), "max_bots": (True, 10**6), "max_versions": (True, 1000),
        "max_head_bytes": (True, 10**12), "registrations_per_minute": (True, 10**6),
        "deadline_ms": (False, 3.6e6)}
    assert TenantLimits().to_dict() == NO_LIMITS
    limits = TenantLimits(weight=2, rate=1e6, burst=4.0, max_queued=1)
    assert limits.to_dict() == {**NO_LIMITS, "weight": 2.0, "rate": 1e6, "burst": 4,
                                "max_queued": 1}
    assert [type(v) for v in limits.to_dict().values()][:4] == [float, float, int, int]
    assert limits.changed(weight=None, burst=10) == TenantLimits(rate=1e6, burst=10,
                                                                 max_queued=1)
    assert TenantLimits(weight=3).filled(TenantLimits(1, 2, 3, 4)) == TenantLimits(3, 2, 3, 4)
    assert describe_limits({"burst": 5, "weight": 2.0, "rate": None}) == \
        "weight=2 rate=default burst=5"
    assert describe_limits({"rate": 0.25}) == "rate=0.25"


BAD_LIMITS = [
    ("weight", 0, "weight must be a number > 0 and <= 1000, got 0"),
    ("weight", -1.5, "got -1.5"), ("weight", 1000.0001, "got 1000.0001"),
    ("weight", math.nan, "got nan"), ("rate", math.inf, "rate must be a number > 0 and <= "
                                       "1000000, got inf"),
    ("rate", -math.inf, "got -inf"), ("rate", 10**400, "got 1000000000"),
    ("rate", 10**5000, "got a huge number"),
    ("burst", 1.5, "burst must be a whole number from 1 to 1000000, got 1.5"),
    ("burst", 0, "got 0"), ("burst", 10**6 + 1, "got 1000001"),
    ("max_queued", True, "max_queued must be a whole number from 1 to 1000000, got True"),
    ("weight", False, "got False"), ("weight", "2", "got '2'"),
    ("rate", "x\ny" * 30, "got 'x\\ny"), ("burst", [1], "got a list"),
    ("max_queued", b"1", "got a bytes"), ("speed", 1, "unknown limit 'speed': the limits are "
                                          "weight, rate, burst, max_queued"),
]


@pytest.mark.parametrize("name, value, message", BAD_LIMITS,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(BAD_LIMITS)])
def test_a_bad_limit_is_refused_in_one_line_naming_it(name, value, message):
    with pytest.raises(InvalidLimits) as exc:
        validate_limit(name, value)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert isinstance(exc.value, ValueError)
    with pytest.raises(InvalidLimits):
        TenantLimits(**{name: value}) if name in LIMITS else validate_limits(**{name: value})


@given(st.sampled_from(LIMIT_NAMES), LIMIT_VALUES)
def test_any_value_is_a_limit_or_refused_in_one_line_naming_it(name, value):
    try:
        kept = validate_limit(name, value)
    except InvalidLimits as exc:
        assert not accepted_limit(name, value), value
        message = str(exc)
        assert message.startswith(f"{name} must be ") and "\n" not in message, message
        assert len(message) < 120, message
        return
    assert accepted_limit(name, value), value
    if value is None:
        assert kept is None
        return
    assert type(kept) is (int if LIMITS[name].integer else float)
    assert 0 < kept <= LIMITS[name].maximum and kept == pytest.approx(float(value))
    limits = TenantLimits(**{name: value})
    assert getattr(limits, name) == kept
    assert TenantLimits(**limits.to_dict()) == limits  # the stored form gives the same limits


# -- limits in the store ------------------------------------------------------------------------


def test_tenant_limits_are_given_changed_and_put_back_to_the_defaults(any_store):
    s = any_store
    assert s.tenant_limits() == {"default": TenantLimits()}
    info = s.add_tenant("t1", limits=TenantLimits(weight=2, rate=10))
    assert info.limits == TenantLimits(weight=2.0, rate=10.0)
    assert s.add_tenant("t2").limits == TenantLimits()
    # A limit given takes its value, None puts it back to the default, the others stay.
    assert s.set_tenant_limits("t1", burst=20, rate=None) == TenantLimits(weight=2, burst=20)
    assert s.set_tenant_limits("default", max_queued=100.0, actor="ops") == TenantLimits(
        max_queued=100)
    want = {"default": TenantLimits(max_queued=100), "t1": TenantLimits(weight=2, burst=20),
            "t2": TenantLimits()}
    assert s.tenant_limits() == want
    assert {t.name: t.limits for t in s.tenants()} == want
    assert [t.to_dict()["limits"] for t in s.tenants()] == [
        {**NO_LIMITS, "max_queued": 100}, {**NO_LIMITS, "weight": 2.0, "burst": 20}, NO_LIMITS]
    assert [(r.actor, r.action, r.tenant, r.detail) for r in s.audit()] == [
        (OPERATOR, "tenant_add", "t1", "weight=2 rate=10"),
        (OPERATOR, "tenant_add", "t2", None),
        (OPERATOR, "tenant_set", "t1", "rate=default burst=20"),
        ("ops", "tenant_set", "default", "max_queued=100")]
    with open_store(s.location) as other:  # as another process sees it
        assert other.tenant_limits() == want

    # Refusals write nothing.
    before = (s.audit(), s.tenants())
    for call, error in [
            (lambda: s.set_tenant_limits("nope", weight=1), UnknownTenant),
            (lambda: s.set_tenant_limits("a/b", weight=1), InvalidTenant),
            (lambda: s.set_tenant_limits("t1"), InvalidLimits),
            (lambda: s.set_tenant_limits("t1", weight=0), InvalidLimits),
            (lambda: s.set_tenant_limits("t1", weight=1, burst=2.5), InvalidLimits),
            (lambda: s.set_tenant_limits("t1", rate="10"), InvalidLimits),
            (lambda: s.set_tenant_limits("t1", speed=1), InvalidLimits),
            (lambda: s.set_tenant_limits("t1", weight=2, actor=" "), ValueError),
            (lambda: s.add_tenant("t3", limits={"weight": 2}), InvalidLimits),
            (lambda: s.add_tenant("t1", limits=TenantLimits(weight=9)), TenantExists)]:
        with pytest.raises(error):
            call()
    assert (s.audit(), s.tenants()) == before

    # A removed tenant's limits go with it: added again, it has the defaults.
    s.remove_tenant("t1")
    assert "t1" not in s.tenant_limits()
    s.add_tenant("t1")
    assert s.tenant_limits()["t1"] == TenantLimits()
    if is_pg(s.location):
        assert pg_execute(s.location, "SELECT name FROM multihead.tenant_limits "
                                      "ORDER BY name") == [("default",)]


def test_a_new_tenant_never_inherits_a_leftover_limits_row(any_store):
    """A version before limits removed tenants without their limits row (the store was shared
    by both versions): a tenant added again under that name starts from the defaults."""
    s = any_store
    s.add_tenant("t0")  # the store exists from here on
    sql = ("INSERT INTO {p}tenant_limits (name, weight, rate, burst, max_queued, updated) "
           "VALUES ('t9', 7, NULL, 3, NULL, '2026-01-01')")
    if is_pg(s.location):
        pg_execute(s.location, sql.format(p="multihead."))
    else:
        with sqlite3.connect(s.root / "registry.sqlite") as conn:
            conn.execute(sql.format(p=""))
        conn.close()
    assert "t9" not in s.tenant_limits()  # not a tenant: not listed
    assert s.add_tenant("t9").limits == TenantLimits()
    assert s.tenant_limits()["t9"] == TenantLimits()
    assert s.set_tenant_limits("t9", rate=1) == TenantLimits(rate=1)


def test_a_limits_change_and_its_audit_record_commit_together(any_store, monkeypatch):
    s = any_store
    s.add_tenant("t1", limits=TenantLimits(weight=3))

    def fail(self, **record):
        raise OSError("disk full")

    monkeypatch.setattr(accounts.rows.Rows, "record", fail)
    with pytest.raises(OSError):
        s.set_tenant_limits("t1", weight=5)
    monkeypatch.undo()
    assert s.tenant_limits()["t1"] == TenantLimits(weight=3)
    assert [r.action for r in s.audit()] == ["tenant_add"]


def test_tenant_limits_are_served_from_the_snapshot(any_store, monkeypatch):
    """No backend call per lookup, and the same mapping until the limits change: the
    refresher's polls find nothing changed and read no rows."""
    s = any_store
    s.add_tenant("t1", limits=TenantLimits(rate=5))
    assert s.tenant_limits()["t1"] == TenantLimits(rate=5)
    if is_pg(s.location):
        listening(s)
    s.change_poll_s = 0.01
    reads = BackendReads(s, monkeypatch)
    table = s.tenant_limits()
    for _ in range(200):
        assert s.tenant_limits() is table
    assert reads.by() == []
    wait_until(lambda: sum(label == "data_version" for _, label in reads.calls) >= 3, 10,
               what="the refresher polling")
    assert s.tenant_limits() is table and table["t1"] == TenantLimits(rate=5)
    assert [label for _, label in reads.calls if label != "data_version"] == []


def test_a_limits_change_through_one_store_is_served_by_another_within_a_second(location):
    """Two stores on one location (SQLite: two registry connections, the change polled;
    PostgreSQL: two listeners, the change arriving by NOTIFY)."""
    with open_store(location) as writer, open_store(location) as reader:
        writer.add_tenant("t1")
        assert reader.tenant_limits()["t1"] == TenantLimits()
        if is_pg(location):
            listening(reader)
        writer.set_tenant_limits("t1", weight=4, rate=50)
        writer.set_tenant_limits("default", burst=7)
        want = {"default": TenantLimits(burst=7), "t1": TenantLimits(weight=4, rate=50)}
        wait_until(lambda: reader.tenant_limits() == want, 1.0 + 2.0,
                   what="the reader serving the new limits")


# -- bots and their owners ----------------------------------------------------------------------


def test_a_bot_belongs_to_the_tenant_that_registered_it(any_store):
    s = any_store
    s.add_tenant("t1")
    s.add_tenant("t2")
    assert s.register("acme", *random_head(3, seed=1), tenant="t1", actor="key:k1") == 1
    assert s.register("acme", *random_head(3, seed=2), tenant="t1") == 2  # its owner: fine
    s.register("beta", *random_head(3, seed=3), tenant="t2")
    s.register("gamma", *random_head(3, seed=4))
    assert [(i.bot_id, i.tenant) for i in s.list()] == [
        ("acme", "t1"), ("beta", "t2"), ("gamma", "default")]
    assert [i.bot_id for i in s.list(tenant="t1")] == ["acme"]
    assert [i.bot_id for i in s.list("default")] == ["gamma"] and s.list("t3") == []
    assert s.info("acme").to_dict()["tenant"] == "t1"
    assert (s.owner("acme"), s.owner("beta"), s.owner("gamma")) == ("t1", "t2", "default")
    with pytest.raises(UnknownBot):
        s.owner("nobody")
    with pytest.raises(InvalidTenant):
        s.list(tenant="a/b")

    # Another tenant's id is refused before anything is written, without naming its owner.
    before = (s.info("acme"), stored_entries(s.location, "acme"), s.audit())
    for tenant in ("t2", "default"):
        with pytest.raises(BotOwnedElsewhere) as exc:
            s.register("acme", *random_head(3, seed=9), tenant=tenant)
        assert "t1" not in str(exc.value) and "acme" in str(exc.value)
    with pytest.raises(UnknownTenant):
        s.register("delta", *random_head(3, seed=9), tenant="t3")
    with pytest.raises(InvalidTenant):
        s.register("delta", *random_head(3, seed=9), tenant="")
    assert (s.info("acme"), stored_entries(s.location, "acme"), s.audit()) == before
    assert not s.exists("delta") and stored_entries(s.location, "delta") == []

    assert s.rollback("acme", actor="key:k1") == 1
    s.remove("beta", actor="ops")
    s.register("beta", *random_head(3, seed=5), tenant="t1")  # a removed id is free
    assert s.owner("beta") == "t1"
    records = s.audit()
    assert [(r.actor, r.action, r.tenant, r.bot_id, r.version, r.detail) for r in records] == [
        (OPERATOR, "tenant_add", "t1", None, None, None),
        (OPERATOR, "tenant_add", "t2", None, None, None),
        ("key:k1", "register", "t1", "acme", 1, "api"),
        (OPERATOR, "replace", "t1", "acme", 2, "api"),
        (OPERATOR, "register", "t2", "beta", 1, "api"),
        (OPERATOR, "register", "default", "gamma", 1, "api"),
        ("key:k1", "rollback", "t1", "acme", 1, "from v2"),
        ("ops", "remove", "t2", "beta", 1, None),
        (OPERATOR, "register", "t1", "beta", 2, "api")]
    # The digest names the stored head: the rollback to v1 gives v1's again.
    digests = {(r.action, r.bot_id, r.version): r.digest for r in records}
    assert all(re.fullmatch(r"[0-9a-f]{64}", d) for k, d in digests.items()
               if k[0] in ("register", "replace", "rollback"))
    assert digests[("rollback", "acme", 1)] == digests[("register", "acme", 1)]
    assert len({digests[("register", "acme", 1)], digests[("replace", "acme", 2)],
                digests[("register", "beta", 1)]}) == 3
    assert [r.id for r in records] == sorted(r.id for r in records)


def test_owner_is_answered_from_the_snapshot(any_store, monkeypatch):
    s = any_store
    s.add_tenant("t1")
    s.register("acme", *random_head(3, seed=1), tenant="t1")
    assert s.owner("acme") == "t1"
    reads = BackendReads(s, monkeypatch)
    for _ in range(100):
        assert s.owner("acme") == "t1"
    assert reads.by() == []  # not even the data version: the refresher's


def test_audit_filters_and_limits(any_store):
    s = any_store
    s.add_tenant("t1")
    for seed in range(1, 5):
        s.register("acme", *random_head(3, seed=seed), tenant="t1")
    s.register("beta", *random_head(3, seed=9))
    everything = s.audit()
    assert [r.action for r in everything] == ["tenant_add", "register", "replace", "replace",
                                              "replace", "register"]
    assert [r.version for r in s.audit(tenant="t1", limit=2)] == [3, 4]  # the newest, in order
    assert [r.bot_id for r in s.audit(tenant="default")] == ["beta"]
    assert s.audit(tenant="t2") == []
    since = everything[3].at
    assert [r.id for r in s.audit(since=since)] == [r.id for r in everything if r.at >= since]
    assert s.audit(since="9999") == []
    assert everything[0].to_dict() == {
        "id": everything[0].id, "at": everything[0].at, "actor": OPERATOR,
        "action": "tenant_add", "tenant": "t1", "bot_id": None, "version": None,
        "digest": None, "detail": None}
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            s.audit(limit=bad)
    with pytest.raises(ValueError):
        s.register("x", *random_head(3, seed=1), actor="  ")


# -- keys ---------------------------------------------------------------------------------------


def test_keys_add_list_revoke(any_store, caplog):
    caplog.set_level(logging.DEBUG)
    s = any_store
    s.add_tenant("t1")
    key, token = s.add_key("t1", "infer", actor="admin")
    assert TOKEN_RE.fullmatch(token) and parse_token(token) == key.id
    assert (key.tenant, key.scope, key.prefix, key.last_used, key.revoked) == (
        "t1", "infer", f"mhk_{key.id}", None, None)
    assert key.hash == token_hash(token)
    key2, token2 = s.add_key("default", "metrics")
    assert token2 != token and key2.id != key.id
    # Listed by creation time, then id: two keys made in the same millisecond go by id.
    in_order = sorted([key, key2], key=lambda k: (k.created, k.id))
    assert s.keys() == in_order and s.keys("t1") == [key] and s.keys("t2") == []
    assert s.key_table() == {key.id: key, key2.id: key2}
    for scope in ("admin", "", None, "INFER"):
        with pytest.raises(ValueError, match="scope"):
            s.add_key("t1", scope)
    with pytest.raises(UnknownTenant):
        s.add_key("t2", "infer")
    with pytest.raises(InvalidTenant):
        s.add_key("a b", "infer")

    revoked = s.revoke_key(key.id, actor="admin")
    assert revoked.revoked and revoked.id == key.id
    assert s.key_table() == {key2.id: key2}
    assert s.revoke_key(key.id) == revoked  # idempotent: nothing written again
    assert [k.revoked is not None for k in s.keys()] == [k.id == key.id for k in in_order]
    for unknown in ("0" * 12, "", "'; DROP TABLE api_keys; --", None):
        with pytest.raises(UnknownKey):
            s.revoke_key(unknown)
    assert [(r.actor, r.action, r.tenant, r.detail) for r in s.audit()] == [
        (OPERATOR, "tenant_add", "t1", None),
        ("admin", "key_add", "t1", f"key {key.id} scope infer"),
        (OPERATOR, "key_add", "default", f"key {key2.id} scope metrics"),
        ("admin", "key_revoke", "t1", f"key {key.id} scope infer")]
    # The token is nowhere: not stored (only its hash), shown or logged.
    with open_store(s.location) as other:
        shown = " ".join([repr(other.keys()), str([k.to_dict() for k in other.keys()]),
                          str([r.to_dict() for r in other.audit()]), repr(other),
                          caplog.text])
    # The secret is the last 43 characters (token_urlsafe: it may hold "_" itself).
    for secret in (token, token2, token[-SECRET_CHARS:], token_hash(token)):
        assert secret not in shown


def test_mark_used_keeps_the_latest_use_and_never_raises(any_store, monkeypatch, caplog):
    s = any_store
    key, _ = s.add_key("default", "infer")
    key2, _ = s.add_key("default", "infer")
    s.mark_used({key.id: "2026-01-02T00:00:00.000+00:00"})
    s.mark_used({key.id: "2026-01-01T00:00:00.000+00:00", key2.id: "2026-01-03T00:00:00.000+00:00",
                 "0" * 12: "2026-01-01T00:00:00.000+00:00"})  # an unknown key: ignored
    assert {k.id: k.last_used for k in s.keys()} == {
        key.id: "2026-01-02T00:00:00.000+00:00", key2.id: "2026-01-03T00:00:00.000+00:00"}
    assert [r.action for r in s.audit()] == ["key_add", "key_add"]  # not a change to audit

    def down(used):
        raise StoreUnavailable("the database is gone")

    monkeypatch.setattr(s._backend.accounts, "mark_used", down)
    s.mark_used({key.id: "2026-01-04T00:00:00.000+00:00"})  # logged, not raised
    assert "the database is gone" in caplog.text


def test_mark_used_on_a_store_without_keys_writes_nothing(tmp_path):
    with open_store(tmp_path / "store") as s:
        s.mark_used({"0" * 12: "2026-01-01"})
    assert not (tmp_path / "store").exists()


def test_key_table_is_served_from_the_snapshot(any_store, monkeypatch):
    s = any_store
    key, _ = s.add_key("default", "infer")
    assert set(s.key_table()) == {key.id}
    reads = BackendReads(s, monkeypatch)
    table = s.key_table()
    for _ in range(200):
        assert s.key_table() is table  # nothing changed: the same mapping, never re-read
    assert set(table) == {key.id} and reads.by() == []
    with pytest.raises(TypeError):
        table["x"] = key  # read-only: no caller can change what every other caller sees


REVOKE = textwrap.dedent("""
    import sys
    from store import open_store
    with open_store(sys.argv[1]) as s:
        s.revoke_key(sys.argv[2], actor="other-process")
""")


def test_a_key_revoked_elsewhere_leaves_key_table_within_a_second(location):
    """SQLite: another process (data_version); PostgreSQL: another store, so other connections
    (change_seq and NOTIFY)."""
    with open_store(location) as s:
        keep, _ = s.add_key("default", "infer")
        gone, _ = s.add_key("default", "manage")
        assert set(s.key_table()) == {keep.id, gone.id}
        if is_pg(location):
            seq = pg_execute(location, "SELECT change_seq FROM multihead.state")[0][0]
            with open_store(location) as other:
                other.revoke_key(gone.id, actor="other-process")
            assert pg_execute(location, "SELECT change_seq FROM multihead.state")[0][0] == seq + 1
        else:
            proc = subprocess.run([sys.executable, "-c", REVOKE, location, gone.id], cwd=REPO,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
        wait_until(lambda: set(s.key_table()) == {keep.id}, 1.0 + 2.0,
                   what="the revoked key leaving key_table()")
        assert s.audit()[-1].actor == "other-process"


# -- a change and its audit record commit together ----------------------------------------------


def test_a_failed_registration_leaves_no_audit_record(any_store, monkeypatch):
    s = any_store
    s.register("acme", *random_head(3, seed=1))

    def fail(at):
        if at == "rows_added":
            raise OSError("disk full")

    monkeypatch.setattr(store_front, "_fault_hook", fail)
    with pytest.raises(OSError):
        s.register("acme", *random_head(3, seed=2))
    monkeypatch.setattr(store_front, "_fault_hook", None)
    assert s.info("acme").versions == [1]
    assert [(r.action, r.version) for r in s.audit()] == [("register", 1)]


CRASH = textwrap.dedent("""
    import os, sys
    from store import front as store_front
    from store import open_store
    from tests.support.heads import random_head
    location, step = sys.argv[1], sys.argv[2]
    store_front._fault_hook = lambda at: os._exit(17) if at == step else None
    open_store(location).register("acme", *random_head(3, seed=2), tenant="t1", actor="crash")
    os._exit(17)  # after the commit: nothing cleaned up either
""")


@pytest.mark.subprocess
# The last step before the commit and the commit itself: earlier steps write no row at all
# (tests/store/test_writers.py kills a registration at each of them).
@pytest.mark.parametrize("backend, step", [
    pytest.param("sqlite", "rows_added", id="sqlite-rows_added"),
    pytest.param("sqlite", "committed", id="sqlite-committed"),
    pytest.param("postgresql", "rows_added", id="postgresql-rows_added",
                 marks=pytest.mark.postgresql),
    pytest.param("postgresql", "committed", id="postgresql-committed",
                 marks=pytest.mark.postgresql),
])
def test_a_killed_registration_has_both_its_change_and_its_record_or_neither(
        request, tmp_path, backend, step):
    """os._exit (like a kill -9) between the steps, or right after the commit ("committed":
    no step has that name, so the process dies after register returned)."""
    location = str(tmp_path / "store") if backend == "sqlite" else request.getfixturevalue(
        "pg_url")
    with open_store(location) as s:
        s.add_tenant("t1")
        s.register("acme", *random_head(3, seed=1), tenant="t1")
    proc = subprocess.run([sys.executable, "-c", CRASH, location, step], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-2000:]
    with open_store(location) as s:
        committed = step == "committed"
        assert s.info("acme").versions == ([1, 2] if committed else [1])
        assert [(r.actor, r.action, r.version) for r in s.audit(tenant="t1")][2:] == (
            [("crash", "replace", 2)] if committed else [])
        assert s.owner("acme") == "t1"


# -- every key and tenant write is a change other stores see ----------------------------------


def test_tenant_and_key_writes_change_the_data_version(location):
    with open_store(location) as reader, open_store(location) as writer:
        writer.add_tenant("t0")  # the store exists from here on
        reader.key_table()
        if is_pg(location):
            listening(reader)
        for write in (lambda: writer.add_tenant("t1"),
                      lambda: writer.set_tenant_limits("t1", weight=2),
                      lambda: writer.set_tenant_limits("default", rate=None),
                      lambda: writer.add_key("t1", "infer"),
                      lambda: writer.revoke_key(writer.keys("t1")[0].id),
                      lambda: writer.remove_tenant("t1")):
            before = reader._backend.data_version()
            write()
            wait_until(lambda b=before: reader._backend.data_version() != b, 1.0 + 2.0,
                       what="the data version changing")


def test_the_secret_part_of_a_token_is_random_per_key(store):
    made = [store.add_key("default", "infer") for _ in range(3)]
    assert len({t[-SECRET_CHARS:] for _, t in made}) == 3
    # Matched by id: keys are listed by (created, id), and keys made in the same millisecond
    # come in id order, not in the order they were made.
    listed = {k.id: k for k in store.keys()}
    assert sorted(listed) == sorted(k.id for k, _ in made)
    assert all(secrets.compare_digest(token_hash(t), listed[k.id].hash) for k, t in made)
    assert len(store.key_table()) == 3
