"""Regressions found by reading the heads code as an attacker would (hardening issue)."""
from __future__ import annotations

import logging
import sqlite3

import numpy as np
import pytest

from heads import HeadStore, UnknownBot
from service.cli.main import main
from tests.heads.helpers import random_head, write_labels


class FailingReader:
    """The registry's read connection, except that reading the active map fails like a locked
    or broken database does."""

    def __init__(self, conn: sqlite3.Connection, message: str) -> None:
        self._conn = conn
        self.message = message
        self.fail = True

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def execute(self, sql, *args):
        if self.fail and "active_version FROM bots" in sql:
            raise sqlite3.OperationalError(self.message)
        return self._conn.execute(sql, *args)


@pytest.mark.parametrize("message", ["database is locked", "disk I/O error"])
def test_an_unreadable_registry_keeps_the_last_known_bots(store_dir, message, caplog):
    with HeadStore(store_dir) as writer, HeadStore(store_dir) as reader:
        writer.register("acme", *random_head(3, seed=1))
        assert reader.get("acme").version == 1
        reader._registry._reader = FailingReader(reader._registry._reader, message)
        writer.register("beta", *random_head(2, seed=2))  # a change the reader must poll for
        reader._next_check_s = 0.0
        with caplog.at_level(logging.WARNING, logger="heads.store"):
            assert reader.get("acme").version == 1  # still served, not "unknown bot"
        assert message in caplog.text
        with pytest.raises(UnknownBot):
            reader.get("beta")  # not seen yet: the registry could not be read
        reader._registry._reader.fail = False
        reader._next_check_s = 0.0
        assert reader.get("beta").version == 1  # seen at the next good poll


def test_a_registry_file_without_tables_yet_is_an_empty_store(store_dir):
    store_dir.mkdir()
    sqlite3.connect(store_dir / "registry.sqlite").close()  # created, schema not committed
    with HeadStore(store_dir) as store:
        assert store.list() == []
        with pytest.raises(UnknownBot):
            store.get("acme")


def test_register_from_slim_accepts_the_official_v1_single_file_as_serving_trunk(
        trunk_checkpoint, tmp_path, capsys):
    from tests.backbone.helpers import write_v1_checkpoint

    store = tmp_path / "store"
    (store / "trunk").mkdir(parents=True)
    official = write_v1_checkpoint(trunk_checkpoint, store / "trunk" / "inception_v4.ckpt")
    labels = write_labels(tmp_path / "labels.txt", [f"c{i}" for i in range(1001)])
    # The store's trunk is the V1 file; the import compares the two trunks (no --force).
    assert main(["register", "imagenet", "--from-slim-checkpoint", official,
                 "--labels", labels, "--store", str(store)]) == 0
    out = capsys.readouterr()
    assert "without comparing" not in out.err
    with HeadStore(store) as s:
        head = s.get("imagenet")
        assert head.n_classes == 1001 and np.isfinite(head.weights).all()
