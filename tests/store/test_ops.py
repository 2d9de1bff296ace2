"""`store.ops`: copy, backup, restore and check on real stores of both backends (a directory
and the session's throw-away PostgreSQL), in process. The end-to-end test with real servers on
each copy, and the kill -9 tests of the commands, are tests/cli/test_store_ops.py."""
from __future__ import annotations

import io
import json
import os
import sqlite3
import tarfile

import pytest

from heads.errors import HeadLoadError
from store import open_store
from store.ops import copy as ops_copy
from store.ops.archive import backup, restore
from store.ops.check import check_store
from store.ops.copy import StoreOpRefused, copy_store, open_snapshot
from tests.support.builders import random_head
from tests.support.heads import is_pg, pg_execute


def build(location) -> dict[str, str]:
    """Two tenants (one with limits), keys of every scope (one revoked, one used), bots with
    several versions, a rollback, a candidate, a removed bot. Returns {key id: token}."""
    tokens = {}
    with open_store(location) as s:
        s.add_tenant("acme")
        s.add_tenant("globex")
        s.set_tenant_limits("acme", weight=2.0, max_versions=5, deadline_ms=150.0)
        s.register("a1", *random_head(3, seed=1), tenant="acme")
        s.register("a1", *random_head(3, seed=2), tenant="acme")
        s.rollback("a1")
        s.register("a2", *random_head(4, seed=3), tenant="acme")
        s.register("a2", *random_head(4, seed=4), tenant="acme", candidate="canary:25")
        s.register("g1", *random_head(2, seed=5), tenant="globex")
        s.register("gone", *random_head(2, seed=6))
        s.remove("gone")
        s.register("d1", *random_head(5, seed=7))
        for tenant in ("acme", "globex"):
            for scope in ("infer", "manage", "metrics"):
                key, token = s.add_key(tenant, scope)
                tokens[key.id] = token
        s.revoke_key(next(k.id for k in s.keys("globex") if k.scope == "manage"))
        s.mark_used({next(iter(tokens)): "2026-01-02T03:04:05.000+00:00"})
    return tokens


def rows_of(location) -> dict:
    with open_snapshot(location) as snap:
        return snap.rows


def heads_of(location) -> dict:
    out = {}
    with open_snapshot(location) as snap:
        for r in snap.rows["versions"]:
            h = snap.head(r["bot_id"], r["version"])
            out[(h.bot_id, h.version)] = (h.labels, h.weights.tobytes(), h.biases.tobytes())
    return out


def test_a_copy_there_and_back_keeps_every_row_and_head(location, tmp_path):
    source = str(tmp_path / "source")
    build(source)
    back = str(tmp_path / "back")
    there = copy_store(source, location)
    assert there.counts["bots"] == 4 and there.counts["api_keys"] == 6
    assert there.counts["candidates"] == 1 and there.written == 4
    copy_store(location, back)
    expected = rows_of(source)
    assert rows_of(location) == expected
    assert rows_of(back) == expected
    assert heads_of(location) == heads_of(source) == heads_of(back)
    for where in (location, back):
        assert check_store(where).ok
    with open_store(back) as s:
        # The copy keeps going: a new version gets the next number, the audit the next id.
        assert s.register("a1", *random_head(3, seed=9), tenant="acme") == 3
        assert s.audit(limit=1)[0].action == "replace"
        assert [r.id for r in s.audit(limit=1000)] == sorted({r.id for r in s.audit(limit=1000)})


@pytest.mark.postgresql
def test_the_copy_of_a_live_store_goes_on_registering_with_new_ids(tmp_path, pg_url):
    source = str(tmp_path / "source")
    build(source)
    copy_store(source, pg_url)
    with open_store(pg_url) as s:
        assert s.register("g1", *random_head(2, seed=8), tenant="globex") == 2
        ids = [r.id for r in s.audit(limit=1000)]
    assert ids == sorted(set(ids)) and len(ids) == len(rows_of(source)["audit"]) + 1


def test_a_destination_that_is_not_empty_is_refused(location, tmp_path):
    source = str(tmp_path / "source")
    build(source)
    with open_store(location) as s:
        s.register("mine", *random_head(2))
    before = rows_of(location)
    with pytest.raises(StoreOpRefused, match="is not empty"):
        copy_store(source, location)
    with pytest.raises(StoreOpRefused, match="is not empty"):
        copy_store(source, location, resume=True)
    assert rows_of(location) == before


class Interrupted(Exception):
    pass


def _interrupt_after(monkeypatch, n: int) -> None:
    def stall(done):
        if done == n:
            raise Interrupted()

    monkeypatch.setattr(ops_copy, "stall_at", lambda: n)  # the bots before are committed
    monkeypatch.setattr(ops_copy, "stall", stall)


def test_an_interrupted_copy_is_incomplete_until_resumed_with_the_source_changed(
        location, tmp_path, monkeypatch):
    source = str(tmp_path / "source")
    build(source)
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(Interrupted):
        copy_store(source, location)
    monkeypatch.undo()
    report = check_store(location)
    assert not report.ok and "incomplete" in report.problems[0]
    # No key works on it yet: the keys come with the last transaction.
    with open_store(location) as s:
        assert s.keys() == [] and {b.bot_id for b in s.list()} == {"a1", "a2"}
    with pytest.raises(StoreOpRefused, match="--resume"):
        copy_store(source, location)
    os.mkdir(tmp_path / "elsewhere")
    with pytest.raises(StoreOpRefused, match="not of"):
        copy_store(str(tmp_path / "elsewhere"), location, resume=True)
    # Meanwhile the source changed: a bot copied already got a version, one was removed.
    with open_store(source) as s:
        s.register("a1", *random_head(3, seed=11), tenant="acme")
        s.remove("a2")
    report = copy_store(source, location, resume=True)
    assert (report.written, report.kept, report.dropped) == (3, 0, 1)
    assert rows_of(location) == rows_of(source)
    assert heads_of(location) == heads_of(source)
    assert check_store(location).ok


def test_a_resumed_copy_keeps_the_bots_copied_already(location, tmp_path, monkeypatch):
    source = str(tmp_path / "source")
    build(source)
    monkeypatch.setattr(ops_copy, "BATCH_BOTS", 2)  # bots 1-2 in one transaction, 3 in one
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(Interrupted):
        copy_store(source, location)
    monkeypatch.undo()
    report = copy_store(source, location, resume=True)
    assert (report.written, report.kept) == (1, 3)
    assert rows_of(location) == rows_of(source)


def test_backup_and_restore_keep_every_row_and_head(location, tmp_path):
    build(location)
    archive = tmp_path / "store.tar"
    manifest = backup(location, archive)
    assert manifest["counts"]["bots"] == 4 and len(manifest["blobs"]) == 6
    restored = str(tmp_path / "restored")
    report = restore(archive, restored)
    assert report.counts == manifest["counts"]
    assert rows_of(restored) == rows_of(location)
    assert heads_of(restored) == heads_of(location)
    assert check_store(restored).ok
    with pytest.raises(StoreOpRefused, match="is not empty"):
        restore(archive, restored)


def _rewrite(archive, out, change) -> None:
    """A copy of `archive` with `change(name, data) -> data` applied to each member (None:
    the member left out)."""
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            data = change(member.name, src.extractfile(member).read())
            if data is None:  # left out
                continue
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))


def _flip_weights(name: str, data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1]) if name.endswith("/weights") else data


def _newer(name: str, data: bytes) -> bytes:
    if name != "manifest.json":
        return data
    manifest = json.loads(data)
    manifest["format_version"] = 3
    return json.dumps(manifest).encode()


def _format_1(name: str, data: bytes) -> bytes | None:
    """An archive as format 1 wrote it: no tenant_latency_limits table (None: member left
    out)."""
    if name == "tables/tenant_latency_limits.json":
        return None
    if name != "manifest.json":
        return data
    manifest = json.loads(data)
    manifest["format_version"] = 1
    del manifest["tables"]["tenant_latency_limits"], manifest["counts"]["tenant_latency_limits"]
    return json.dumps(manifest).encode()


def test_an_archive_of_format_1_restores_without_the_tables_added_since(tmp_path):
    """A backup written before tenant_latency_limits existed (format 1) restores: that table
    empty, everything else as it was; the same archive claiming format 2 is damaged."""
    build(tmp_path / "source")
    archive = tmp_path / "store.tar"
    backup(tmp_path / "source", archive)
    old = tmp_path / "old.tar"
    _rewrite(archive, old, _format_1)
    restore(old, tmp_path / "restored")
    rows = rows_of(tmp_path / "restored")
    assert rows.pop("tenant_latency_limits", []) == []
    assert rows == {t: r for t, r in rows_of(tmp_path / "source").items()
                    if t != "tenant_latency_limits"}
    lying = tmp_path / "lying.tar"
    _rewrite(old, lying, lambda name, data: data.replace(b'"format_version": 1',
                                                           b'"format_version": 2'))
    with pytest.raises(StoreOpRefused, match="table tenant_latency_limits is missing"):
        restore(lying, tmp_path / "restored-2")


@pytest.mark.parametrize("damage, reason", [
    (_flip_weights, "is damaged: blobs/.*/weights does not match its sha256"),
    (_newer, "newer multihead .backup format 3; this one reads up to 2"),
    (lambda name, data: b"[]" if name == "tables/api_keys.json" else data,
     "is damaged: tables/api_keys.json does not match its sha256"),
])
def test_a_damaged_or_newer_archive_is_refused_before_anything_is_written(
        tmp_path, damage, reason):
    build(tmp_path / "source")
    archive = tmp_path / "store.tar"
    backup(tmp_path / "source", archive)
    bad = tmp_path / "bad.tar"
    _rewrite(archive, bad, damage)
    with pytest.raises(StoreOpRefused, match=reason) as refused:
        restore(bad, tmp_path / "restored")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "restored").exists()


def test_a_truncated_archive_is_refused(tmp_path):
    build(tmp_path / "source")
    archive = tmp_path / "store.tar"
    backup(tmp_path / "source", archive)
    data = archive.read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreOpRefused, match="cut.tar"):
        restore(tmp_path / "cut.tar", tmp_path / "restored")


def test_check_finds_corrupt_blobs_and_dangling_rows(location, tmp_path):
    build(location)
    assert check_store(location).ok
    if is_pg(location):
        pg_execute(location, "UPDATE multihead.blobs SET data = data || '\\x00'::bytea "
                             "WHERE bot_id = 'a1' AND version = 1 AND name = 'weights'")
        pg_execute(location, "ALTER TABLE multihead.owners DROP CONSTRAINT owners_bot_id_fkey")
        pg_execute(location, "INSERT INTO multihead.owners VALUES ('ghost', 'acme')")
    else:
        weights = next((tmp_path / "store" / "heads" / "a1" / "v1").glob("head.ckpt.data*"))
        weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
        with sqlite3.connect(tmp_path / "store" / "registry.sqlite") as conn:
            conn.execute("INSERT INTO owners VALUES ('ghost', 'acme')")
    report = check_store(location)
    assert not report.ok
    assert any("'a1' v1" in p and ("corrupt" in p or "sha256" in p) for p in report.problems)
    assert any("owner row of 'ghost'" in p for p in report.problems), report.problems
    with pytest.raises(HeadLoadError):
        copy_store(location, tmp_path / "copy")


def test_check_lists_orphans_and_fix_removes_only_them(tmp_path):
    where = tmp_path / "store"
    build(where)
    leftovers = [where / "heads" / "a1" / ".tmp-v7-deadbeef", where / "heads" / "d1" / "v9",
                 where / "heads" / "gone" / "v1", where / ".ops-snapshot-999999999-0abc"]
    for path in leftovers:
        path.mkdir(parents=True, exist_ok=True)
        (path / "file").write_bytes(b"x")
    before = heads_of(where)
    report = check_store(where)
    assert report.ok
    assert sorted(report.orphans) == sorted(str(p.relative_to(where)) for p in leftovers)
    fixed = check_store(where, fix=True)
    assert sorted(fixed.removed) == sorted(report.orphans)
    assert not any(p.exists() for p in leftovers)
    assert check_store(where).orphans == [] and heads_of(where) == before


def test_an_empty_store_copies_checks_and_backs_up_as_empty(location, tmp_path):
    if not is_pg(location):
        with pytest.raises(StoreOpRefused, match="there is no store directory"):
            copy_store(location, tmp_path / "copy")  # a mistyped source: no empty copy
        with pytest.raises(StoreOpRefused, match="there is no store directory"):
            backup(location, tmp_path / "empty.tar")
        os.mkdir(location)
    with pytest.raises(StoreOpRefused, match="there is no directory"):
        backup(location, tmp_path / "nowhere" / "empty.tar")
    assert check_store(location).ok
    copy_store(location, tmp_path / "copy")
    backup(location, tmp_path / "empty.tar")
    restore(tmp_path / "empty.tar", tmp_path / "restored")
    with open_store(tmp_path / "restored") as s:
        assert s.list() == [] and s.keys() == []


def test_a_resume_that_fails_midway_leaves_every_bot_it_served_whole(tmp_path, monkeypatch):
    # was: a bot copied before, and changed in the source since, lost its version folders
    # when its new rows failed to commit (its old rows, rolled back in, pointed to nothing).
    from store.directory.blobs import DirectoryBlobs

    source, dest = str(tmp_path / "source"), str(tmp_path / "dest")
    build(source)
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(Interrupted):
        copy_store(source, dest)
    monkeypatch.undo()
    with open_store(source) as s:
        s.register("a1", *random_head(3, seed=12), tenant="acme")
    with open_store(dest) as s:
        served = {b.bot_id: s.get(b.bot_id).weights.copy() for b in s.list()}
    assert set(served) == {"a1", "a2"}

    def failing(*args, **kwargs):
        raise Interrupted()

    monkeypatch.setattr(DirectoryBlobs, "write", failing)
    with pytest.raises(Interrupted):
        copy_store(source, dest, resume=True)
    monkeypatch.undo()
    with open_store(dest) as s:
        for bot_id, weights in served.items():
            assert (s.get(bot_id).weights == weights).all()
    assert copy_store(source, dest, resume=True).written == 3
    assert rows_of(dest) == rows_of(source) and heads_of(dest) == heads_of(source)
    assert check_store(dest).orphans == []
