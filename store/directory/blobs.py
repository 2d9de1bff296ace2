"""The blobs of a directory store: one immutable directory per version.

    <root>/heads/<bot_id>/v<N>/      TF checkpoint, labels, manifest with sha256s (`heads.files`)

A new version is written into `heads/<bot_id>/.tmp-*`, fsynced, and renamed to `v<N>` (then
the parent is fsynced), all under the registry's writer lock and before its rows commit. A
crash before the commit leaves a directory no row points to, which no reader ever sees and
which the bot's next registration sweeps away (`sweep`).
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np

from accounts.tenants import combine_digests
from heads import files
from heads.errors import HeadLoadError
from heads.head import Head
from store.blobs import Blobs
from store.bots import Step
from store.directory.registry import Transaction

HEADS_DIR = "heads"
_VERSION_DIR_RE = re.compile(r"v([1-9][0-9]*)")
_TMP_PREFIX = ".tmp-"


class DirectoryBlobs(Blobs[Transaction]):
    """The version directories under `<root>/heads/`. Nothing is created until the first
    write."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.heads_dir = self.root / HEADS_DIR

    def version_dir(self, bot_id: str, version: int) -> Path:
        return self.heads_dir / bot_id / f"v{version}"

    def load(self, bot_id: str, version: int) -> Head:
        return files.load_version_dir(self.version_dir(bot_id, version), bot_id, version)

    def write(self, tx: Transaction, bot_id: str, version: int, weights: np.ndarray,
              biases: np.ndarray, labels: tuple[str, ...], *, created: str, source: str,
              step: Step) -> str:
        bot_dir = self.heads_dir / bot_id
        new_heads_dir = not self.heads_dir.exists()
        bot_dir.mkdir(parents=True, exist_ok=True)
        if new_heads_dir:
            files.fsync_dir(self.root)
        tmp = bot_dir / f"{_TMP_PREFIX}v{version}-{uuid.uuid4().hex[:8]}"
        final = self.version_dir(bot_id, version)
        tmp.mkdir()
        renamed = False
        try:
            manifest = files.write_version_dir(
                tmp, bot_id=bot_id, version=version, weights=weights, biases=biases,
                labels=labels, created=created, source=source)
            step("written")
            os.rename(tmp, final)  # atomic; fails if `final` exists
            renamed = True
            files.fsync_dir(bot_dir)
            step("renamed")
        except BaseException:
            shutil.rmtree(final if renamed else tmp, ignore_errors=True)
            raise
        return combine_digests(manifest["files"])

    def digest(self, tx: Transaction, bot_id: str, version: int) -> str | None:
        try:
            return combine_digests(files.read_manifest(self.version_dir(bot_id, version))
                                   ["files"])
        except HeadLoadError:
            return None

    def stored(self, bot_id: str, versions: list[int]) -> list[int]:
        return [v for v in versions if self.version_dir(bot_id, v).is_dir()]

    def sweep(self, bot_id: str, registered: set[int]) -> list[int]:
        bot_dir = self.heads_dir / bot_id
        if not bot_dir.is_dir():
            return []
        left = []
        for entry in bot_dir.iterdir():
            m = _VERSION_DIR_RE.fullmatch(entry.name)
            if m is not None and int(m.group(1)) in registered:
                left.append(int(m.group(1)))
            elif m is not None or entry.name.startswith(_TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
        return left

    def drop(self, bot_id: str, version: int | None = None) -> None:
        shutil.rmtree(self.heads_dir / bot_id if version is None
                      else self.version_dir(bot_id, version), ignore_errors=True)
