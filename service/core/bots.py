"""Bots at serving time: their active heads for a request, their registry view, their
candidates as a manager sees them, their agreement with the INT8 trunk (`Int8Agreement`), and
the changes a manager makes (register, remove, roll back, promote, discard), each off the event
loop. No access rule here: a call reaches this through `service.core.caller.Caller`, which
applies them."""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from accounts.tenants import OPERATOR as OPERATOR_ACTOR
from backbone.gate import agreement
from heads import Head, HeadLoadError, UnknownBot
from service.core.candidates import CandidateStats
from service.core.errors import HeadUnavailable
from service.core.threads import Threads
from store import BotInfo, HeadStore, StoreUnavailable

log = logging.getLogger(__name__)

# A /metrics scrape starts a refresh of the agreements (bots registered by another process)
# at most this often: each lists the store.
REFRESH_S = 10.0


def agreement_key(bot_id: str, version: int, created: str) -> str:
    """A head's name in an INT8 trunk's recorded agreements (`Int8Artifact.agreements`): its
    bot, version and registration time (a bot removed and registered again starts over at
    version 1, with other weights)."""
    return f"{bot_id}@v{version}@{created}"


class Int8Agreement:
    """Each bot's top-1 agreement between the INT8 and the float trunk of the serving
    checkpoint (`backbone.gate.agreement` on the held-out features its INT8 trunk keeps): one
    matmul per trunk, once per (bot, version), never on the request path.

    The bring-up judges every active bot (`judge`: the trunk's choice needs them); a version
    registered later is scored when first asked for (`of`: GET /bots/{id}, a registration
    through this process) or by the refresh a /metrics scrape starts (`refresh_soon`: bots
    registered by another process). Values are recorded beside the INT8 trunk
    (`Int8Artifact.record_agreements`), so a restart loads no head for them again.

    Args:
        store: the store whose active heads are judged.
    """

    def __init__(self, store: HeadStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._artifact = None
        self._held_out = None
        self._values: dict[str, float] = {}  # agreement_key -> agreement
        self._current: dict[str, float] = {}  # bot_id -> its active version's, last refresh
        self._refreshing = False
        self._refreshed_s = float("-inf")
        self._closed = False

    @property
    def artifact(self):
        """The INT8 trunk (`backbone.quantize.Int8Artifact`) bots are judged on, or None."""
        return self._artifact

    def attach(self, artifact) -> None:
        """Judges bots on `artifact` from now on (reads its held-out features and recorded
        agreements). Blocking: a worker thread."""
        held_out, recorded = artifact.held_out(), artifact.agreements()
        with self._lock:
            self._artifact, self._held_out = artifact, held_out
            self._values, self._current = recorded, {}

    def judge(self, artifact) -> dict[str, float]:
        """Every active bot's agreement on `artifact` (bot_id -> share): what
        `backbone.trunk.choose` asks (`HeadsAgreement`). Blocking: the bring-up's thread."""
        if artifact is not self._artifact:
            self.attach(artifact)
        return self.refresh()

    def refresh(self) -> dict[str, float]:
        """Scores the active versions not scored yet; returns bot_id -> agreement of every
        active bot (the ones that cannot be loaded left out, logged). Blocking."""
        if self._held_out is None:
            return {}
        new: dict[str, float] = {}
        out = {}
        for info in self._store.list():
            value = self._value(info.bot_id, info.version, info.created, new)
            if value is not None:
                out[info.bot_id] = value
        self._record(new)
        with self._lock:
            self._current = out
        return dict(out)

    def of(self, info: BotInfo) -> float | None:
        """The agreement of a bot's active version (`info`, as the registry just gave it),
        scored now if it was not; None without an INT8 trunk, if its head cannot be loaded, or
        while the heads lookup does not know the version yet (registered elsewhere within the
        store's poll interval). Blocking: a lookup thread."""
        if self._held_out is None:
            return None
        new: dict[str, float] = {}
        value = self._value(info.bot_id, info.version, info.created, new)
        self._record(new)
        if value is not None:
            with self._lock:
                self._current[info.bot_id] = value  # /metrics shows it before a refresh
        return value

    def current(self) -> dict[str, float]:
        """bot_id -> agreement of the active bots as of the last refresh (memory only: what
        /metrics shows)."""
        with self._lock:
            return dict(self._current)

    def refresh_soon(self) -> None:
        """Starts a refresh in a thread of its own unless one runs or one ran in the last
        `REFRESH_S` (called at each /metrics scrape, which must not wait for it)."""
        with self._lock:
            now = time.monotonic()
            if (self._closed or self._held_out is None or self._refreshing
                    or now - self._refreshed_s < REFRESH_S):
                return
            self._refreshing, self._refreshed_s = True, now
        threading.Thread(target=self._refresh_quietly, name="multihead-int8-agreement",
                         daemon=True).start()

    def close(self) -> None:
        """No refresh starts after this (the store is closing)."""
        with self._lock:
            self._closed = True

    def _refresh_quietly(self) -> None:
        try:
            self.refresh()
        except Exception as exc:  # noqa: BLE001 - the next scrape tries again
            log.warning("INT8 agreement refresh failed: %s", exc)
        finally:
            with self._lock:
                self._refreshing = False

    def _value(self, bot_id: str, version: int, created: str,
               new: dict[str, float]) -> float | None:
        key = agreement_key(bot_id, version, created)
        with self._lock:
            held_out, value = self._held_out, self._values.get(key)
        if value is not None:
            return value
        try:
            head = self._store.get(bot_id)
        except UnknownBot:  # removed meanwhile, or registered so lately the lookup lags behind
            return None
        except HeadLoadError as exc:
            log.warning("INT8 agreement of bot %r not scored: %s", bot_id, exc)
            return None
        if head.version != version:  # replaced meanwhile: the next refresh scores it
            return None
        value = agreement(held_out, head.weights, head.biases)
        with self._lock:
            self._values[key] = value
        new[key] = value
        return value

    def _record(self, new: Mapping[str, float]) -> None:
        if new and self._artifact is not None:
            self._artifact.record_agreements(new)


class Bots:
    """The bots of one process's store.

    Args:
        store: the store.
        pinned: the pinned bots (`--pin`: always resident).
        threads: where the store is read and written, off the event loop.
        candidate_stats: this process's comparison of each candidate with its live version.
        int8: each bot's agreement with the INT8 trunk (a fresh one, attached to no INT8 trunk,
            by default).
    """

    def __init__(self, store: HeadStore, pinned: Sequence[str], threads: Threads,
                 candidate_stats: CandidateStats, int8: Int8Agreement | None = None) -> None:
        self._store = store
        self._pinned = frozenset(pinned)
        self._threads = threads
        self._candidate_stats = candidate_stats
        self.int8 = int8 if int8 is not None else Int8Agreement(store)

    # -- reads -------------------------------------------------------------------------------------

    async def heads(self, bot_ids: Sequence[str]) -> list[Head]:
        """The active heads of the bots a request will be scored with, in one trip to the
        lookup threads. UnknownBot (404), HeadUnavailable, StoreUnavailable per bot, in order.

        NOTE: resolved once per request: the request keeps these versions even if a bot is
        replaced or removed while it waits in the queue.
        """
        return await self._threads.lookup(self._load_heads, tuple(bot_ids))

    def _load_heads(self, bot_ids: Sequence[str]) -> list[Head]:
        return [self._load_head(bot_id) for bot_id in bot_ids]

    def _load_head(self, bot_id: str) -> Head:
        try:
            return self._store.get(bot_id)
        except StoreUnavailable:
            raise  # the database is down and the head is not resident: 503, retry
        except HeadLoadError as exc:
            log.error("bot %r cannot be loaded: %s", bot_id, exc)
            raise HeadUnavailable(f"bot '{bot_id}' is registered but its head cannot be "
                                  f"loaded") from None

    async def info(self, bot_id: str) -> BotInfo:
        """The registry's view of one bot (no head load). Raises UnknownBot."""
        return await self._threads.lookup(self._store.info, bot_id)

    async def list(self) -> list[BotInfo]:
        """Every registered bot, ordered by id."""
        return await self._threads.lookup(self._store.list)

    def is_pinned(self, bot_id: str) -> bool:
        """Whether the bot's head is pinned (always resident, never evicted)."""
        return bot_id in self._pinned

    def candidate_report(self, info: BotInfo) -> dict | None:
        """The bot's candidate as `GET /bots/{id}` shows it to a caller that may manage the
        bot: the registry's view and this process's comparison with the live version (`stats`:
        `CandidateStats.report`). None if it has no candidate."""
        if info.candidate is None:
            return None
        return {**info.candidate.to_dict(with_source=False),
                "stats": self._candidate_stats.report(info.bot_id, info.candidate.version)}

    async def int8_agreement(self, info: BotInfo) -> float | None:
        """The share of the INT8 trunk's held-out images on which the bot's active version
        (`info`) answers as on the float trunk; None without an INT8 trunk for the serving
        checkpoint. Scored once per version, off the event loop."""
        return await self._threads.lookup(self.int8.of, info)

    # -- changes -----------------------------------------------------------------------------------

    def register_checkpoint(self, bot_id: str, prefix: Path, labels_path: Path,
                            **options: Any) -> int:
        """Registers a head checkpoint as the bot's new active version; returns the version
        (`options` as `HeadStore.register_checkpoint` takes them: `tenant`, `actor`, ...).
        Blocking (it reads the checkpoint): call it in a worker thread."""
        return self._store.register_checkpoint(bot_id, prefix, labels_path, **options)

    async def remove(self, bot_id: str, *, actor: str = OPERATOR_ACTOR) -> None:
        """Removes a bot and every version of it."""
        await self._threads.blocking(functools.partial(self._store.remove, bot_id, actor=actor))

    async def rollback(self, bot_id: str, to: int | None, *,
                       actor: str = OPERATOR_ACTOR) -> int:
        """Makes version `to` (default: the previous one) the bot's active version."""
        return await self._threads.blocking(functools.partial(self._store.rollback, bot_id, to,
                                                              actor=actor))

    async def promote(self, bot_id: str, *, actor: str = OPERATOR_ACTOR) -> tuple[int, int]:
        """Makes the bot's candidate its active version: (previous, new active version)."""
        return await self._threads.blocking(functools.partial(self._store.promote, bot_id,
                                                              actor=actor))

    async def discard(self, bot_id: str, *, actor: str = OPERATOR_ACTOR) -> int:
        """Deletes the bot's candidate; returns its version."""
        return await self._threads.blocking(functools.partial(self._store.discard, bot_id,
                                                              actor=actor))
