"""HeadStore on a real store of each backend: a directory (TF checkpoints, SQLite registry in
WAL mode) and PostgreSQL (a throw-away server). Tests taking `location`/`any_store` run on both;
the ones about rules of the store itself take `store` (a directory). What a registration does
when it fails or races is in test_writers.py, how other processes' changes arrive in
test_changes.py, each backend's own storage in test_disk.py and test_pg.py."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from heads import HeadLoadError, InvalidBotId, InvalidHead, UnknownBot
from store import HeadStore, UnknownVersion, open_store
from tests.support.heads import (
    features,
    random_head,
    save_checkpoint,
    store_digest,
    stored_entries,
    write_labels,
)
from tests.support.polling import wait_until
from tests.support.stores import BackendReads

# -- round trip -------------------------------------------------------------------------------


def test_register_get_logits_round_trip(any_store):
    store = any_store
    w, b, labels = random_head(4, seed=1)
    assert store.register("acme", w, b, labels) == 1
    head = store.get("acme")
    assert (head.bot_id, head.version, head.labels, head.n_classes) == ("acme", 1, tuple(labels), 4)
    np.testing.assert_array_equal(head.weights, w)
    np.testing.assert_array_equal(head.biases, b)
    f = features()
    np.testing.assert_allclose(head.logits(f), f @ w + b, rtol=1e-5, atol=1e-5)
    # A second store on the same location (a fresh process) loads the same head from storage.
    with open_store(store.location) as other:
        np.testing.assert_array_equal(other.get("acme").weights, w)


def test_register_checkpoint_with_custom_tensor_names_and_labels_file(any_store, tmp_path):
    store = any_store
    w, b, labels = random_head(5, seed=3)
    prefix = save_checkpoint(tmp_path / "ft" / "model.ckpt",
                             {"dense/kernel": w, "dense/bias": b, "global_step": np.int64(7)})
    labels_file = write_labels(tmp_path / "labels.txt", labels)
    v = store.register_checkpoint("acme", prefix, labels_file, weights_name="dense/kernel",
                                  biases_name="dense/bias")
    head = store.get("acme")
    assert v == 1 and head.labels == tuple(labels)
    np.testing.assert_array_equal(head.weights, w)
    assert store.info("acme").source == f"checkpoint:{os.path.abspath(prefix)}"


# -- list / show / remove / rollback ----------------------------------------------------------


def test_list_info_rollback_remove(any_store):
    store = any_store
    assert store.list() == []
    for seed in (1, 2, 3):
        store.register("acme", *random_head(3, seed=seed))
    store.register("beta", *random_head(2, seed=4))
    assert [(i.bot_id, i.version, i.versions) for i in store.list()] == [
        ("acme", 3, [1, 2, 3]), ("beta", 1, [1])]
    info = store.info("beta")
    assert (info.n_classes, info.labels, info.source) == (2, ("class-4-0", "class-4-1"), "api")

    assert store.rollback("acme") == 2
    assert store.get("acme").version == 2
    np.testing.assert_array_equal(store.get("acme").weights, random_head(3, seed=2)[0])
    assert store.rollback("acme", to=3) == 3  # forward again
    assert store.rollback("acme", to=1) == 1
    assert store.get("acme").version == 1
    with pytest.raises(UnknownVersion, match="no version before v1"):
        store.rollback("acme")
    with pytest.raises(UnknownVersion, match=r"no version 9 \(versions on disk: 1, 2, 3\)"):
        store.rollback("acme", to=9)
    actions = [(h["action"], h["version"], h["previous"]) for h in store.history("acme")]
    assert actions == [("register", 1, None), ("register", 2, 1), ("register", 3, 2),
                       ("rollback", 2, 3), ("rollback", 3, 2), ("rollback", 1, 3)]

    store.remove("acme")
    assert not store.exists("acme") and store.exists("beta")
    assert [i.bot_id for i in store.list()] == ["beta"]
    assert stored_entries(store.location, "acme") == []  # no files, no rows, no blobs left
    for call in (lambda: store.get("acme"), lambda: store.info("acme"),
                 lambda: store.remove("acme"), lambda: store.rollback("acme")):
        with pytest.raises(UnknownBot, match="unknown bot 'acme'"):
            call()
    # Version numbers are never reused, so no reader can mistake a new head for an old one.
    assert store.register("acme", *random_head(3, seed=5)) == 4
    assert store.info("acme").versions == [4]


def test_get_unknown_and_malformed_ids(any_store):
    store = any_store
    store.register("acme", *random_head(2))
    with pytest.raises(UnknownBot, match="unknown bot 'acme-7'"):
        store.get("acme-7")
    with pytest.raises(InvalidBotId):
        store.get("../acme")
    assert store.exists("acme") and not store.exists("../acme")


def test_bot_info_to_dict_public_and_admin(store):
    w, b, labels = random_head(3, seed=2)
    store.register("acme", w, b, labels, source="first")
    store.register("acme", w, b, labels, source="second")
    info = store.info("acme")
    admin = info.to_dict()
    assert admin == {"bot_id": "acme", "version": 2, "n_classes": 3, "labels": list(labels),
                     "created": info.created, "versions": [1, 2], "source": "second",
                     "tenant": "default", "candidate": None}
    assert isinstance(admin["labels"], list) and isinstance(admin["versions"], list)
    public = info.to_dict(with_source=False)
    assert public == {k: v for k, v in admin.items() if k != "source"}
    json.dumps(admin)  # JSON-ready
    # A candidate: its own entry (not among the versions rollback may activate).
    w4, b4, labels4 = random_head(4, seed=3)
    store.register("acme", w4, b4, labels4, source="third", candidate="canary:12.5")
    info = store.info("acme")
    admin = info.to_dict()
    assert admin["versions"] == [1, 2] and admin["candidate"] == {
        "version": 3, "mode": "canary", "percent": 12.5, "n_classes": 4,
        "labels": list(labels4), "created": info.candidate.created, "source": "third"}
    public = info.to_dict(with_source=False)
    assert public["candidate"] == {k: v for k, v in admin["candidate"].items() if k != "source"}
    assert "candidate" not in info.to_dict(with_candidate=False)
    json.dumps(admin)


@pytest.mark.parametrize("to", ["2", 2.0, True, None])
def test_rollback_takes_an_integer_version_only(store, to):
    for seed in (1, 2, 3):
        store.register("acme", *random_head(3, seed=seed))
    if to is None:  # the default: the highest version below the active one
        assert store.rollback("acme", to) == 2
        return
    with pytest.raises(UnknownVersion) as exc:
        store.rollback("acme", to=to)
    assert str(exc.value) == f"version must be an integer, got {to!r}"
    assert store.info("acme").version == 3


def test_rollback_refusals_name_the_bot(store):
    store.register("acme", *random_head(3, seed=1))
    with pytest.raises(UnknownVersion) as exc:
        store.rollback("acme")
    assert str(exc.value) == "bot 'acme' has no version before v1 to roll back to"
    with pytest.raises(UnknownVersion) as exc:
        store.rollback("acme", to=np.int64(4))
    assert str(exc.value) == "bot 'acme' has no version 4 (versions on disk: 1)"
    assert store.rollback("acme", to=np.int64(1)) == 1


# -- refusals leave the store byte-for-byte unchanged -----------------------------------------


@pytest.fixture
def populated(location):
    """A store with two bots (acme v1..v2, beta v1), closed so that its contents are stable."""
    with open_store(location) as s:
        s.register("acme", *random_head(3, seed=1))
        s.register("acme", *random_head(3, seed=2))
        s.register("beta", *random_head(2, seed=3))
    return location


def _refusals(tmp_path):
    w, b, labels = random_head(3, seed=7)
    nan_w = w.copy()
    nan_w[5, 1] = np.nan
    head_ckpt = save_checkpoint(tmp_path / "head.ckpt", {"weights": w, "biases": b})
    return {
        "wrong weights shape": (InvalidHead, "[1535, 3]",
                                lambda s: s.register("acme", w[1:], b, labels)),
        "one class": (InvalidHead, "at least 2",
                      lambda s: s.register("acme", w[:, :1], b[:1], labels[:1])),
        "biases shape": (InvalidHead, "biases have shape [4]",
                         lambda s: s.register("acme", w, np.zeros(4), labels)),
        "NaN": (InvalidHead, "NaN", lambda s: s.register("acme", nan_w, b, labels)),
        "Inf": (InvalidHead, "non-finite",
                lambda s: s.register("acme", w, np.array([0, -np.inf, 0]), labels)),
        "label count": (InvalidHead, "2 labels given for a head with 3 classes",
                        lambda s: s.register("acme", w, b, labels[:2])),
        "path traversal id": (InvalidBotId, "'../acme'",
                              lambda s: s.register("../acme", w, b, labels)),
        "missing checkpoint": (HeadLoadError, "no TF checkpoint at",
                               lambda s: s.register_checkpoint("acme", tmp_path / "nope.ckpt",
                                                               labels)),
        "missing tensor": (HeadLoadError, "has no tensor 'kernel'",
                           lambda s: s.register_checkpoint("acme", head_ckpt, labels,
                                                           weights_name="kernel")),
        "not a slim checkpoint": (HeadLoadError, "InceptionV4/Logits/Logits/weights",
                                  lambda s: s.register_from_slim("acme", head_ckpt, labels)),
        "missing labels file": (HeadLoadError, "nope.txt",
                                lambda s: s.register("acme", w, b, tmp_path / "nope.txt")),
        "remove unknown": (UnknownBot, "'gamma'", lambda s: s.remove("gamma")),
        "rollback unknown": (UnknownBot, "'gamma'", lambda s: s.rollback("gamma")),
        "rollback missing version": (UnknownVersion, "no version 7",
                                     lambda s: s.rollback("acme", to=7)),
        "rollback past first": (UnknownVersion, "before v1", lambda s: s.rollback("beta")),
    }


REFUSALS = ["wrong weights shape", "one class", "biases shape", "NaN", "Inf", "label count",
            "path traversal id", "missing checkpoint", "missing tensor", "not a slim checkpoint",
            "missing labels file", "remove unknown", "rollback unknown",
            "rollback missing version", "rollback past first"]


@pytest.mark.parametrize("case", REFUSALS)
def test_refusal_leaves_store_unchanged(populated, tmp_path, case):
    error, message, call = _refusals(tmp_path)[case]
    before = store_digest(populated)
    with open_store(populated) as s:
        s.get("acme")  # a working reader, with its connection open during the refusal
        with pytest.raises(error) as exc:
            call(s)
        assert message in str(exc.value)
        assert s.get("acme").version == 2
    assert store_digest(populated) == before


def test_refusal_on_a_new_store_creates_nothing(location):
    w, b, labels = random_head(3)
    with open_store(location) as s:
        assert s.list() == [] and not s.exists("acme") and s.history("acme") == []
        with pytest.raises(InvalidHead):
            s.register("acme", w, b, labels[:2])
        with pytest.raises(UnknownBot):
            s.remove("acme")
        with pytest.raises(UnknownBot):
            s.rollback("acme")
    # No directory; in PostgreSQL, not even the schema.
    assert store_digest(location) == {}


def test_register_checkpoint_names_the_checkpoint_of_a_refused_head(store, tmp_path):
    w, b, _ = random_head(3, seed=5)
    prefix = save_checkpoint(tmp_path / "head.ckpt", {"dense/kernel": w, "dense/bias": b})
    with pytest.raises(InvalidHead) as exc:
        store.register_checkpoint("acme", prefix, ["a", "b"], weights_name="dense/kernel",
                                  biases_name="dense/bias")
    assert str(exc.value) == (f"checkpoint '{prefix}': "
                              "2 labels given for a head with 3 classes")
    assert not store.exists("acme")


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


# -- importing a slim model's classifier layer (no trunk: see test_slim_import.py) ------------


def _slim_checkpoint(prefix, n_classes, seed=4):
    from heads.files import SLIM_BIASES_KEY, SLIM_WEIGHTS_KEY

    w, b, _ = random_head(n_classes, seed=seed)
    return save_checkpoint(prefix, {SLIM_WEIGHTS_KEY: w, SLIM_BIASES_KEY: b}), w, b


def test_register_from_slim_imports_the_logits_layer(store, tmp_path):
    prefix, w, b = _slim_checkpoint(tmp_path / "slim.ckpt", 4)
    labels = [f"k{i}" for i in range(4)]
    assert store.register_from_slim("imported", prefix, labels) == 1
    head = store.get("imported")
    np.testing.assert_array_equal(head.weights, w)
    np.testing.assert_array_equal(head.biases, b)
    assert head.labels == tuple(labels)
    assert store.info("imported").source == f"slim:{os.path.abspath(prefix)}"
    # A labels file works too, and a wrong label count names the checkpoint.
    labels_file = write_labels(tmp_path / "labels.txt", labels)
    assert store.register_from_slim("imported", Path(prefix), labels_file) == 2
    with pytest.raises(InvalidHead, match=r"slim checkpoint '.*slim\.ckpt': .*3 labels"):
        store.register_from_slim("imported", prefix, labels[:3])
    with pytest.raises(InvalidBotId):
        store.register_from_slim("../imported", prefix, labels)
    assert store.info("imported").version == 2


def test_register_from_slim_compares_trunks_unless_forced(store, tmp_path, monkeypatch):
    import backbone
    from heads import TrunkMismatch

    prefix, _, _ = _slim_checkpoint(tmp_path / "tuned.ckpt", 3)
    serving = tmp_path / "serving.ckpt"
    digests = {os.fspath(prefix): "a" * 64, os.fspath(serving): "b" * 64}
    seen = []

    def digest(p):
        seen.append(p)
        return digests[p]

    monkeypatch.setattr(backbone, "trunk_digest", digest)
    labels = ["x", "y", "z"]
    with pytest.raises(TrunkMismatch) as exc:
        store.register_from_slim("tuned", prefix, labels, serving_trunk_prefix=serving)
    message = str(exc.value)
    assert f"'{prefix}'" in message and f"'{serving}'" in message
    assert "(digest aaaaaaaaaaaa vs bbbbbbbbbbbb)" in message and "bot 'tuned'" in message
    assert message.endswith("use --force (force=True) to import its classifier layer anyway")
    assert seen == [os.fspath(prefix), os.fspath(serving)]
    assert not store.exists("tuned")
    # Forced: imported, and the history says so.
    assert store.register_from_slim("tuned", prefix, labels, serving_trunk_prefix=serving,
                                    force=True) == 1
    assert store.info("tuned").source == (f"slim:{os.path.abspath(prefix)} (forced: trunk "
                                          "aaaaaaaaaaaa differs from the serving trunk)")
    # Same trunk: imported without --force, and the source is plain.
    digests[os.fspath(serving)] = "a" * 64
    assert store.register_from_slim("same", prefix, labels, serving_trunk_prefix=serving) == 1
    assert store.info("same").source == f"slim:{os.path.abspath(prefix)}"


# -- lookups and the resident cache -----------------------------------------------------------


def test_lookups_do_not_reload_heads_or_read_the_registry(any_store, monkeypatch):
    """A lookup reads the snapshot: one cold load of the head's blobs, then nothing at all
    from the backend, however often the refresher polls (here: always)."""
    store = any_store
    store.register("acme", *random_head(3))
    store.change_poll_s = 0.0  # the refresher polls without pause: it is not the lookups'
    store.watch()
    reads = BackendReads(store, monkeypatch)
    for _ in range(2000):
        store.get("acme")
    assert reads.by() == ["blobs.load"]  # one cold load, then resident; never the registry
    stats = store.cache_stats()
    assert stats["misses"] == 1 and stats["hits"] == 1999
    me = threading.get_ident()
    wait_until(lambda: any(label == "data_version" for ident, label in reads.calls
                           if ident != me), 10, what="the refresher polling")


def test_store_lru_respects_budget_and_pins(location):
    with open_store(location) as writer:
        for i in range(6):
            writer.register(f"bot{i}", *random_head(100, seed=i))
    with open_store(location) as probe:
        one = probe.get("bot0").nbytes  # about 0.6 MiB
    budget_mb = 3.5 * one / 2**20
    with open_store(location, heads_memory_mb=budget_mb, pinned=["bot0"]) as s:
        for _ in range(2):
            for i in range(6):
                head = s.get(f"bot{i}")
                np.testing.assert_array_equal(head.weights, random_head(100, seed=i)[0])
                stats = s.cache_stats()
                assert stats["resident_bytes"] <= budget_mb * 2**20
        stats = s.cache_stats()
        assert stats["resident_heads"] == 3 and stats["evictions"] >= 6
        assert s._cache.resident_bot_ids() == ["bot0", "bot4", "bot5"]
        assert s._cache.peek("bot0", 1) is not None  # pinned, although least recently used


def test_a_head_removed_or_replaced_by_another_writer_since_the_last_poll(store_dir):
    """A reader whose bot list is stale (within its poll interval) asks for a head another writer
    has removed: the failed load makes it re-read the registry, and it answers UnknownBot, or the
    head that replaced it."""
    with HeadStore(store_dir) as writer, HeadStore(store_dir) as reader:
        writer.register("acme", *random_head(3, seed=1))
        writer.register("beta", *random_head(2, seed=2))
        reader.change_poll_s = 3600.0  # one read now, then no poll: only a failed load re-reads
        assert reader.exists("acme") and reader.exists("beta")  # known, not loaded yet
        writer.remove("acme")
        with pytest.raises(UnknownBot) as exc:
            reader.get("acme")
        assert "'acme'" in str(exc.value)
        writer.remove("beta")
        w, b, labels = random_head(4, seed=3)
        assert writer.register("beta", w, b, labels) == 2  # numbers are never reused
        head = reader.get("beta")
        assert (head.version, head.n_classes) == (2, 4)
        np.testing.assert_array_equal(head.weights, w)
