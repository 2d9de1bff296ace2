"""The bots part of a store backend: the registry of bots and their versions.

Which versions each bot has, which one is active, which tenant owns it, its candidate, and the
history of all of it. Rows only: the tensors and labels of a version are the blobs part's
(`store.blobs`), written and deleted by the same transactions. Every write here is ONE
transaction of the backend: the registry rows, the blobs, the owner row and the audit record
(`accounts.rows`) commit together or not at all, and a bot's version numbers are never reused
(also after its removal).

Also here: what `HeadStore` answers about a bot (`BotInfo`), and the rule both backends apply
to a rollback (`rollback_target`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from accounts.candidates import CandidateInfo, CandidateMode
from accounts.tenants import DEFAULT_TENANT, OPERATOR, TenantLimits
from store.errors import UnknownVersion

# A registration step name, handed to the test seam `store.front._fault_hook`.
Step = Callable[[str], None]


@dataclass(frozen=True)
class VersionRow:
    """One committed version of one bot, as the registry keeps it."""

    bot_id: str
    version: int
    n_classes: int
    labels: tuple[str, ...]
    created: str
    source: str


@dataclass(frozen=True)
class BotRow:
    """One live bot as the registry keeps it: its active version's row, every version whose
    blobs are stored (ascending; a candidate's included), and the tenant that owns it."""

    active: VersionRow
    versions: list[int]
    tenant: str


@dataclass(frozen=True)
class BotInfo(VersionRow):
    """What the registry knows about one bot: its active version's row, plus every version
    still stored (ascending) that can be made active (its candidate's is not one of them), the
    tenant that owns it, and its candidate (None if it has none)."""

    versions: list[int] = field(hash=False, default_factory=list)
    tenant: str = DEFAULT_TENANT
    candidate: CandidateInfo | None = None

    def to_dict(self, *, with_source: bool = True, with_candidate: bool = True) -> dict:
        """JSON-ready fields. `with_source=False` for public answers: a training source is a
        path on the server. `with_candidate=False` leaves the candidate out (a caller that may
        not manage the bot)."""
        out = {"bot_id": self.bot_id, "version": self.version, "n_classes": self.n_classes,
               "labels": list(self.labels), "created": self.created,
               "versions": list(self.versions), "tenant": self.tenant}
        if with_source:
            out["source"] = self.source
        if with_candidate:
            out["candidate"] = (None if self.candidate is None
                                else self.candidate.to_dict(with_source=with_source))
        return out

    @classmethod
    def of(cls, row: BotRow, candidate: CandidateInfo | None = None) -> BotInfo:
        """The info of a bot from its registry row and its candidate (read apart)."""
        active = row.active
        if candidate is not None and candidate.version == active.version:
            candidate = None  # promoted between the two reads
        skip = candidate.version if candidate is not None else None
        return cls(active.bot_id, active.version, active.n_classes, active.labels,
                   active.created, active.source, [v for v in row.versions if v != skip],
                   row.tenant, candidate)


def rollback_target(bot_id: str, active: int, versions: list[int], to: int | None) -> int:
    """The version a rollback of `bot_id` activates: `to` if it is one of `versions` (the
    stored ones but a candidate's), else the highest below `active` if `to` is None.
    Raises UnknownVersion."""
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


class Bots(ABC):
    """The registry rows of one store's bots. Thread-safe; every method may block on I/O.

    Reads take one consistent view each; writes are serialised across every process that has
    the store open (the directory's writer lock, PostgreSQL's `state` row).
    """

    # -- reads ------------------------------------------------------------------------------------

    @abstractmethod
    def active_map(self) -> dict[str, tuple[int, str]]:
        """{bot id: (active version, owner tenant)}, read now (one snapshot)."""

    @abstractmethod
    def candidates(self, bot_id: str | None = None) -> dict[str, CandidateInfo]:
        """{bot id: its candidate} of every live bot that has one (only `bot_id`'s if given),
        read now (one snapshot)."""

    @abstractmethod
    def rows(self, bot_id: str | None = None) -> list[BotRow]:
        """Every live bot ordered by id (byte order); only `bot_id`'s if given. The versions
        include a candidate's (`HeadStore` leaves it out of `BotInfo.versions`)."""

    @abstractmethod
    def history(self, bot_id: str) -> list[dict]:
        """Registrations, rollbacks and removals of `bot_id`, oldest first: dicts with
        action, version, previous, at, source."""

    # -- writes: one transaction each, audited --------------------------------------------------

    @abstractmethod
    def add_version(self, bot_id: str, weights: np.ndarray, biases: np.ndarray,
                    labels: tuple[str, ...], source: str, step: Step, *,
                    tenant: str = DEFAULT_TENANT, actor: str = OPERATOR,
                    candidate: CandidateMode | None = None,
                    defaults: TenantLimits | None = None) -> int:
        """Store a new version (already validated: rows and blobs) and make it active, owned by
        `tenant`, with its audit record ("register" or "replace"), in one transaction; call
        `step(name)` between the steps. Returns the new version number.

        With `candidate`, the version is stored as the bot's candidate instead (history
        "candidate", audit "candidate_add"); a candidate the bot had is discarded in the same
        transaction (its version deleted, audit "candidate_discard").

        The tenant's storage limits (its own, else `defaults`: the serve defaults) hold in the
        same transaction (`accounts.rows.Rows.storage_plan`): past max_bots or max_head_bytes
        nothing is written; past max_versions the oldest versions but the active one, the
        candidate, the previous active one and the rollback target are deleted with their
        blobs (`accounts.tenants.versions_to_prune`; the audit record's detail ends
        "; pruned v1, v2").

        Raises (before writing anything):
            UnknownTenant: no such tenant. BotOwnedElsewhere: the bot is live under another.
            UnknownBot: a candidate for a bot that is not live. TenantLimitExceeded.
        """

    @abstractmethod
    def promote(self, bot_id: str, *, actor: str = OPERATOR) -> tuple[int, int]:
        """The candidate becomes the active version (history "promote", audit
        "candidate_promote"); the previous active version stays stored. Returns (previous
        active version, new active version). Raises UnknownBot, NoCandidate."""

    @abstractmethod
    def discard(self, bot_id: str, *, actor: str = OPERATOR) -> int:
        """The candidate and its version are deleted (history "discard", audit
        "candidate_discard"). Returns its version. Raises UnknownBot, NoCandidate."""

    @abstractmethod
    def remove(self, bot_id: str, *, actor: str = OPERATOR) -> None:
        """Unregister `bot_id` and delete its versions (audited). Raises UnknownBot."""

    @abstractmethod
    def rollback(self, bot_id: str, choose: Callable[[int, list[int]], int], *,
                 actor: str = OPERATOR) -> int:
        """`target = choose(active, stored versions but the candidate's)` (which may raise),
        made active if it differs (audited). Returns target. Raises UnknownBot."""
