"""Softmax-regression training: on synthetic feature vectors (no trunk), then `multihead train`
on generated images through the real trunk (the session's one `trunk`; 36 images)."""
from __future__ import annotations

import argparse
import math
import re

import numpy as np
import pytest
from PIL import Image, ImageDraw

from cli import bots as bots_cli
from heads import InvalidTrainingData, train_head
from heads.train import stratified_split
from store import HeadStore


def blobs(n_per_class=40, n_classes=3, seed=0):
    """Classes differ in 64 of 1536 dims only, and the features span six orders of magnitude
    with large offsets (like a trunk's): unscaled, the signal drowns in the big dims."""
    rng = np.random.default_rng(seed)
    centers = np.zeros((n_classes, 1536))
    centers[:, :64] = np.random.default_rng(100).standard_normal((n_classes, 64)) * 2.0
    scale = np.logspace(-3, 3, 1536)  # the signal sits in the smallest-scale dims
    offset = np.random.default_rng(101).uniform(-10, 10, 1536)
    x = np.concatenate([c + rng.standard_normal((n_per_class, 1536)) for c in centers])
    y = np.repeat(np.arange(n_classes), n_per_class)
    return ((x + offset) * scale).astype(np.float32), y


LABELS = ("red", "green", "blue")


def test_learns_separable_classes_and_folds_the_standardisation():
    x, y = blobs(seed=0)
    result = train_head(x, y, LABELS, seed=0)
    assert result.weights.shape == (1536, 3) and result.biases.shape == (3,)
    assert result.weights.dtype == np.float32
    assert result.n_val == 24 and result.n_train == 96
    assert result.val_accuracy >= 0.9
    assert set(result.per_class_val_count.values()) == {8}
    assert all(acc >= 0.75 for acc in result.per_class_val_accuracy.values())
    # The head takes RAW features (standardisation folded in): new samples are classified.
    x_new, y_new = blobs(seed=1)
    accuracy = np.mean(np.argmax(x_new @ result.weights + result.biases, axis=1) == y_new)
    assert accuracy >= 0.95


def test_noise_labels_stay_near_chance_and_stop_early():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((400, 1536)).astype(np.float32)
    y = rng.integers(0, 4, 400)
    result = train_head(x, y, ["a", "b", "c", "d"], seed=0, epochs=500, patience=10)
    assert result.val_accuracy < 0.5  # chance is 0.25
    assert result.epochs_run < 500 and result.best_epoch <= result.epochs_run - 10


def test_same_seed_same_head_other_seed_other_split():
    x, y = blobs(n_per_class=10)
    a = train_head(x, y, LABELS, seed=5, epochs=20)
    b = train_head(x, y, LABELS, seed=5, epochs=20)
    c = train_head(x, y, LABELS, seed=6, epochs=20)
    np.testing.assert_array_equal(a.weights, b.weights)
    assert not np.array_equal(a.weights, c.weights)


def test_nothing_held_out_runs_all_epochs():
    x, y = blobs(n_per_class=5)
    result = train_head(x, y, LABELS, val_fraction=0.0, epochs=15)
    assert result.n_val == 0 and math.isnan(result.val_accuracy)
    assert result.epochs_run == result.best_epoch == 15
    assert result.train_accuracy == 1.0
    assert all(math.isnan(v) for v in result.per_class_val_accuracy.values())


@pytest.mark.parametrize("counts", [[2, 5, 9], [1, 1, 30], [3, 3, 3]])
def test_stratified_split_keeps_every_class_in_training(counts):
    y = np.repeat(np.arange(3), counts)
    train, val = stratified_split(y, 3, 0.25, np.random.default_rng(0))
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(len(y)))
    for c, k in enumerate(counts):
        assert (y[train] == c).sum() >= 1
        assert (y[val] == c).sum() == (0 if k < 2 else max(1, min(round(k * 0.25), k - 1)))


@pytest.mark.parametrize("features, label_idx, labels, match", [
    (np.zeros((4, 1536)), [0, 0, 0, 0], ("a", "b"), "label 'b' has no example"),
    (np.zeros((4, 1536)), [0, 1, 2, 1], ("a", "b"), r"values must be in \[0, 2\)"),
    (np.zeros((4, 1536)), [0, 1], ("a", "b"), "label_idx must be 4 integers"),
    (np.full((2, 1536), np.nan), [0, 1], ("a", "b"), "NaN"),
    (np.zeros((2, 1536)), [0, 1], ("a",), "at least 2 labels"),
    (np.zeros((0, 1536)), [], ("a", "b"), "N >= 1"),
])
def test_bad_training_data_is_refused(features, label_idx, labels, match):
    with pytest.raises(InvalidTrainingData, match=match):
        train_head(features, np.asarray(label_idx, dtype=np.int64), labels)


def test_trained_head_registers(store):
    x, y = blobs(n_per_class=10)
    result = train_head(x, y, LABELS, epochs=30)
    version = store.register("colours", result.weights, result.biases, result.labels)
    head = store.get("colours")
    assert version == 1 and head.labels == LABELS
    np.testing.assert_array_equal(head.logits(x).argmax(axis=1),
                                  (x @ result.weights + result.biases).argmax(axis=1))


# -- training on generated images, through the trunk ------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser(prog="multihead")
    bots_cli.add_commands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


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
