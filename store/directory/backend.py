"""The directory backend (the default, for one machine): SQLite registry + head files.

Layout of a store directory (default `checkpoints/`):

    <root>/registry.sqlite           bot_id -> active version, versions, history (WAL)
    <root>/registry.lock             flock serialising writers across processes
    <root>/heads/<bot_id>/v<N>/      one immutable head version (see `heads.files`)
    <root>/trunk/                    the trunk checkpoint (not ours)

A registration, holding the writer lock: writes the files into `heads/<bot_id>/.tmp-*`, fsyncs
them, renames the directory to `v<N>`, fsyncs the parent, and only then commits the registry
row. A crash before the commit leaves an unreferenced directory that no reader ever sees and
that the next registration of that bot sweeps away; version numbers are never reused.
Nothing is created on disk until the first write.
"""
from __future__ import annotations

import os
import re
import shutil
import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from accounts.candidates import CandidateInfo, CandidateMode, required_candidate
from accounts.errors import BotOwnedElsewhere, UnknownKey, UnknownTenant
from accounts.tenants import (
    DEFAULT_TENANT,
    OPERATOR,
    ApiKey,
    AuditRecord,
    TenantInfo,
    TenantLimits,
    combine_digests,
    utc_now,
)
from heads import files
from heads.errors import HeadLoadError, UnknownBot
from heads.head import Head
from store.backend import SQLITE, Step, StoreBackend, VersionRow
from store.directory.registry import Registry, Transaction

REGISTRY_NAME = "registry.sqlite"
LOCK_NAME = "registry.lock"
HEADS_DIR = "heads"
_VERSION_DIR_RE = re.compile(r"v([1-9][0-9]*)")
_TMP_PREFIX = ".tmp-"


class DirectoryBackend(StoreBackend):
    """A store directory: `registry.sqlite` plus `heads/<bot_id>/v<N>/` version directories."""

    kind = SQLITE
    # NOTE: a locked or failing registry must not make every bot unknown.
    read_errors = (sqlite3.OperationalError,)

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.heads_dir = self.root / HEADS_DIR
        self._registry = Registry(self.root / REGISTRY_NAME, self.root / LOCK_NAME)

    def describe(self) -> str:
        return str(self.root)

    def _version_dir(self, bot_id: str, version: int) -> Path:
        return self.heads_dir / bot_id / f"v{version}"

    # -- reading -----------------------------------------------------------------------------

    def data_version(self) -> object:
        # `PRAGMA data_version`: changes whenever another connection committed.
        return self._registry.data_version()

    def active_map(self) -> dict[str, tuple[int, str]]:
        return self._registry.active_map()

    def load(self, bot_id: str, version: int) -> Head:
        return files.load_version_dir(self._version_dir(bot_id, version), bot_id, version)

    def snapshot(self, bot_id: str | None = None
                 ) -> list[tuple[int, VersionRow, list[int], str]]:
        return [(active, row, self._on_disk(row.bot_id, versions), tenant)
                for active, row, versions, tenant in self._registry.snapshot(bot_id)]

    def history(self, bot_id: str) -> list[dict]:
        return self._registry.history(bot_id)

    def candidates(self, bot_id: str | None = None) -> dict[str, CandidateInfo]:
        return self._registry.candidates(bot_id)

    def _on_disk(self, bot_id: str, versions: list[int]) -> list[int]:
        return [v for v in versions if self._version_dir(bot_id, v).is_dir()]

    # -- writing -----------------------------------------------------------------------------

    def add_version(self, bot_id: str, weights: np.ndarray, biases: np.ndarray,
                    labels: tuple[str, ...], source: str, step: Step, *,
                    tenant: str = DEFAULT_TENANT, actor: str = OPERATOR,
                    candidate: CandidateMode | None = None) -> int:
        bot_dir = self.heads_dir / bot_id
        replaced = None  # the candidate a new one replaces: its files go after the commit
        with self._registry.write() as tx:
            # Refusals first: nothing written.
            if not tx.rows.tenant_exists(tenant):
                raise UnknownTenant(tenant)
            previous = tx.active_version(bot_id)
            if candidate is not None and previous is None:
                raise UnknownBot(bot_id)  # a candidate is a candidate to a live version
            if previous is not None and tx.rows.owner(bot_id) != tenant:
                raise BotOwnedElsewhere(bot_id)
            new_heads_dir = not self.heads_dir.exists()
            bot_dir.mkdir(parents=True, exist_ok=True)
            if new_heads_dir:
                files.fsync_dir(self.root)
            registered = set(tx.versions(bot_id))
            on_disk = self._sweep(bot_dir, keep=registered)
            version = 1 + max([tx.max_version_ever(bot_id), *registered, *on_disk])
            created = utc_now()
            tmp = bot_dir / f"{_TMP_PREFIX}v{version}-{uuid.uuid4().hex[:8]}"
            final = self._version_dir(bot_id, version)
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
                digest = combine_digests(manifest["files"])
                tx.add_version(VersionRow(bot_id, version, int(weights.shape[1]), labels,
                                          created, source), at=created,
                               active=candidate is None)
                if candidate is None:
                    tx.rows.set_owner(bot_id, tenant)
                    tx.rows.record(at=created, actor=actor,
                                   action="register" if previous is None else "replace",
                                   tenant=tenant, bot_id=bot_id, version=version,
                                   digest=digest, detail=source)
                else:
                    replaced = self._live_candidate(tx, bot_id, previous)
                    if replaced is not None:
                        tx.discard(bot_id, replaced[0], at=created)
                        tx.rows.record(at=created, actor=actor, action="candidate_discard",
                                       tenant=tenant, bot_id=bot_id, version=replaced[0],
                                       detail=f"{replaced[1]}, replaced by v{version}")
                    tx.set_candidate(bot_id, version, candidate, at=created)
                    tx.rows.record(at=created, actor=actor, action="candidate_add",
                                   tenant=tenant, bot_id=bot_id, version=version,
                                   digest=digest, detail=f"{candidate}, {source}")
                step("rows_added")
            except BaseException:
                shutil.rmtree(final if renamed else tmp, ignore_errors=True)
                raise
        if replaced is not None:  # committed: no row points to it (numbers are never reused)
            shutil.rmtree(self._version_dir(bot_id, replaced[0]), ignore_errors=True)
        return version

    @staticmethod
    def _live_candidate(tx: Transaction, bot_id: str,
                        active: int | None) -> tuple[int, CandidateMode] | None:
        """The bot's candidate, or None (also for a row naming the active version, which a
        build without candidates may leave after rolling back to it: never deleted)."""
        found = tx.candidate(bot_id)
        return found if found is not None and found[0] != active else None

    @classmethod
    def _required_candidate(cls, tx: Transaction, bot_id: str
                            ) -> tuple[int, int, CandidateMode]:
        return required_candidate(bot_id, tx.active_version(bot_id),
                                  lambda active: cls._live_candidate(tx, bot_id, active))

    def promote(self, bot_id: str, *, actor: str = OPERATOR) -> tuple[int, int]:
        with self._registry.write() as tx:
            active, version, mode = self._required_candidate(tx, bot_id)
            at = utc_now()
            tx.promote(bot_id, version, at=at)
            tx.rows.record(at=at, actor=actor, action="candidate_promote",
                           tenant=tx.rows.owner(bot_id), bot_id=bot_id, version=version,
                           digest=self._digest(bot_id, version),
                           detail=f"{mode}, from v{active}")
        return active, version

    def discard(self, bot_id: str, *, actor: str = OPERATOR) -> int:
        with self._registry.write() as tx:
            active, version, mode = self._required_candidate(tx, bot_id)
            at = utc_now()
            digest = self._digest(bot_id, version)
            tx.discard(bot_id, version, at=at)
            tx.rows.record(at=at, actor=actor, action="candidate_discard",
                           tenant=tx.rows.owner(bot_id), bot_id=bot_id, version=version,
                           digest=digest, detail=str(mode))
        shutil.rmtree(self._version_dir(bot_id, version), ignore_errors=True)
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

    def remove(self, bot_id: str, *, actor: str = OPERATOR) -> None:
        with self._registry.write() as tx:
            if tx.active_version(bot_id) is None:
                raise UnknownBot(bot_id)
            self._remove_bot(tx, bot_id, utc_now(), actor)
            tx.commit()
            # Still under the writer lock, so no registration of the same id can interleave;
            # a crash here leaves files no row points to, swept by its next registration.
            shutil.rmtree(self.heads_dir / bot_id, ignore_errors=True)

    @staticmethod
    def _remove_bot(tx: Transaction, bot_id: str, at: str, actor: str) -> None:
        active, tenant = tx.active_version(bot_id), tx.rows.owner(bot_id)
        tx.delete_bot(bot_id, at=at)
        tx.rows.delete_owner(bot_id)
        tx.rows.record(at=at, actor=actor, action="remove", tenant=tenant, bot_id=bot_id,
                       version=active)

    def rollback(self, bot_id: str, choose: Callable[[int, list[int]], int], *,
                 actor: str = OPERATOR) -> int:
        with self._registry.write() as tx:
            active = tx.active_version(bot_id)
            if active is None:
                raise UnknownBot(bot_id)
            candidate = self._live_candidate(tx, bot_id, active)
            target = choose(active, [v for v in self._on_disk(bot_id, tx.versions(bot_id))
                                     if candidate is None or v != candidate[0]])
            if target != active:
                at = utc_now()
                tx.set_active(bot_id, target, at=at)
                tx.rows.record(at=at, actor=actor, action="rollback",
                               tenant=tx.rows.owner(bot_id), bot_id=bot_id, version=target,
                               digest=self._digest(bot_id, target), detail=f"from v{active}")
        return target

    def _digest(self, bot_id: str, version: int) -> str | None:
        """The audit digest of a stored version (None if its manifest is unreadable)."""
        try:
            return combine_digests(files.read_manifest(self._version_dir(bot_id, version))
                                   ["files"])
        except HeadLoadError:
            return None

    # -- tenants, keys, audit ------------------------------------------------------------------

    def add_tenant(self, name: str, *, actor: str,
                   limits: TenantLimits | None = None) -> TenantInfo:
        with self._registry.write() as tx:
            return tx.rows.create_tenant(name, actor, limits)

    def tenants(self) -> list[TenantInfo]:
        with self._registry.reading() as rows:
            return rows.tenants() if rows is not None else [TenantInfo(DEFAULT_TENANT, None, 0)]

    def set_limits(self, name: str, changes: dict, *, actor: str) -> TenantLimits:
        with self._registry.write() as tx:
            return tx.rows.set_limits(name, changes, actor)

    def tenant_limits(self) -> dict[str, TenantLimits]:
        with self._registry.reading() as rows:
            return rows.tenant_limits() if rows is not None \
                else {DEFAULT_TENANT: TenantLimits()}

    def remove_tenant(self, name: str, *, force: bool, actor: str) -> None:
        with self._registry.write() as tx:
            bots = tx.rows.drop_tenant(
                name, force=force, actor=actor,
                remove_bot=lambda bot_id, at: self._remove_bot(tx, bot_id, at, actor))
            tx.commit()
            for bot_id in bots:  # as in remove: under the writer lock, after the commit
                shutil.rmtree(self.heads_dir / bot_id, ignore_errors=True)

    def add_key(self, key: ApiKey, *, actor: str) -> None:
        with self._registry.write() as tx:
            tx.rows.create_key(key, actor)

    def keys(self, tenant: str | None = None, *, live_only: bool = False) -> list[ApiKey]:
        with self._registry.reading() as rows:
            return rows.keys(tenant, live_only=live_only) if rows is not None else []

    def revoke_key(self, key_id: str, *, actor: str) -> ApiKey:
        with self._registry.reading() as rows:  # an unknown or revoked key: no write
            key = rows.key(key_id) if rows is not None else None
        if key is None:
            raise UnknownKey(key_id)
        if key.revoked is not None:
            return key
        with self._registry.write() as tx:
            return tx.rows.revoke(key_id, actor)

    def mark_used(self, used: dict[str, str]) -> None:
        with self._registry.reading() as rows:
            if rows is None:
                return  # no registry: no keys
        with self._registry.write() as tx:
            tx.rows.mark_used(used)

    def audit(self, *, tenant: str | None, since: str | None, limit: int) -> list[AuditRecord]:
        with self._registry.reading() as rows:
            return rows.audit(tenant=tenant, since=since, limit=limit) if rows is not None \
                else []

    def close(self) -> None:
        self._registry.close()
