"""The bots of a directory store: its SQLite registry's rows (`store.directory.registry`), each
write holding the registry's writer lock (an flock across processes) from its first check to
its commit, with the version directories (`store.directory.blobs`) written and deleted under
the same lock."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from accounts.candidates import CandidateInfo, CandidateMode, required_candidate
from accounts.errors import BotOwnedElsewhere, UnknownTenant
from accounts.tenants import DEFAULT_TENANT, OPERATOR, TenantLimits, utc_now
from heads.errors import UnknownBot
from store.bots import BotRow, Bots, Step, VersionRow
from store.directory.blobs import DirectoryBlobs
from store.directory.registry import Registry, Transaction


class DirectoryBots(Bots):
    """The registry rows of a directory store; the blobs are `blobs`'."""

    def __init__(self, registry: Registry, blobs: DirectoryBlobs) -> None:
        self._registry = registry
        self._blobs = blobs

    # -- reads ------------------------------------------------------------------------------------

    def active_map(self) -> dict[str, tuple[int, str]]:
        return self._registry.active_map()

    def candidates(self, bot_id: str | None = None) -> dict[str, CandidateInfo]:
        return self._registry.candidates(bot_id)

    def rows(self, bot_id: str | None = None) -> list[BotRow]:
        return [dataclasses.replace(row, versions=self._blobs.stored(row.active.bot_id,
                                                                     row.versions))
                for row in self._registry.rows(bot_id)]

    def history(self, bot_id: str) -> list[dict]:
        return self._registry.history(bot_id)

    # -- writes -----------------------------------------------------------------------------------

    def add_version(self, bot_id: str, weights: np.ndarray, biases: np.ndarray,
                    labels: tuple[str, ...], source: str, step: Step, *,
                    tenant: str = DEFAULT_TENANT, actor: str = OPERATOR,
                    candidate: CandidateMode | None = None,
                    defaults: TenantLimits | None = None) -> int:
        blobs = self._blobs
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
            registered = tx.versions(bot_id)
            left = blobs.sweep(bot_id, set(registered))
            version = 1 + max([tx.max_version_ever(bot_id), *registered, *left])
            live = self._live_candidate(tx, bot_id, previous) if previous is not None else None
            pruned = tx.rows.storage_plan(
                tenant, bot_id, version=version, n_classes=int(weights.shape[1]),
                previous=previous, candidate=None if live is None else live[0],
                as_candidate=candidate is not None, defaults=defaults)
            note = f"; pruned {', '.join(f'v{v}' for v in pruned)}" if pruned else ""
            created = utc_now()
            digest = blobs.write(tx, bot_id, version, weights, biases, labels, created=created,
                                 source=source, step=step)
            try:
                tx.add_version(VersionRow(bot_id, version, int(weights.shape[1]), labels,
                                          created, source), at=created,
                               active=candidate is None)
                for old in pruned:
                    tx.delete_version(bot_id, old)
                if candidate is None:
                    tx.rows.set_owner(bot_id, tenant)
                    tx.rows.record(at=created, actor=actor,
                                   action="register" if previous is None else "replace",
                                   tenant=tenant, bot_id=bot_id, version=version,
                                   digest=digest, detail=source + note)
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
                                   digest=digest, detail=f"{candidate}, {source}{note}")
                step("rows_added")
            except BaseException:
                blobs.drop(bot_id, version)
                raise
            # Committed (leaving the lock commits): no row points to these (numbers are never
            # reused); a crash before leaves files that the next registration sweeps.
            tx.commit()
            for old in pruned:
                blobs.drop(bot_id, old)
            if replaced is not None:
                blobs.drop(bot_id, replaced[0])
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
                           digest=self._blobs.digest(tx, bot_id, version),
                           detail=f"{mode}, from v{active}")
        return active, version

    def discard(self, bot_id: str, *, actor: str = OPERATOR) -> int:
        with self._registry.write() as tx:
            active, version, mode = self._required_candidate(tx, bot_id)
            at = utc_now()
            digest = self._blobs.digest(tx, bot_id, version)
            tx.discard(bot_id, version, at=at)
            tx.rows.record(at=at, actor=actor, action="candidate_discard",
                           tenant=tx.rows.owner(bot_id), bot_id=bot_id, version=version,
                           digest=digest, detail=str(mode))
        self._blobs.drop(bot_id, version)
        return version

    def remove(self, bot_id: str, *, actor: str = OPERATOR) -> None:
        with self._registry.write() as tx:
            if tx.active_version(bot_id) is None:
                raise UnknownBot(bot_id)
            self.unregister(tx, bot_id, utc_now(), actor)
            tx.commit()
            # Still under the writer lock, so no registration of the same id can interleave;
            # a crash here leaves files no row points to, swept by its next registration.
            self._blobs.drop(bot_id)

    def unregister(self, tx: Transaction, bot_id: str, at: str, actor: str) -> None:
        """The rows of live bot `bot_id` go, audited "remove", in write transaction `tx` (its
        files go once `tx` has committed: `DirectoryBlobs.drop`). Also the accounts part's,
        for a tenant removed with its bots."""
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
            target = choose(active, [v for v in self._blobs.stored(bot_id, tx.versions(bot_id))
                                     if candidate is None or v != candidate[0]])
            if target != active:
                at = utc_now()
                tx.set_active(bot_id, target, at=at)
                tx.rows.record(at=at, actor=actor, action="rollback",
                               tenant=tx.rows.owner(bot_id), bot_id=bot_id, version=target,
                               digest=self._blobs.digest(tx, bot_id, target),
                               detail=f"from v{active}")
        return target
