"""`multihead register|train|bots` through `cli.main`, in process (no trunk needed)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli.main import main
from store import open_store
from tests.support.heads import random_head, save_checkpoint, tree_digest, write_labels

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, expect", [
    (["register"], "--from-slim-checkpoint"),
    (["train"], "held-out accuracy"),
    (["bots"], "rollback"),
    (["bots", "list"], "--store"),
    (["bots", "show"], "history"),
    (["bots", "remove"], "delete every version"),
    (["bots", "rollback"], "--to"),
    (["bots", "promote"], "stays stored"),
    (["bots", "discard"], "goes on alone"),
    (["register"], "--candidate MODE"),
    (["train"], "--candidate MODE"),
])
def test_every_subcommand_has_help(argv, expect, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    assert expect in " ".join(capsys.readouterr().out.split())


def test_building_the_cli_imports_no_tensorflow_aiohttp_or_matplotlib():
    code = ("import sys\n"
            "from cli.main import build_parser\n"
            "build_parser()\n"
            "print(sorted(m for m in ('tensorflow', 'aiohttp', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.fixture
def files(tmp_path):
    """A user's head checkpoint (custom tensor names) and its labels file."""
    w, b, _ = random_head(3, seed=11)
    nan_w = w.copy()
    nan_w[0, 0] = np.nan
    return {
        "ckpt": save_checkpoint(tmp_path / "user" / "head.ckpt",
                                {"dense/kernel": w, "dense/bias": b}),
        "plain": save_checkpoint(tmp_path / "user" / "plain.ckpt", {"weights": w, "biases": b}),
        "nan": save_checkpoint(tmp_path / "user" / "nan.ckpt", {"weights": nan_w, "biases": b}),
        "labels": write_labels(tmp_path / "labels.txt", ["cat", "dog", "bird"]),
        "labels2": write_labels(tmp_path / "labels2.txt", ["cat", "dog"]),
        "weights": w,
    }


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_admin_flow(location, files, capsys):
    """The whole admin flow, on a directory store and on a PostgreSQL one (`--store URL`)."""
    store = location
    code, out, _ = run(capsys, "register", "acme", "--weights-checkpoint", files["ckpt"],
                       "--labels", files["labels"], "--weights-name", "dense/kernel",
                       "--biases-name", "dense/bias", "--store", store)
    assert code == 0 and "registered bot 'acme' version 1 (3 classes)" in out
    code, out, _ = run(capsys, "register", "acme", "--weights-checkpoint", files["plain"],
                       "--labels", files["labels"], "--store", store)
    assert code == 0 and "version 2" in out

    code, out, _ = run(capsys, "bots", "list", "--store", store)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:5] == ["BOT", "TENANT", "VERSION", "CLASSES",
                                                   "VERSIONS"]
    assert lines[1].split()[:5] == ["acme", "default", "2", "3", "1,2"]
    code, out, _ = run(capsys, "bots", "list", "--json", "--store", store)
    assert [(b["bot_id"], b["version"], b["labels"]) for b in json.loads(out)] == [
        ("acme", 2, ["cat", "dog", "bird"])]

    code, out, _ = run(capsys, "bots", "show", "acme", "--store", store)
    assert code == 0 and "labels:    cat, dog, bird" in out and "versions:  1, 2" in out
    code, out, _ = run(capsys, "bots", "rollback", "acme", "--store", store)
    assert code == 0 and "active version 2 -> 1" in out
    code, out, _ = run(capsys, "bots", "rollback", "acme", "--to", "2", "--store", store)
    assert code == 0 and "active version 1 -> 2" in out
    shown = json.loads(run(capsys, "bots", "show", "acme", "--json", "--store", store)[1])
    assert [h["action"] for h in shown["history"]] == ["register", "register", "rollback",
                                                        "rollback"]
    with open_store(store) as s:
        np.testing.assert_array_equal(s.get("acme").weights, files["weights"])

    code, out, _ = run(capsys, "bots", "remove", "acme", "--store", store)
    assert code == 0 and "removed bot 'acme' (versions 1, 2)" in out
    code, out, _ = run(capsys, "bots", "list", "--store", store)
    assert "no bots registered" in out


def test_bots_show_prints_labels_escaped(location, files, capsys):
    """A label stored before the label rules (written under the store's validation, as an old
    store holds it) cannot move the operator's cursor or colour the terminal: `bots show`
    prints it escaped and cut; `register` refuses such a label, naming its line."""
    from store.front import _step

    bad = "\x1b[2J\x1b[31mred\x07" + "z" * 1000
    with open_store(location) as s:
        s._backend.bots.add_version("old", files["weights"], np.zeros(3, np.float32),
                                    ("cat", bad, "bird"), "old\x1b[0m store", _step)
    code, out, _ = run(capsys, "bots", "show", "old", "--store", location)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert "labels:    cat, \\x1b[2J\\x1b[31mred\\x07zzz" in out and "z" * 1000 not in out
    assert "source:    old\\x1b[0m store" in out
    code, out, _ = run(capsys, "bots", "list", "--store", location)
    assert code == 0 and "\x1b" not in out

    labels = write_labels(Path(files["labels"]).parent / "bad.txt", ["cat", "red\x1b[31m", "x"])
    code, _, err = run(capsys, "register", "new", "--weights-checkpoint", files["plain"],
                       "--labels", labels, "--store", location)
    assert code != 0 and "label 1 (line 2 of labels file" in err and "U+001B" in err
    assert "\x1b" not in err


def test_candidate_flow(location, files, capsys):
    """A canary, promoted, then rolled back; a shadow, discarded: on both backends."""
    store = location
    assert run(capsys, "register", "acme", "--weights-checkpoint", files["plain"], "--labels",
               files["labels"], "--store", store)[0] == 0
    code, out, _ = run(capsys, "register", "acme", "--weights-checkpoint", files["ckpt"],
                       "--labels", files["labels"], "--weights-name", "dense/kernel",
                       "--biases-name", "dense/bias", "--candidate", "canary:30",
                       "--store", store)
    assert code == 0 and out.strip().endswith(
        "as its candidate (canary:30); version 1 stays active")
    assert "registered bot 'acme' version 2 (3 classes)" in out
    code, out, _ = run(capsys, "bots", "list", "--store", store)
    header, row = out.splitlines()
    assert header.split()[5] == "CANDIDATE" and row.split()[4:7] == ["1", "v2", "canary:30"]
    listed = json.loads(run(capsys, "bots", "list", "--json", "--store", store)[1])
    assert (listed[0]["versions"], listed[0]["candidate"]["version"],
            listed[0]["candidate"]["percent"]) == ([1], 2, 30.0)
    out = run(capsys, "bots", "show", "acme", "--store", store)[1]
    assert "candidate: v2 canary:30 (3 classes" in out and "versions:  1\n" in out
    code, out, _ = run(capsys, "bots", "promote", "acme", "--store", store)
    assert code == 0 and "bot 'acme': active version 1 -> 2 (its candidate)" in out
    out = run(capsys, "bots", "show", "acme", "--store", store)[1]
    assert "candidate: none" in out and "v1 -> v2 (the candidate)" in out
    assert run(capsys, "bots", "rollback", "acme", "--store", store)[1].strip() == \
        "bot 'acme': active version 2 -> 1"

    code, out, _ = run(capsys, "register", "acme", "--weights-checkpoint", files["plain"],
                       "--labels", files["labels"], "--candidate", "shadow", "--store", store)
    assert code == 0 and "version 3 (3 classes)" in out and "(shadow); version 1" in out
    code, out, _ = run(capsys, "bots", "discard", "acme", "--store", store)
    assert code == 0 and out.strip() == ("bot 'acme': candidate version 3 deleted; version 1 "
                                         "stays active")
    shown = json.loads(run(capsys, "bots", "show", "acme", "--json", "--store", store)[1])
    assert [h["action"] for h in shown["history"]] == [
        "register", "candidate", "promote", "rollback", "candidate", "discard"]
    assert (shown["versions"], shown["candidate"]) == ([1, 2], None)
    with open_store(store) as s:
        assert [r.action for r in s.audit()][-5:] == [
            "candidate_add", "candidate_promote", "rollback", "candidate_add",
            "candidate_discard"]


def test_store_from_environment(tmp_path, files, capsys, monkeypatch):
    monkeypatch.setenv("MULTIHEAD_STORE", str(tmp_path / "env-store"))
    assert run(capsys, "register", "acme", "--weights-checkpoint", files["plain"],
               "--labels", files["labels"])[0] == 0
    assert (tmp_path / "env-store" / "registry.sqlite").exists()
    assert "acme" in run(capsys, "bots", "list")[1]


@pytest.fixture
def populated(tmp_path, files, capsys):
    store = tmp_path / "store"
    for _ in range(2):
        assert run(capsys, "register", "acme", "--weights-checkpoint", files["plain"],
                   "--labels", files["labels"], "--store", store)[0] == 0
    return store


def _images(tmp_path, layout):
    root = tmp_path / "images"
    for label, n in layout.items():
        (root / label).mkdir(parents=True)
        for i in range(n):
            (root / label / f"{i}.png").write_bytes(b"not read before the refusal")
    return root


REFUSALS = {
    "bad id": (["register", "../acme", "--weights-checkpoint", "{plain}", "--labels", "{labels}"],
               "invalid bot id '../acme'"),
    "label count": (["register", "acme", "--weights-checkpoint", "{plain}", "--labels",
                     "{labels2}"], "2 labels given for a head with 3 classes"),
    "missing labels": (["register", "acme", "--weights-checkpoint", "{plain}", "--labels",
                        "{tmp}/none.txt"], "labels file '{tmp}/none.txt' not found"),
    "missing checkpoint": (["register", "acme", "--weights-checkpoint", "{tmp}/none.ckpt",
                            "--labels", "{labels}"], "no TF checkpoint at '{tmp}/none.ckpt'"),
    "missing tensor": (["register", "acme", "--weights-checkpoint", "{ckpt}", "--labels",
                        "{labels}"], "has no tensor 'weights'"),
    "NaN": (["register", "acme", "--weights-checkpoint", "{nan}", "--labels", "{labels}"],
            "non-finite"),
    "slim without serving trunk": (["register", "acme", "--from-slim-checkpoint", "{plain}",
                                    "--labels", "{labels}"], "no serving trunk checkpoint"),
    "train missing dir": (["train", "acme", "--images", "{tmp}/nowhere"],
                          "image folder '{tmp}/nowhere' does not exist"),
    "train one label": (["train", "acme", "--images", "{one_label}"],
                        "1 label sub-directories"),
    "train empty label": (["train", "acme", "--images", "{empty_label}"],
                          "label 'dog' has no .jpg/.jpeg/.png image"),
    "show unknown": (["bots", "show", "gamma"], "unknown bot 'gamma'"),
    "remove unknown": (["bots", "remove", "gamma"], "unknown bot 'gamma'"),
    "rollback unknown": (["bots", "rollback", "gamma"], "unknown bot 'gamma'"),
    "rollback missing version": (["bots", "rollback", "acme", "--to", "9"],
                                 "bot 'acme' has no version 9 (versions on disk: 1, 2)"),
    "remove bad id": (["bots", "remove", "a/b"], "invalid bot id 'a/b'"),
    **{f"candidate {mode}": (["register", "acme", "--weights-checkpoint", "{tmp}/none.ckpt",
                              "--labels", "{tmp}/none.txt", "--candidate", mode],
                             f"invalid candidate mode '{mode}': use shadow, or canary:P with "
                             "0 < P < 100") for mode in ("canary:0", "canary:100", "canary:x",
                                                         "canary", "green")},
    "train candidate": (["train", "acme", "--images", "{tmp}/nowhere", "--candidate",
                         "canary:0"], "invalid candidate mode 'canary:0'"),
    "candidate of an unknown bot": (["register", "gamma", "--weights-checkpoint", "{plain}",
                                     "--labels", "{labels}", "--candidate", "shadow"],
                                    "unknown bot 'gamma'"),
    "promote without a candidate": (["bots", "promote", "acme"],
                                    "bot 'acme' has no candidate (register one with "
                                    "--candidate shadow or --candidate canary:P)"),
    "discard without a candidate": (["bots", "discard", "acme"], "bot 'acme' has no candidate"),
    "promote unknown": (["bots", "promote", "gamma"], "unknown bot 'gamma'"),
    "discard unknown": (["bots", "discard", "gamma"], "unknown bot 'gamma'"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusal_is_one_line_exit_2_and_changes_nothing(case, populated, files, tmp_path,
                                                        capsys):
    argv, message = REFUSALS[case]
    values = {**files, "tmp": tmp_path,
              "one_label": _images(tmp_path / "one", {"cat": 2}),
              "empty_label": _images(tmp_path / "empty", {"cat": 2, "dog": 0})}
    argv = [a.format(**values) for a in argv] + ["--store", str(populated)]
    before = tree_digest(populated)
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"multihead {argv[0]}: error: "), err
    assert message.format(**values) in err
    assert tree_digest(populated) == before


@pytest.mark.parametrize("store, names", [("s3://bucket/heads", "'s3://'"),
                                          ("postgresql:/db", "malformed PostgreSQL store URL")])
def test_an_unsupported_store_location_is_one_line_exit_2_and_creates_nothing(
        store, names, tmp_path, files, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a folder 's3:' or 'postgresql:' would appear
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv in (["bots", "list"], ["register", "acme", "--weights-checkpoint", files["plain"],
                                    "--labels", files["labels"]]):
        code, out, err = run(capsys, *argv, "--store", store)
        assert code == 2 and err.count("\n") == 1 and names in err, err
        assert "postgresql://" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_refusal_on_a_missing_store_creates_nothing(tmp_path, files, capsys):
    store = tmp_path / "new-store"
    assert run(capsys, "register", "acme", "--weights-checkpoint", files["plain"],
               "--labels", files["labels2"], "--store", store)[0] == 2
    assert run(capsys, "bots", "remove", "acme", "--store", store)[0] == 2
    assert run(capsys, "bots", "list", "--store", store)[0] == 0
    assert not store.exists()


@pytest.mark.parametrize("argv", [
    ["register", "acme", "--from-slim-checkpoint", "x", "--labels", "l", "--weights-name", "w"],
    ["register", "acme", "--weights-checkpoint", "x", "--labels", "l", "--force"],
    ["register", "acme", "--weights-checkpoint", "x", "--from-slim-checkpoint", "y",
     "--labels", "l"],
    ["train", "acme", "--images", "d", "--val-fraction", "1.5"],
])
def test_misused_flags_are_usage_errors(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--store", str(tmp_path / "s")])
    assert exc.value.code == 2 and "usage:" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
