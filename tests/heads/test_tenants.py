"""Tenants, API keys and the audit log of a store, on both backends (`any_store`/`location`):
what each method does and refuses, that every change and its audit record commit together (also
under a kill -9), that a key revoked elsewhere leaves `key_table()` within a second with no store
round trip per call, and that a token is never kept, shown or logged. Tokens: their format, and
`parse_token` on anything (hypothesis). A store written before tenants: test_schema.py."""
from __future__ import annotations

import hashlib
import logging
import re
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import heads.store
from heads import (
    BotOwnedElsewhere,
    InvalidTenant,
    StoreUnavailable,
    TenantExists,
    TenantNotEmpty,
    UnknownBot,
    UnknownKey,
    UnknownTenant,
    open_store,
)
from heads.tenants import (
    OPERATOR,
    ApiKey,
    new_token,
    parse_token,
    token_hash,
    validate_tenant,
)
from tests.heads.helpers import is_pg, listening, pg_execute, random_head, stored_entries
from tests.support.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
TOKEN_RE = re.compile(r"mhk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")


def audit_rows(store, **kw) -> list[tuple]:
    return [(r.actor, r.action, r.tenant, r.bot_id, r.version) for r in store.audit(**kw)]


# -- tokens (pure) ------------------------------------------------------------------------------


def test_a_new_token_names_its_key_and_is_random():
    key_id, token = new_token()
    assert re.fullmatch(r"[0-9a-f]{12}", key_id) and TOKEN_RE.fullmatch(token)
    assert token.startswith(f"mhk_{key_id}_") and parse_token(token) == key_id
    assert token_hash(token) == hashlib.sha256(token.encode()).hexdigest()
    assert len({new_token()[1] for _ in range(200)}) == 200


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
        assert token.split("_")[-1] not in shown
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
                                                   "bots": 0}]
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


def test_owner_is_answered_from_memory(any_store, monkeypatch):
    s = any_store
    s.add_tenant("t1")
    s.register("acme", *random_head(3, seed=1), tenant="t1")
    assert s.owner("acme") == "t1"

    def no_round_trip(*a, **kw):
        raise AssertionError("a store round trip")

    for name in ("active_map", "snapshot", "keys"):
        monkeypatch.setattr(s._backend, name, no_round_trip)
    for _ in range(100):  # over several change_poll_s periods for none: data_version only
        assert s.owner("acme") == "t1"


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
    assert s.keys() == [key, key2] and s.keys("t1") == [key] and s.keys("t2") == []
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
    assert [k.revoked is not None for k in s.keys()] == [True, False]
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
    for secret in (token, token2, token.split("_")[-1], token_hash(token)):
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

    monkeypatch.setattr(s._backend, "mark_used", down)
    s.mark_used({key.id: "2026-01-04T00:00:00.000+00:00"})  # logged, not raised
    assert "the database is gone" in caplog.text


def test_mark_used_on_a_store_without_keys_writes_nothing(tmp_path):
    with open_store(tmp_path / "store") as s:
        s.mark_used({"0" * 12: "2026-01-01"})
    assert not (tmp_path / "store").exists()


def test_key_table_is_served_from_memory(any_store, monkeypatch):
    s = any_store
    key, _ = s.add_key("default", "infer")
    assert set(s.key_table()) == {key.id}
    calls = []
    real = s._backend.keys
    monkeypatch.setattr(s._backend, "keys", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for _ in range(200):
        assert set(s.key_table()) == {key.id}
    assert calls == []  # nothing changed: never re-read


REVOKE = textwrap.dedent("""
    import sys
    from heads import open_store
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

    monkeypatch.setattr(heads.store, "_fault_hook", fail)
    with pytest.raises(OSError):
        s.register("acme", *random_head(3, seed=2))
    monkeypatch.setattr(heads.store, "_fault_hook", None)
    assert s.info("acme").versions == [1]
    assert [(r.action, r.version) for r in s.audit()] == [("register", 1)]


CRASH = textwrap.dedent("""
    import os, sys
    import heads.store
    from heads import open_store
    from tests.heads.helpers import random_head
    location, step = sys.argv[1], sys.argv[2]
    heads.store._fault_hook = lambda at: os._exit(17) if at == step else None
    open_store(location).register("acme", *random_head(3, seed=2), tenant="t1", actor="crash")
    os._exit(17)  # after the commit: nothing cleaned up either
""")


@pytest.mark.subprocess
# The last step before the commit and the commit itself: earlier steps write no row at all
# (tests/heads/test_writers.py kills a registration at each of them).
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
                      lambda: writer.add_key("t1", "infer"),
                      lambda: writer.revoke_key(writer.keys("t1")[0].id),
                      lambda: writer.remove_tenant("t1")):
            before = reader._backend.data_version()
            write()
            wait_until(lambda b=before: reader._backend.data_version() != b, 1.0 + 2.0,
                       what="the data version changing")


def test_the_secret_part_of_a_token_is_random_per_key(store):
    tokens = [store.add_key("default", "infer")[1] for _ in range(3)]
    assert len({t.split("_")[-1] for t in tokens}) == 3
    assert all(secrets.compare_digest(token_hash(t), k.hash)
               for t, k in zip(tokens, store.keys(), strict=True))
    assert len(store.key_table()) == 3
