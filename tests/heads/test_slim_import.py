"""Importing a slim Inception-V4 model's classifier layer, on the real trunk (the session's one
`trunk`): the imported head reproduces the trunk's own logits; a model whose trunk was fine-tuned
is refused unless forced; the official single-file V1 checkpoint serves as the serving trunk.
(The store's import rules without a trunk are in test_store.py.)

Images through the trunk in this module: 4."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from cli import bots as bots_cli
from cli.main import main
from heads import TrunkMismatch
from store import HeadStore
from tests.support.heads import tree_digest, write_labels

IMAGENET_LABELS = ["background"] + [f"imagenet class {i}" for i in range(1, 1001)]


def parse(argv):
    parser = argparse.ArgumentParser(prog="multihead")
    bots_cli.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_slim_import_reproduces_the_trunk_logits(trunk, trunk_checkpoint, store):
    images = np.random.default_rng(0).uniform(-1, 1, (4, 299, 299, 3)).astype(np.float32)
    features, logits = trunk.features_and_logits(images)  # [4, 1536], [4, 1001]
    version = store.register_from_slim("imagenet", trunk_checkpoint, IMAGENET_LABELS,
                                       serving_trunk_prefix=trunk_checkpoint)
    head = store.get("imagenet")
    assert version == 1 and head.n_classes == 1001
    ours = head.logits(features)
    assert np.abs(ours - logits).max() <= 1e-4, np.abs(ours - logits).max()
    assert [row[0][0] for row in head.top_k(features, 1)] == \
        [IMAGENET_LABELS[i] for i in logits.argmax(axis=1)]
    assert store.info("imagenet").source.startswith("slim:")


@pytest.fixture(scope="module")
def finetuned_checkpoint(tmp_path_factory):
    """A slim checkpoint 'fine-tuned end to end': another trunk and a 5-class Logits layer."""
    from backbone.checkpoint import random_variables, write_checkpoint

    out = tmp_path_factory.mktemp("finetuned") / "model.ckpt-1000"
    return write_checkpoint(str(out), random_variables(1, num_classes=5))


def test_slim_import_with_another_trunk_is_refused_unless_forced(
        finetuned_checkpoint, trunk_checkpoint, tmp_path, capsys):
    import tensorflow as tf

    root = tmp_path / "store"
    labels = write_labels(tmp_path / "labels.txt", ["a", "b", "c", "d", "e"])
    with HeadStore(root) as s:
        s.register("other", *(np.ones((1536, 2)), np.zeros(2), ["x", "y"]))
    before = tree_digest(root)
    argv = ["register", "ft", "--from-slim-checkpoint", finetuned_checkpoint, "--labels", labels,
            "--store", str(root), "--trunk-checkpoint", trunk_checkpoint]
    from cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "differs from the serving trunk" in err and "fine-tuned" in err and "--force" in err
    assert tree_digest(root) == before

    with HeadStore(root) as s:
        with pytest.raises(TrunkMismatch):
            s.register_from_slim("ft", finetuned_checkpoint, labels,
                                 serving_trunk_prefix=trunk_checkpoint)
        assert s.register_from_slim("ft", finetuned_checkpoint, labels,
                                    serving_trunk_prefix=trunk_checkpoint, force=True) == 1
        head = s.get("ft")
        reader = tf.train.load_checkpoint(finetuned_checkpoint)
        np.testing.assert_array_equal(head.weights,
                                      reader.get_tensor("InceptionV4/Logits/Logits/weights"))
        assert head.labels == ("a", "b", "c", "d", "e")
        assert "forced" in s.info("ft").source


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
