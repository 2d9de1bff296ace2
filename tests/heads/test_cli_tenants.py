"""`multihead tenants|keys|audit` and `register --tenant` through `service.cli.main`, in
process, on a real directory store (no trunk needed)."""
from __future__ import annotations

import json

import pytest

from heads import open_store
from heads.tenants import parse_token, token_hash
from service.cli.main import main
from tests.heads.helpers import random_head, save_checkpoint, write_labels


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, expect", [
    (["tenants"], "default"), (["tenants", "remove"], "--force"),
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
    assert code == 2 and "taken by another tenant" in err and "acme" not in err
