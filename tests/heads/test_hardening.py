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
        registry = reader._backend._registry
        registry._reader = FailingReader(registry._reader, message)
        writer.register("beta", *random_head(2, seed=2))  # a change the reader must poll for
        reader._next_check_s = 0.0
        with caplog.at_level(logging.WARNING, logger="heads.store"):
            assert reader.get("acme").version == 1  # still served, not "unknown bot"
        assert message in caplog.text
        with pytest.raises(UnknownBot):
            reader.get("beta")  # not seen yet: the registry could not be read
        registry._reader.fail = False
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


# -- uploaded heads are bounded --------------------------------------------------------------

def test_a_head_over_the_class_limit_is_refused_before_its_tensors_are_read(
        store_dir, tmp_path, monkeypatch):
    import heads.files
    import heads.head
    from backbone.checkpoint import write_checkpoint
    from heads import InvalidHead

    monkeypatch.setattr(heads.head, "MAX_CLASSES", 4)
    monkeypatch.setattr(heads.files, "MAX_CLASSES", 4)
    weights, biases, labels = random_head(5, seed=3)
    prefix = write_checkpoint(str(tmp_path / "five" / "head.ckpt"),
                              {"weights": weights, "biases": biases})
    with HeadStore(store_dir) as store:
        with pytest.raises(InvalidHead, match="more than a head of 4 classes"):
            store.register_checkpoint("big", prefix, labels)
        with pytest.raises(InvalidHead, match="at most 4 classes"):
            store.register("big", weights, biases, labels)
        assert store.list() == []


def test_a_head_tensor_that_is_not_float_is_refused(store_dir, tmp_path):
    from backbone.checkpoint import write_checkpoint
    from heads import InvalidHead

    weights, biases, labels = random_head(3, seed=4)
    prefix = write_checkpoint(str(tmp_path / "ints" / "head.ckpt"),
                              {"weights": (weights * 100).astype(np.int32), "biases": biases})
    with HeadStore(store_dir) as store:
        with pytest.raises(InvalidHead, match="int32, expected float"):
            store.register_checkpoint("ints", prefix, labels)


def test_an_oversized_labels_file_is_refused_unread(tmp_path, monkeypatch):
    import heads.files
    from heads import InvalidHead

    monkeypatch.setattr(heads.files, "MAX_LABELS_BYTES", 100)
    path = write_labels(tmp_path / "labels.txt", [f"label-{i}" for i in range(50)])
    with pytest.raises(InvalidHead, match="over the limit of 100 bytes"):
        heads.files.read_labels(path)
