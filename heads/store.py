"""`HeadStore`: registered bots on disk, the registry, and the resident cache of heads.

Layout of a store (default `checkpoints/`):

    <root>/registry.sqlite           bot_id -> active version, versions, history (WAL)
    <root>/registry.lock             flock serialising writers across processes
    <root>/heads/<bot_id>/v<N>/      one immutable head version (see `heads.files`)
    <root>/trunk/                    the trunk checkpoint (not ours)

A registration validates everything first (a refusal touches nothing), then, holding the
writer lock: writes the files into `heads/<bot_id>/.tmp-*`, fsyncs them, renames the directory
to `v<N>`, fsyncs the parent, and only then commits the registry row. A crash before the commit
leaves an unreferenced directory that no reader ever sees and that the next registration of
that bot sweeps away; version numbers are never reused.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from heads import files
from heads.cache import HeadCache
from heads.errors import HeadLoadError, InvalidHead, TrunkMismatch, UnknownBot, UnknownVersion
from heads.head import Head, validate_bot_id, validate_head_arrays, validate_labels
from heads.registry import Registry, VersionRow

log = logging.getLogger(__name__)

REGISTRY_NAME = "registry.sqlite"
LOCK_NAME = "registry.lock"
HEADS_DIR = "heads"
_VERSION_DIR_RE = re.compile(r"v([1-9][0-9]*)")
_TMP_PREFIX = ".tmp-"

# NOTE: a test seam. Called with the name of each registration step ("written", "renamed",
# "rows_added") so tests can simulate a crash (`os._exit`) or a failure between steps.
_fault_hook: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class BotInfo(VersionRow):
    """What the registry knows about one bot: its active version's row, plus every version
    still on disk (ascending)."""

    versions: list[int] = field(hash=False, default_factory=list)

    def to_dict(self, *, with_source: bool = True) -> dict:
        """JSON-ready fields. `with_source=False` for public answers: a training source is a
        path on the server."""
        out = {"bot_id": self.bot_id, "version": self.version, "n_classes": self.n_classes,
               "labels": list(self.labels), "created": self.created,
               "versions": list(self.versions)}
        if with_source:
            out["source"] = self.source
        return out


def _labels_arg(labels) -> tuple[str, ...]:
    """Labels given as a sequence, or as the path of a labels file (str or PathLike)."""
    if isinstance(labels, (str, os.PathLike)):
        return files.read_labels(labels)
    return validate_labels(labels)


class HeadStore:
    """The bots of one store: registration, lookup with a resident LRU, and change detection.

    Thread-safe: the event loop, the batch thread and executor threads may call it concurrently.
    Several processes may open the same store; writes are serialised, and each reader notices a
    change committed elsewhere within `change_poll_s` (+ one `get`) through
    `PRAGMA data_version`, without re-reading any file.

    Args:
        root: the store directory. Nothing is created in it until the first write.
        heads_memory_mb: byte budget (MiB) of resident heads (default: about 3,400 heads of
            100 classes); least recently used unpinned
            heads are evicted beyond it. A 100-class head takes about 0.6 MiB.
        pinned: bot ids whose heads, once loaded, are never evicted.
    """

    change_poll_s = 0.25

    def __init__(self, root: str | os.PathLike, *, heads_memory_mb: float = 2048.0,
                 pinned: Iterable[str] = ()) -> None:
        if not heads_memory_mb >= 0:
            raise ValueError("heads_memory_mb must be >= 0")
        self.root = Path(root)
        self.heads_dir = self.root / HEADS_DIR
        self._registry = Registry(self.root / REGISTRY_NAME, self.root / LOCK_NAME)
        pinned = frozenset(validate_bot_id(b) for b in pinned)
        self._cache = HeadCache(int(heads_memory_mb * 2**20), pinned)
        self._active: dict[str, int] = {}
        self._data_version: int | None | object = object()  # never equal: first call loads
        self._next_check_s = 0.0
        self._refresh_lock = threading.Lock()
        self._loads_lock = threading.Lock()
        self._loading: dict[tuple[str, int], threading.Lock] = {}

    @property
    def pinned(self) -> frozenset[str]:
        return self._cache.pinned

    # -- lookup (hot path) ---------------------------------------------------------------------

    def get(self, bot_id: str) -> Head:
        """The active head of `bot_id`, loaded on first use and kept resident (LRU).

        Raises:
            UnknownBot: no such bot (InvalidBotId if the id itself is malformed).
            HeadLoadError: its files are missing or corrupt.
        """
        self._refresh()
        version = self._active.get(bot_id)
        if version is None:
            validate_bot_id(bot_id)
            raise UnknownBot(bot_id)
        head = self._cache.get(bot_id, version)
        if head is not None:
            return head
        try:
            return self._load(bot_id, version)
        except HeadLoadError:
            # Removed or replaced by another process since our last check? Then say so.
            self._refresh(force=True)
            now = self._active.get(bot_id)
            if now is None:
                raise UnknownBot(bot_id) from None
            if now != version:
                return self._load(bot_id, now)
            raise

    def exists(self, bot_id: str) -> bool:
        """Whether `bot_id` is registered (cheap: no file access)."""
        self._refresh()
        return bot_id in self._active

    def _refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_check_s:
            return
        with self._refresh_lock:
            if not force and now < self._next_check_s:
                return  # another thread just checked
            try:
                version = self._registry.data_version()
                if force or version != self._data_version:
                    # Read the version before the rows: a commit in between is seen twice,
                    # never missed.
                    active = self._registry.active_map()
                    self._active = active
                    self._data_version = version
                    self._cache.retain(lambda h: active.get(h.bot_id) == h.version)
            except sqlite3.OperationalError as exc:
                # NOTE: a locked or failing registry must not make every bot unknown: keep
                # serving the last known state and read again at the next poll.
                log.warning("registry %s unreadable (%s): keeping the last known bots",
                            self._registry.db_path, exc)
            self._next_check_s = time.monotonic() + self.change_poll_s

    def _load(self, bot_id: str, version: int) -> Head:
        key = (bot_id, version)
        with self._loads_lock:
            lock = self._loading.setdefault(key, threading.Lock())
        try:
            with lock:  # one load per head at a time; the others wait and then hit the cache
                head = self._cache.peek(bot_id, version)
                if head is None:
                    head = files.load_version_dir(self._version_dir(bot_id, version), bot_id,
                                                  version)
                    self._cache.put(head)
                return head
        finally:
            with self._loads_lock:
                self._loading.pop(key, None)

    def _version_dir(self, bot_id: str, version: int) -> Path:
        return self.heads_dir / bot_id / f"v{version}"

    # -- registration --------------------------------------------------------------------------

    def register(self, bot_id: str, weights: np.ndarray, biases: np.ndarray, labels,
                 *, source: str = "api") -> int:
        """Register a new version of `bot_id` and make it active.

        Args:
            weights: [1536, n], biases: [n], n >= 2, all finite (cast to float32).
            labels: n class names, or the path of a labels file (one per line).
            source: free text recorded in the manifest and the history.
        Returns:
            The new version number.
        Raises:
            InvalidBotId, InvalidHead: before anything is written.
        """
        bot_id = validate_bot_id(bot_id)
        w, b, labels_t = validate_head_arrays(weights, biases, _labels_arg(labels))
        return self._add_version(bot_id, w, b, labels_t, " ".join(str(source).split()))

    def register_checkpoint(self, bot_id: str, prefix: str | os.PathLike, labels, *,
                            weights_name: str = files.WEIGHTS_KEY,
                            biases_name: str = files.BIASES_KEY,
                            source: str | None = None) -> int:
        """Register the head held by a TF checkpoint (tensors `weights_name`, `biases_name`)."""
        bot_id = validate_bot_id(bot_id)
        labels_t = _labels_arg(labels)
        w, b = files.read_checkpoint_tensors(prefix, [weights_name, biases_name])
        try:
            validate_head_arrays(w, b, labels_t)
        except InvalidHead as exc:
            raise InvalidHead(f"checkpoint '{os.fspath(prefix)}': {exc}") from None
        if source is None:
            source = f"checkpoint:{os.path.abspath(prefix)}"
        return self.register(bot_id, w, b, labels_t, source=source)

    def register_from_slim(self, bot_id: str, prefix: str | os.PathLike, labels, *,
                           serving_trunk_prefix: str | os.PathLike | None = None,
                           force: bool = False) -> int:
        """Import the classifier layer `InceptionV4/Logits/Logits` of a slim Inception-V4
        checkpoint (the official one, or one fine-tuned with any class count) as a head.

        With `serving_trunk_prefix`, the checkpoint's trunk is compared with the serving trunk
        (`backbone.trunk_digest`): every bot shares the serving trunk, so a checkpoint whose
        trunk was fine-tuned too would predict differently here than on its own.

        Raises:
            TrunkMismatch: the trunks differ and not `force`.
            HeadLoadError: not a checkpoint, or no Logits layer.
        """
        bot_id = validate_bot_id(bot_id)
        labels_t = _labels_arg(labels)
        prefix = os.fspath(prefix)
        w, b = files.read_checkpoint_tensors(prefix, [files.SLIM_WEIGHTS_KEY,
                                                      files.SLIM_BIASES_KEY])
        try:
            validate_head_arrays(w, b, labels_t)  # cheap refusals before hashing two trunks
        except InvalidHead as exc:
            raise InvalidHead(f"slim checkpoint '{prefix}': {exc}") from None
        source = f"slim:{os.path.abspath(prefix)}"
        if serving_trunk_prefix is not None:
            from backbone import trunk_digest

            theirs = trunk_digest(prefix)
            ours = trunk_digest(os.fspath(serving_trunk_prefix))
            if theirs != ours:
                if not force:
                    raise TrunkMismatch(
                        f"the trunk of '{prefix}' differs from the serving trunk "
                        f"'{os.fspath(serving_trunk_prefix)}' (digest {theirs[:12]} vs "
                        f"{ours[:12]}): that model's trunk was fine-tuned too, so bot "
                        f"'{bot_id}' would give different predictions from the original model; "
                        "use --force (force=True) to import its classifier layer anyway"
                    )
                source += f" (forced: trunk {theirs[:12]} differs from the serving trunk)"
        return self.register(bot_id, w, b, labels_t, source=source)

    def _add_version(self, bot_id: str, weights: np.ndarray, biases: np.ndarray,
                     labels: tuple[str, ...], source: str) -> int:
        bot_dir = self.heads_dir / bot_id
        with self._registry.write() as tx:
            new_heads_dir = not self.heads_dir.exists()
            bot_dir.mkdir(parents=True, exist_ok=True)
            if new_heads_dir:
                files.fsync_dir(self.root)
            registered = set(tx.versions(bot_id))
            on_disk = self._sweep(bot_dir, keep=registered)
            version = 1 + max([tx.max_version_ever(bot_id), *registered, *on_disk])
            created = _now()
            tmp = bot_dir / f"{_TMP_PREFIX}v{version}-{uuid.uuid4().hex[:8]}"
            final = self._version_dir(bot_id, version)
            tmp.mkdir()
            renamed = False
            try:
                files.write_version_dir(tmp, bot_id=bot_id, version=version, weights=weights,
                                        biases=biases, labels=labels, created=created,
                                        source=source)
                _step("written")
                os.rename(tmp, final)  # atomic; fails if `final` exists
                renamed = True
                files.fsync_dir(bot_dir)
                _step("renamed")
                tx.add_version(VersionRow(bot_id, version, int(weights.shape[1]), labels,
                                          created, source), at=created)
                _step("rows_added")
            except BaseException:
                shutil.rmtree(final if renamed else tmp, ignore_errors=True)
                raise
        self._refresh(force=True)  # read-your-writes in this process
        return version

    def _sweep(self, bot_dir: Path, keep: set[int]) -> list[int]:
        """Delete crash leftovers of `bot_dir` (temp dirs, unregistered versions); call it
        holding the writer lock. Returns the version numbers left on disk."""
        left = []
        for entry in bot_dir.iterdir():
            m = _VERSION_DIR_RE.fullmatch(entry.name)
            if m is not None and int(m.group(1)) in keep:
                left.append(int(m.group(1)))
            elif m is not None or entry.name.startswith(_TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
        return left

    # -- administration ------------------------------------------------------------------------

    def list(self) -> list[BotInfo]:
        """Every registered bot, ordered by id."""
        return [self._bot_info(active, row, versions)
                for active, row, versions in self._registry.snapshot()]

    def info(self, bot_id: str) -> BotInfo:
        """The registry's view of one bot. Raises UnknownBot."""
        bot_id = validate_bot_id(bot_id)
        rows = self._registry.snapshot(bot_id)
        if not rows:
            raise UnknownBot(bot_id)
        return self._bot_info(*rows[0])

    def history(self, bot_id: str) -> list[dict]:
        """Every registration, rollback and removal of `bot_id`, oldest first."""
        return self._registry.history(validate_bot_id(bot_id))

    def _bot_info(self, active: int, row: VersionRow, versions: list[int]) -> BotInfo:
        bot_dir = self.heads_dir / row.bot_id
        on_disk = [v for v in versions if (bot_dir / f"v{v}").is_dir()]
        return BotInfo(row.bot_id, active, row.n_classes, row.labels, row.created, row.source,
                       on_disk)

    def remove(self, bot_id: str) -> None:
        """Unregister `bot_id` and delete all its versions. Raises UnknownBot."""
        bot_id = validate_bot_id(bot_id)
        self.info(bot_id)  # refuse an unknown bot without opening a write transaction
        with self._registry.write() as tx:
            if tx.active_version(bot_id) is None:
                raise UnknownBot(bot_id)
            tx.delete_bot(bot_id, at=_now())
            tx.commit()
            # Still under the writer lock, so no registration of the same id can interleave;
            # a crash here leaves files no row points to, swept by its next registration.
            shutil.rmtree(self.heads_dir / bot_id, ignore_errors=True)
        self._refresh(force=True)

    def rollback(self, bot_id: str, to: int | None = None) -> int:
        """Make an earlier (or any other on-disk) version of `bot_id` active.

        Args:
            to: the version to activate; default: the highest version below the active one.
        Returns:
            The active version afterwards.
        Raises:
            UnknownBot, UnknownVersion.
        """
        bot_id = validate_bot_id(bot_id)
        if to is not None and (isinstance(to, bool) or not isinstance(to, (int, np.integer))):
            raise UnknownVersion(f"version must be an integer, got {to!r}")
        info = self.info(bot_id)
        self._rollback_target(bot_id, info.version, info.versions, to)  # refuse before writing
        with self._registry.write() as tx:
            active = tx.active_version(bot_id)
            if active is None:
                raise UnknownBot(bot_id)
            bot_dir = self.heads_dir / bot_id
            versions = [v for v in tx.versions(bot_id) if (bot_dir / f"v{v}").is_dir()]
            target = self._rollback_target(bot_id, active, versions, to)
            if target != active:
                tx.set_active(bot_id, target, at=_now())
        self._refresh(force=True)
        return target

    @staticmethod
    def _rollback_target(bot_id: str, active: int, versions: list[int], to: int | None) -> int:
        if to is None:
            older = [v for v in versions if v < active]
            if not older:
                raise UnknownVersion(f"bot '{bot_id}' has no version before v{active} "
                                     "to roll back to")
            return max(older)
        if int(to) not in versions:
            shown = ", ".join(str(v) for v in versions)
            raise UnknownVersion(f"bot '{bot_id}' has no version {int(to)} "
                                 f"(versions on disk: {shown})")
        return int(to)

    # -- housekeeping --------------------------------------------------------------------------

    def cache_stats(self) -> dict:
        """resident_heads, resident_bytes, hits, misses, evictions (and the budget, pins)."""
        return self._cache.stats()

    def close(self) -> None:
        """Close the registry connections and drop resident heads. Idempotent."""
        self._registry.close()
        self._cache.clear()

    def __enter__(self) -> HeadStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HeadStore({str(self.root)!r})"
