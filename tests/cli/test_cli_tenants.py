"""`multihead tenants|keys|audit` and `register --tenant` through `cli.main`, in
process, on a real directory store (no trunk needed); the limits flags of `tenants add|set`
also on any text (hypothesis)."""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounts.tenants import (
    LIMIT_NAMES,
    LIMITS,
    TenantLimits,
    parse_token,
    token_hash,
    validate_limit,
)
from cli.main import main
from store import open_store
from tests.support.heads import random_head, save_checkpoint, tree_digest, write_labels

NO_LIMITS = dict.fromkeys(LIMIT_NAMES)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_captured(*argv: str) -> tuple[int, str, str]:
    """`main(argv)` with its output captured (no pytest fixture: hypothesis calls it many
    times); a usage error's SystemExit gives its code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, expect", [
    (["tenants"], "default"), (["tenants", "remove"], "--force"),
    (["tenants", "add"], "--max-queued ROWS"), (["tenants", "set"], "back to the server's"),
    (["keys"], "revoked"), (["keys", "add"], "last line"), (["audit"], "--since"),
])
def test_every_subcommand_has_help(argv, expect, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0 and expect in " ".join(capsys.readouterr().out.split())


def test_tenants_keys_and_audit_from_the_command_line(tmp_path, capsys):
    store = str(tmp_path / "store")
    assert run(capsys, "tenants", "add", "acme", "--store", store)[0] == 0
    weights, biases, labels = random_head(3, seed=1)
    prefix = save_checkpoint(tmp_path / "head" / "head", {"weights": weights, "biases": biases})
    code, out, _ = run(capsys, "register", "acme-bot", "--tenant", "acme", "--store", store,
                       "--weights-checkpoint", prefix,
                       "--labels", write_labels(tmp_path / "labels.txt", labels))
    assert code == 0, out

    code, out, _ = run(capsys, "keys", "add", "--tenant", "acme", "--scope", "manage",
                       "--store", store)
    token = out.splitlines()[-1]
    key_id = parse_token(token)
    assert code == 0 and key_id is not None and key_id in out.splitlines()[0]
    # Only its hash is kept: the secret is in no file of the store.
    secret = token.encode()
    assert not any(secret in p.read_bytes() for p in (tmp_path / "store").rglob("*")
                   if p.is_file())
    with open_store(store) as s:
        assert s.key_table()[key_id].hash == token_hash(token)

    code, out, _ = run(capsys, "keys", "list", "--tenant", "acme", "--json", "--store", store)
    (listed,) = json.loads(out)
    assert (listed["id"], listed["scope"], listed["revoked"]) == (key_id, "manage", None)
    assert token not in out and "hash" not in listed

    code, out, _ = run(capsys, "tenants", "list", "--json", "--store", store)
    assert {t["name"]: t["bots"] for t in json.loads(out)} == {"acme": 1, "default": 0}
    code, out, _ = run(capsys, "tenants", "list", "--store", store)  # `default` has no date
    assert code == 0 and [line.split()[:2] for line in out.splitlines()] == [
        ["TENANT", "BOTS"], ["acme", "1"], ["default", "0"]]
    code, out, _ = run(capsys, "keys", "list", "--store", store)
    assert code == 0 and out.splitlines()[1].split()[:4] == [key_id, f"mhk_{key_id}", "acme",
                                                             "manage"]
    code, _, err = run(capsys, "tenants", "remove", "acme", "--store", store)
    assert code == 2 and "acme" in err  # it owns a bot
    assert run(capsys, "keys", "revoke", key_id, "--store", store)[0] == 0
    with open_store(store) as s:
        assert key_id not in s.key_table()
    assert run(capsys, "tenants", "remove", "acme", "--force", "--store", store)[0] == 0

    code, out, _ = run(capsys, "audit", "--json", "--store", store)
    actions = [(r["action"], r["tenant"], r["bot_id"]) for r in json.loads(out)]
    assert actions[:3] == [("tenant_add", "acme", None), ("register", "acme", "acme-bot"),
                           ("key_add", "acme", None)]
    assert ("key_revoke", "acme", None) in actions and ("remove", "acme", "acme-bot") in actions
    assert actions[-1] == ("tenant_remove", "acme", None)
    assert all(r["actor"] == "operator" for r in json.loads(out))
    code, out, _ = run(capsys, "audit", "--tenant", "default", "--store", store)
    assert code == 0 and "acme" not in out


def test_registering_an_id_another_tenant_owns_is_refused(tmp_path, capsys):
    store = str(tmp_path / "store")
    for tenant in ("acme", "globex"):
        assert run(capsys, "tenants", "add", tenant, "--store", store)[0] == 0
    weights, biases, labels = random_head(3, seed=1)
    prefix = save_checkpoint(tmp_path / "head" / "head", {"weights": weights, "biases": biases})
    labels_file = write_labels(tmp_path / "labels.txt", labels)
    argv = ["register", "shared", "--store", store, "--weights-checkpoint", prefix,
            "--labels", labels_file, "--tenant"]
    assert run(capsys, *argv, "acme")[0] == 0
    code, _, err = run(capsys, *argv, "globex")
    assert code == 2 and "is taken" in err and "acme" not in err and "tenant" not in err


# -- limits -------------------------------------------------------------------------------------


def test_tenant_limits_from_the_command_line(tmp_path, capsys):
    store = str(tmp_path / "store")
    code, out, _ = run(capsys, "tenants", "add", "acme", "--weight", "2", "--rate", "12.5",
                       "--store", store)
    assert code == 0 and out == "added tenant 'acme' (weight=2 rate=12.5)\n"
    code, out, _ = run(capsys, "tenants", "set", "acme", "--burst", "40", "--rate", "default",
                       "--store", store)
    assert code == 0 and out == ("limits of tenant 'acme': weight=2 rate=default burst=40 "
                                 "max_queued=default max_bots=default max_versions=default "
                                 "max_head_bytes=default registrations_per_minute=default "
                                 "deadline_ms=default\n")
    assert run(capsys, "tenants", "set", "default", "--max-queued=1e3", "--weight", "0.5",
               "--store", store)[0] == 0
    with open_store(store) as s:
        assert s.tenant_limits() == {"acme": TenantLimits(weight=2, burst=40),
                                     "default": TenantLimits(weight=0.5, max_queued=1000)}
        assert [(r.action, r.tenant, r.detail) for r in s.audit()] == [
            ("tenant_add", "acme", "weight=2 rate=12.5"),
            ("tenant_set", "acme", "rate=default burst=40"),
            ("tenant_set", "default", "weight=0.5 max_queued=1000")]

    code, out, _ = run(capsys, "tenants", "list", "--store", store)
    assert code == 0 and [line.split() for line in out.splitlines()][:3] == [
        ["TENANT", "BOTS", "WEIGHT", "RATE", "BURST", "MAX_QUEUED", "MAX_BOTS", "MAX_VERSIONS",
         "MAX_HEAD_BYTES", "REG_PER_MIN", "DEADLINE_MS", "CREATED"],
        ["acme", "0", "2", "default", "40", *["default"] * 6, out.split()[23]],
        ["default", "0", "0.5", "default", "default", "1000", *["default"] * 5, "-"]]
    code, out, _ = run(capsys, "tenants", "list", "--json", "--store", store)
    assert {t["name"]: t["limits"] for t in json.loads(out)} == {
        "acme": {**NO_LIMITS, "weight": 2.0, "burst": 40},
        "default": {**NO_LIMITS, "weight": 0.5, "max_queued": 1000}}
    code, out, _ = run(capsys, "audit", "--store", store)
    assert code == 0 and out.count("tenant_set") == 2


@pytest.mark.parametrize("argv, message", [
    (["set", "acme", "--weight", "0"], "argument --weight: weight must be a number > 0 and "
                                       "<= 1000, got 0"),
    (["set", "acme", "--weight", "-1"], "got -1"),
    (["set", "acme", "--weight=1001"], "got 1001"),
    (["set", "acme", "--rate", "nan"], "argument --rate: rate must be a number > 0 and <= "
                                       "1000000, got nan"),
    (["set", "acme", "--rate=inf"], "got inf"), (["set", "acme", "--rate=-inf"], "got -inf"),
    (["set", "acme", "--rate", "1e999"], "got inf"),
    (["set", "acme", "--rate", "fast"], "rate must be a number > 0 and <= 1000000 or "
                                        "'default', got 'fast'"),
    (["set", "acme", "--rate", "true"], "got 'true'"), (["set", "acme", "--rate", ""], "got ''"),
    (["set", "acme", "--burst", "2.5"], "argument --burst: burst must be a whole number from "
                                        "1 to 1000000, got 2.5"),
    (["set", "acme", "--max-queued", "1000001"], "argument --max-queued: max_queued must be"),
    (["add", "globex", "--burst", "0"], "got 0"),
    (["set", "acme"], "nothing to set: give one or more of --weight, --rate, --burst, "
                      "--max-queued"),
    (["set", "nobody", "--weight", "1"], "unknown tenant 'nobody'"),
    (["set", "a/b", "--weight", "1"], "invalid tenant name 'a/b'"),
])
def test_a_refused_limit_is_one_line_exit_2_and_changes_nothing(argv, message, tmp_path,
                                                                 capsys):
    store = str(tmp_path / "store")
    assert run(capsys, "tenants", "add", "acme", "--weight", "3", "--store", store)[0] == 0
    before = tree_digest(store)
    code, out, err = run_captured("tenants", *argv, "--store", store)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("multihead tenants") and message in err, err
    assert tree_digest(store) == before


def _limit_text():
    """Texts a user may type for a limit: numbers in every spelling, words, anything."""
    numbers = st.one_of(st.integers(-10, 2 * 10**6), st.integers(), st.floats(),
                        st.floats(-1, 2e6))
    return st.one_of(
        numbers.map(str), numbers.map(repr), st.floats().map(lambda f: f"{f:e}"),
        st.sampled_from(["default", "DEFAULT", " default ", "nan", "NaN", "-nan", "inf",
                         "Infinity", "-inf", "1e999", "-0", "0.0", "1_000", "0x10", "1e3",
                         "True", "", " ", "1,5", "٣", "5\n"]),
        st.text(max_size=12))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(LIMITS)), _limit_text())
def test_any_limit_text_is_stored_or_refused_in_one_line_naming_the_flag(tmp_path_factory,
                                                                        name, text):
    store = str(tmp_path_factory.mktemp("cli-limits") / "store")
    flag = "--" + name.replace("_", "-")
    code, out, err = run_captured("tenants", "add", "acme", f"{flag}={text}", "--store", store)
    if text.strip().lower() == "default":
        want = None
    else:
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = None
        try:
            want = validate_limit(name, number) if number is not None else math.nan
        except ValueError:
            want = math.nan  # refused
    if want is not None and math.isnan(want):
        assert code == 2 and out == "" and err.count("\n") == 1, (code, err)
        assert err.startswith(f"multihead tenants add: error: argument {flag}: {name} "
                              "must be "), err
        return
    assert code == 0, err
    with open_store(store) as s:
        assert getattr(s.tenant_limits()["acme"], name) == want
