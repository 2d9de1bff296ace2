"""Heads on the real Inception-V4 trunk (the session's one `trunk`): slim import and training.

Images through the trunk in this module: 4 (slim import) + 36 (training) = 40.
"""
from __future__ import annotations

import argparse
import re

import numpy as np
import pytest
from PIL import Image, ImageDraw

from heads import HeadStore, TrunkMismatch
from service.cli import bots as bots_cli
from tests.heads.helpers import tree_digest, write_labels

IMAGENET_LABELS = ["background"] + [f"imagenet class {i}" for i in range(1, 1001)]


def parse(argv):
    parser = argparse.ArgumentParser(prog="multihead")
    bots_cli.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


# -- slim import ---------------------------------------------------------------------------------


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
    from service.cli.main import main

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


# -- training on generated images -------------------------------------------------------------


COLOURS = {"red": (200, 40, 40), "green": (40, 170, 60), "blue": (40, 60, 200)}


def make_image_folder(root, per_class=12, seed=0):
    """DIR/<colour>/*.png|JPG: a jittered solid background colour with a small random shape."""
    rng = np.random.default_rng(seed)
    for label, rgb in COLOURS.items():
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            jitter = rng.integers(-25, 26, 3)
            colour = tuple(int(np.clip(c + j, 0, 255)) for c, j in zip(rgb, jitter))
            image = Image.new("RGB", (80, 64), colour)
            draw = ImageDraw.Draw(image)
            x0, y0 = (int(v) for v in rng.integers(8, 48, 2))
            box = [x0, y0, x0 + int(rng.integers(6, 20)), y0 + int(rng.integers(6, 16))]
            fill = tuple(int(v) for v in rng.integers(0, 256, 3))
            (draw.ellipse if i % 2 else draw.rectangle)(box, fill=fill)
            image.save(root / label / (f"{i:02d}.png" if i % 3 else f"{i:02d}.JPG"))
    (root / "red" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (root / "red" / "notes.txt").write_text("not an image")
    return root


class RecordingTrunk:
    """The session trunk, keeping the features it hands out."""

    def __init__(self, trunk):
        self.trunk, self.features_seen = trunk, []

    def features(self, images):
        out = self.trunk.features(images)
        self.features_seen.append(out)
        return out


def test_train_on_generated_images_beats_chance(trunk, tmp_path, capsys):
    folder = make_image_folder(tmp_path / "images")
    store_dir = tmp_path / "store"
    recording = RecordingTrunk(trunk)
    args = parse(["train", "colours", "--images", str(folder), "--store", str(store_dir),
                  "--val-fraction", "0.25", "--no-progress", "--batch-size", "12"])
    assert bots_cli.cmd_train(args, trunk=recording) == 0
    out, err = capsys.readouterr()
    assert "skipped" in err and "broken.jpg" in err
    assert [len(f) for f in recording.features_seen] == [12, 12, 12]  # batched, 36 images
    for label in COLOURS:
        assert re.search(rf"^  {label}\s+\d/3 ", out, re.M), out
    held_out = float(re.search(r"overall: ([0-9.]+) held-out accuracy", out).group(1))
    assert held_out >= 0.75, out  # chance is 1/3
    assert "registered bot 'colours' version 1 (3 classes)" in out

    with HeadStore(store_dir) as s:
        head = s.get("colours")
        assert head.labels == ("blue", "green", "red")  # sorted folder names
        features = np.concatenate(recording.features_seen)  # [36, 1536], raw trunk features
        truth = np.repeat([0, 1, 2], 12)  # read in sorted folder order: blue, green, red
        accuracy = np.mean(head.logits(features).argmax(axis=1) == truth)
        assert accuracy >= 0.9  # train + held-out images, through the registered head
        assert s.info("colours").source.startswith("train:")
