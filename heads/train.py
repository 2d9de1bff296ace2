"""Training a head: trunk features of a labelled image folder, then softmax regression in numpy.

    DIR/<label>/*.{jpg,jpeg,png}
      -> scan_image_folder(DIR)                      labels = sorted sub-directory names
      -> extract_features(folder, trunk)             backbone.preprocess + trunk.features, batched
      -> train_head(features, label_idx, labels)     L2 softmax regression, held-out early stopping
      -> TrainResult.weights [1536, n], .biases [n]  ready for `HeadStore.register`

The features are standardised for the fit (the trunk's feature scales vary by orders of
magnitude) and the scaling is folded back into the weights and biases, so the registered head
takes raw trunk features like every other head.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heads.errors import InvalidTrainingData
from heads.head import validate_labels

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


# -- the labelled image folder ---------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ImageFolder:
    """The images of `DIR/<label>/*`, labels in sorted order."""

    root: Path
    labels: tuple[str, ...]
    paths: tuple[Path, ...]
    label_idx: np.ndarray  # [N] int64, index into labels


def scan_image_folder(images_dir: str | os.PathLike) -> ImageFolder:
    """List `DIR/<label>/*.{jpg,jpeg,png}` (extensions in any case; hidden entries skipped).

    Raises:
        InvalidTrainingData: no such directory, fewer than 2 labels, or a label with no image.
    """
    root = Path(images_dir)
    if not root.is_dir():
        raise InvalidTrainingData(f"image folder '{root}' does not exist or is not a directory")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(class_dirs) < 2:
        raise InvalidTrainingData(
            f"image folder '{root}' has {len(class_dirs)} label sub-directories; a head needs "
            "at least 2 (DIR/<label>/*.jpg)"
        )
    labels = validate_labels(p.name for p in class_dirs)
    paths: list[Path] = []
    label_idx: list[int] = []
    for i, class_dir in enumerate(class_dirs):
        images = sorted(p for p in class_dir.iterdir()
                        if p.is_file() and not p.name.startswith(".")
                        and p.suffix.lower() in IMAGE_EXTENSIONS)
        if not images:
            raise InvalidTrainingData(f"label '{class_dir.name}' has no .jpg/.jpeg/.png image "
                                      f"in '{class_dir}'")
        paths.extend(images)
        label_idx.extend([i] * len(images))
    return ImageFolder(root, labels, tuple(paths), np.asarray(label_idx, dtype=np.int64))


@dataclass(frozen=True, eq=False)
class LabelledFeatures:
    """Trunk features of the readable images of a folder."""

    labels: tuple[str, ...]
    features: np.ndarray  # [M, 1536] float32
    label_idx: np.ndarray  # [M] int64
    skipped: tuple[tuple[Path, str], ...]  # (path, reason) of images that could not be decoded


def extract_features(folder: ImageFolder, trunk, *, batch_size: int = 16,
                     progress: bool = True) -> LabelledFeatures:
    """Run every image of `folder` through `backbone.preprocess` and `trunk.features`.

    Undecodable images are skipped and reported in `.skipped`, unless that leaves a label with
    no image at all.

    Args:
        trunk: anything with `features(images [B, 299, 299, 3] float32) -> [B, 1536]`.
        batch_size: images per trunk run.
        progress: show a tqdm progress bar on stderr.
    Raises:
        InvalidTrainingData: a label is left without a readable image.
    """
    from tqdm import tqdm

    from backbone import preprocess
    from backbone.errors import InvalidImage

    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    features: list[np.ndarray] = []
    kept: list[int] = []
    skipped: list[tuple[Path, str]] = []
    batch: list[np.ndarray] = []
    with tqdm(total=len(folder.paths), unit="img", desc="trunk features",
              disable=not progress) as bar:

        def flush() -> None:
            if batch:
                features.append(np.asarray(trunk.features(np.stack(batch)), dtype=np.float32))
                bar.update(len(batch))
                batch.clear()

        for i, path in enumerate(folder.paths):
            try:
                batch.append(preprocess(path.read_bytes()))  # [299, 299, 3] in [-1, 1]
                kept.append(i)
            except (InvalidImage, OSError) as exc:
                skipped.append((path, str(exc) or type(exc).__name__))
                bar.update(1)
                continue
            if len(batch) >= batch_size:
                flush()
        flush()
    label_idx = folder.label_idx[kept]
    missing = sorted(set(range(len(folder.labels))) - set(label_idx.tolist()))
    if missing:
        raise InvalidTrainingData(
            f"label '{folder.labels[missing[0]]}' has no readable image "
            f"({len(skipped)} image(s) could not be decoded)"
        )
    out = np.concatenate(features) if features else np.zeros((0, 0), np.float32)
    return LabelledFeatures(folder.labels, out, label_idx, tuple(skipped))


# -- softmax regression --------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TrainResult:
    """A fitted head and how it did on the held-out split.

    `weights`/`biases` take raw trunk features (the standardisation is folded in).
    Accuracies are NaN where there was nothing held out.
    """

    labels: tuple[str, ...]
    weights: np.ndarray  # [D, n] float32
    biases: np.ndarray  # [n] float32
    val_accuracy: float
    per_class_val_accuracy: dict[str, float]
    per_class_val_count: dict[str, int]
    train_accuracy: float
    val_loss: float
    best_epoch: int
    epochs_run: int
    n_train: int
    n_val: int


def stratified_split(label_idx: np.ndarray, n_classes: int, val_fraction: float,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, val): about `val_fraction` of each class held out, at least one per class
    with two or more examples, never a class's last training example."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError("val_fraction must be in [0, 1)")
    train, val = [], []
    for c in range(n_classes):
        idx = rng.permutation(np.flatnonzero(label_idx == c))
        k = len(idx)
        n_val = 0
        if val_fraction > 0 and k >= 2:
            n_val = min(max(int(round(k * val_fraction)), 1), k - 1)
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    return z


def _cross_entropy(z: np.ndarray, y: np.ndarray) -> float:
    z = z - z.max(axis=1, keepdims=True)
    log_p = z[np.arange(len(y)), y] - np.log(np.exp(z).sum(axis=1))
    return float(-log_p.mean())


def _top_eigenvalue(z: np.ndarray, iterations: int = 30, seed: int = 0) -> float:
    """Largest eigenvalue of z.T @ z / len(z) by power iteration (z: [N, D])."""
    v = np.random.default_rng(seed).standard_normal(z.shape[1]).astype(np.float32)
    lam = 0.0
    for _ in range(iterations):
        u = z.T @ (z @ v) / len(z)
        lam = float(np.linalg.norm(u))
        if lam == 0.0:
            return 0.0
        v = u / lam
    return lam


def train_head(features: np.ndarray, label_idx: Sequence[int], labels: Sequence[str], *,
               l2: float = 1e-3, seed: int = 0, val_fraction: float = 0.2, epochs: int = 500,
               patience: int = 50, learning_rate: float | None = None) -> TrainResult:
    """Fit a softmax-regression head with L2 on trunk features, early-stopped on a held-out split.

    Full-batch gradient descent with Nesterov momentum on standardised features (step 1/L from
    the data's largest eigenvalue unless `learning_rate` is given). Plain gradient steps, unlike
    per-coordinate methods such as Adam, keep the weights on the directions the data supports,
    which matters when there are far fewer images than the 1536 feature dimensions. After each
    epoch (one step) the held-out cross entropy is measured and the best epoch's weights are
    kept; training stops after `patience` epochs without improvement. With nothing held out
    (`val_fraction=0`, or one example per class) it runs all `epochs`.

    Args:
        features: [N, D] trunk features (D = 1536 for a registrable head).
        label_idx: [N] class index of each row, in [0, len(labels)).
        labels: n >= 2 class names; every class needs at least one example.
        l2: weight decay on the (standardised) weights, not on the biases.
        seed: makes the held-out split reproducible.
    Returns:
        TrainResult with weights [D, n] and biases [n] for raw features.
    Raises:
        InvalidTrainingData: shapes disagree, non-finite features, a class without examples.
    """
    labels = validate_labels(labels)
    n = len(labels)
    x = np.asarray(features, dtype=np.float32)  # [N, D]
    y = np.asarray(label_idx)
    if n < 2:
        raise InvalidTrainingData(f"a head needs at least 2 labels, got {n}")
    if x.ndim != 2 or x.shape[0] == 0:
        raise InvalidTrainingData(f"features have shape {list(x.shape)}, expected [N, D], N >= 1")
    if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer):
        raise InvalidTrainingData(f"label_idx must be {x.shape[0]} integers, got shape "
                                  f"{list(y.shape)} of {y.dtype}")
    if y.min() < 0 or y.max() >= n:
        raise InvalidTrainingData(f"label_idx values must be in [0, {n}), got "
                                  f"[{y.min()}, {y.max()}]")
    counts = np.bincount(y, minlength=n)
    if (counts == 0).any():
        raise InvalidTrainingData(f"label '{labels[int(np.argmin(counts))]}' has no example")
    if not np.isfinite(x).all():
        raise InvalidTrainingData("features contain NaN or Inf")
    if epochs < 1 or patience < 1:
        raise ValueError("epochs and patience must be >= 1")
    if l2 < 0 or (learning_rate is not None and not learning_rate > 0):
        raise ValueError("l2 must be >= 0 and learning_rate > 0")

    rng = np.random.default_rng(seed)
    train_idx, val_idx = stratified_split(y, n, val_fraction, rng)
    x_train, y_train = x[train_idx], y[train_idx]
    mu = x_train.mean(axis=0, dtype=np.float64)  # [D]
    sd = x_train.std(axis=0, dtype=np.float64)  # [D]
    # Features constant in training (within float32 rounding) are left unscaled: their weight
    # gets no gradient, so it stays 0 and they cannot amplify noise on other inputs.
    sd = np.where(sd > 1e-6 * np.abs(mu) + 1e-12, sd, 1.0)
    z_train = ((x_train - mu) / sd).astype(np.float32)  # [Nt, D]
    z_val = ((x[val_idx] - mu) / sd).astype(np.float32)  # [Nv, D]
    y_val = y[val_idx]
    one_hot = np.eye(n, dtype=np.float32)[y_train]  # [Nt, n]

    if learning_rate is None:
        # The softmax cross entropy's Hessian in the logits is <= I/2, and the centred features
        # are orthogonal to the bias column, so L = max(lambda_max(Z^T Z / N), 1) / 2 + l2.
        lipschitz = 0.5 * max(1.1 * _top_eigenvalue(z_train, seed=seed), 1.0) + l2
        learning_rate = 1.0 / lipschitz

    d = x.shape[1]
    w = np.zeros((d, n), np.float32)  # [D, n]
    b = np.zeros(n, np.float32)  # [n]
    w_prev, b_prev = w, b
    best = (math.inf, w, b, 0)
    stale, epoch = 0, 0
    for epoch in range(1, epochs + 1):
        momentum = (epoch - 1) / (epoch + 2)
        w_look = w + momentum * (w - w_prev)  # Nesterov look-ahead point
        b_look = b + momentum * (b - b_prev)
        g = _softmax(z_train @ w_look + b_look)  # [Nt, n]
        g -= one_hot
        g /= len(y_train)
        grad_w = z_train.T @ g + l2 * w_look  # [D, n]
        grad_b = g.sum(axis=0)  # [n]
        w_prev, b_prev = w, b
        w = w_look - learning_rate * grad_w
        b = b_look - learning_rate * grad_b
        if len(y_val) == 0:
            best = (math.nan, w, b, epoch)
            continue
        val_loss = _cross_entropy(z_val @ w + b, y_val)
        if val_loss < best[0] - 1e-6:
            best, stale = (val_loss, w, b, epoch), 0
        else:
            stale += 1
            if stale >= patience:
                break
    val_loss, w, b, best_epoch = best

    def accuracy(z: np.ndarray, t: np.ndarray) -> float:
        return float(np.mean(np.argmax(z @ w + b, axis=1) == t)) if len(t) else math.nan

    pred_val = np.argmax(z_val @ w + b, axis=1) if len(y_val) else np.zeros(0, np.int64)
    per_class, per_count = {}, {}
    for c, label in enumerate(labels):
        mask = y_val == c
        per_count[label] = int(mask.sum())
        per_class[label] = float(np.mean(pred_val[mask] == c)) if mask.any() else math.nan

    # Fold the standardisation in: ((x - mu) / sd) @ W + b == x @ (W / sd) + (b - (mu / sd) @ W).
    w64 = w.astype(np.float64)
    weights = (w64 / sd[:, None]).astype(np.float32)  # [D, n]
    biases = (b.astype(np.float64) - (mu / sd) @ w64).astype(np.float32)  # [n]
    return TrainResult(
        labels=labels, weights=weights, biases=biases,
        val_accuracy=accuracy(z_val, y_val), per_class_val_accuracy=per_class,
        per_class_val_count=per_count, train_accuracy=accuracy(z_train, y_train),
        val_loss=val_loss, best_epoch=best_epoch, epochs_run=epoch,
        n_train=len(y_train), n_val=len(y_val),
    )
