"""The directory backend: the version directories (checkpoint, labels, manifest with
sha256s), its SQLite registry (`store.directory.registry`) read directly, a registry that
cannot be read or has no tables yet, crash leftovers, and the refusals of `store.directory`. Fast (no trunk, no server):
`make mutation` runs it."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sqlite3

import numpy as np
import pytest

from heads import HeadLoadError, UnknownBot
from store import HeadStore
from store.directory.backend import DirectoryBackend
from store.directory.registry import Registry
from tests.support.heads import random_head
from tests.support.polling import wait_until

# -- the files of a version -------------------------------------------------------------------


def test_version_directory_holds_checkpoint_labels_and_manifest(store):
    import tensorflow as tf

    w, b, labels = random_head(3, seed=2)
    store.register("acme", w, b, labels, source="unit test")
    vdir = store.root / "heads" / "acme" / "v1"
    reader = tf.train.load_checkpoint(str(vdir / "head.ckpt"))
    assert reader.get_variable_to_shape_map() == {"weights": [1536, 3], "biases": [3]}
    np.testing.assert_array_equal(reader.get_tensor("weights"), w)
    np.testing.assert_array_equal(reader.get_tensor("biases"), b)
    assert (vdir / "labels.txt").read_text("utf-8").splitlines() == labels
    manifest = json.loads((vdir / "manifest.json").read_text("utf-8"))
    assert {k: manifest[k] for k in ("bot_id", "version", "n_classes", "source")} == {
        "bot_id": "acme", "version": 1, "n_classes": 3, "source": "unit test"}
    assert manifest["created"] == store.info("acme").created
    assert set(manifest["files"]) == {p.name for p in vdir.iterdir()} - {"manifest.json"}
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((vdir / name).read_bytes()).hexdigest() == digest
    assert not [p for p in (store.root / "heads" / "acme").iterdir() if p.name != "v1"]


def test_corrupt_head_file_is_a_load_error(tmp_path):
    populated = tmp_path / "store"
    with HeadStore(populated) as s:
        s.register("acme", *random_head(3, seed=1))
        s.register("acme", *random_head(3, seed=2))
        s.register("beta", *random_head(2, seed=3))
    labels_file = populated / "heads" / "beta" / "v1" / "labels.txt"
    labels_file.write_text("x\ny\n", "utf-8")  # same count, other bytes
    with HeadStore(populated) as s:
        with pytest.raises(HeadLoadError, match="'labels.txt' is corrupt"):
            s.get("beta")
        assert s.get("acme").version == 2  # other bots unaffected
    os.remove(populated / "heads" / "acme" / "v2" / "head.ckpt.data-00000-of-00001")
    with HeadStore(populated) as s:
        with pytest.raises(HeadLoadError, match="head.ckpt.data-00000-of-00001' is missing"):
            s.get("acme")


# -- the registry -----------------------------------------------------------------------------


KEYS = {"action", "version", "previous", "at", "source"}


def test_history_rows_of_register_rollback_and_remove(store):
    store.register("acme", *random_head(3, seed=1))
    store.register("acme", *random_head(3, seed=2), source="second")
    store.rollback("acme")
    store.remove("acme")
    rows = store.history("acme")
    assert all(set(r) == KEYS for r in rows)
    assert [(r["action"], r["version"], r["previous"], r["source"]) for r in rows] == [
        ("register", 1, None, "api"), ("register", 2, 1, "second"), ("rollback", 1, 2, None),
        ("remove", None, 1, None)]
    stamps = [r["at"] for r in rows]
    assert stamps == sorted(stamps) and all(s.endswith("+00:00") for s in stamps)
    # The removal deleted the bot and its versions, not its history; its number is not reused.
    assert not store.exists("acme") and store.list() == []
    assert store.register("acme", *random_head(3, seed=3)) == 3
    assert [(r["action"], r["version"], r["previous"]) for r in store.history("acme")][-1] == (
        "register", 3, None)
    # Another bot's history is its own.
    store.register("beta", *random_head(2, seed=4))
    assert [r["action"] for r in store.history("beta")] == ["register"]


def test_the_registry_rows_list_every_stored_version(store):
    store.register("b-bot", *random_head(2, seed=1))
    store.register("a-bot", *random_head(3, seed=2))
    store.register("a-bot", *random_head(3, seed=3))
    store.rollback("a-bot")
    registry = Registry(store.root / "registry.sqlite", store.root / "registry.lock")
    try:
        everything = registry.rows()
        assert [(row.active.bot_id, row.active.version, row.active.n_classes, row.versions,
                 row.tenant) for row in everything] == [
            ("a-bot", 1, 3, [1, 2], "default"), ("b-bot", 1, 2, [1], "default")]
        assert isinstance(everything[0].active.version, int)
        one = registry.rows("b-bot")
        assert [(row.active.bot_id, row.versions) for row in one] == [("b-bot", [1])]
        assert registry.rows("nobody") == [] and registry.history("nobody") == []
    finally:
        registry.close()


def test_a_registry_file_without_its_schema_reads_as_empty(tmp_path):
    """A first writer created the file but has not committed its tables: readers see an empty
    store. Any other SQLite error is raised, never taken for an empty store."""
    db = tmp_path / "registry.sqlite"
    sqlite3.connect(db).close()  # the file exists, with no tables
    registry = Registry(db, tmp_path / "registry.lock")
    try:
        assert registry.rows() == [] and registry.rows("acme") == []
        assert registry.history("acme") == [] and registry.active_map() == {}
    finally:
        registry.close()
    with sqlite3.connect(db) as conn:  # tables of another shape: an error, not "empty"
        conn.execute("CREATE TABLE bots (x)")
        conn.execute("CREATE TABLE versions (y)")
        conn.execute("CREATE TABLE history (z)")
    registry = Registry(db, tmp_path / "registry.lock")
    try:
        for read in (registry.rows, lambda: registry.history("acme")):
            with pytest.raises(sqlite3.OperationalError, match="no such column"):
                read()
    finally:
        registry.close()


def test_the_directory_backend_names_the_unknown_bot_and_its_root(tmp_path):
    backend = DirectoryBackend(tmp_path / "store")
    try:
        assert backend.describe() == str(tmp_path / "store")
        for act in (lambda: backend.bots.remove("ghost"),
                    lambda: backend.bots.rollback("ghost", max)):
            with pytest.raises(UnknownBot) as exc:
                act()
            assert "'ghost'" in str(exc.value)
    finally:
        backend.close()


def test_remove_succeeds_when_the_bot_folder_is_already_gone(store):
    """An operator deleted a bot's folder by hand: `remove` still unregisters it (the rows are
    what counts) instead of failing on the missing files."""
    store.register("acme", *random_head(3, seed=1))
    store.register("acme", *random_head(3, seed=2))
    shutil.rmtree(store.heads_dir / "acme")
    store.remove("acme")
    assert not store.exists("acme") and store.list() == []
    assert os.listdir(store.heads_dir) == []


def test_a_closed_registry_refuses_reads_and_writes(store):
    store.register("acme", *random_head(3, seed=1))
    registry = Registry(store.root / "registry.sqlite", store.root / "registry.lock")
    assert registry.rows("acme")
    registry.close()
    registry.close()  # idempotent
    for act in (registry.rows, lambda: registry.history("acme"), registry.active_map):
        with pytest.raises(RuntimeError) as exc:
            act()
        assert str(exc.value) == "the head store is closed"


def test_a_registration_sweeps_crash_leftovers_of_its_bot(store):
    """What a crashed writer leaves in a bot's folder (a temp dir, a version folder no row points
    to) is deleted by the bot's next registration; registered versions and foreign files stay."""
    store.register("acme", *random_head(3, seed=1))
    bot_dir = store.heads_dir / "acme"
    (bot_dir / ".tmp-v2-deadbeef").mkdir()
    (bot_dir / ".tmp-v2-deadbeef" / "head.ckpt.index").write_bytes(b"partial")
    (bot_dir / "v7").mkdir()  # unregistered: a writer died after renaming, before its rows
    (bot_dir / "notes").mkdir()  # not ours: left alone
    assert store.register("acme", *random_head(3, seed=2)) == 2
    assert sorted(p.name for p in bot_dir.iterdir()) == ["notes", "v1", "v2"]
    assert store.get("acme").version == 2 and store.rollback("acme") == 1


def test_the_first_registration_creates_the_heads_folder(tmp_path):
    store_root = tmp_path / "deep" / "store"
    with HeadStore(store_root) as s:
        assert not store_root.exists()  # nothing created by opening
        s.register("acme", *random_head(3, seed=1))
        assert (store_root / "heads" / "acme").is_dir() and (store_root / "registry.sqlite").exists()


class FailingReader:
    """The registry's read connection, except that reading the active map fails like a locked
    or broken database does."""

    def __init__(self, conn: sqlite3.Connection, message: str) -> None:
        self._conn = conn
        self.message = message
        self.fail = True
        self.failed = 0

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def execute(self, sql, *args):
        if self.fail and "active_version FROM bots" in sql:
            self.failed += 1
            raise sqlite3.OperationalError(self.message)
        return self._conn.execute(sql, *args)


@pytest.mark.parametrize("message", ["database is locked", "disk I/O error"])
def test_an_unreadable_registry_keeps_the_last_known_bots(store_dir, message, caplog):
    """The refresher cannot read the rows of a change: the last snapshot is served, the
    failure is logged once (not at every poll), and the next good poll publishes the change."""
    with HeadStore(store_dir) as writer, HeadStore(store_dir) as reader:
        writer.register("acme", *random_head(3, seed=1))
        reader.change_poll_s = 0.01
        assert reader.get("acme").version == 1  # watched from here on
        registry = reader._backend.registry
        registry._reader = failing = FailingReader(registry._reader, message)
        with caplog.at_level(logging.WARNING, logger="store.front"):
            writer.register("beta", *random_head(2, seed=2))  # a change the reader polls for
            wait_until(lambda: failing.failed >= 3, 10, what="three failed polls")
            assert reader.get("acme").version == 1  # still served, not "unknown bot"
            with pytest.raises(UnknownBot):
                reader.get("beta")  # not seen yet: the registry could not be read
        warned = [r for r in caplog.records if message in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING, warned
        assert warned[0].name == "store.front"
        failing.fail = False
        wait_until(lambda: reader.exists("beta"), 10)  # seen at the next good poll
        assert reader.get("beta").version == 1


def test_a_registry_file_without_tables_yet_is_an_empty_store(store_dir):
    store_dir.mkdir()
    sqlite3.connect(store_dir / "registry.sqlite").close()  # created, schema not committed
    with HeadStore(store_dir) as store:
        assert store.list() == []
        with pytest.raises(UnknownBot):
            store.get("acme")
