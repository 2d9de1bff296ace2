"""Bots at serving time: their active heads for a request, their registry view, their
candidates as a manager sees them, and the changes a manager makes (register, remove, roll
back, promote, discard), each off the event loop. No access rule here: a call reaches this
through `service.core.caller.Caller`, which applies them."""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from accounts.tenants import OPERATOR as OPERATOR_ACTOR
from heads import Head, HeadLoadError
from service.core.candidates import CandidateStats
from service.core.errors import HeadUnavailable
from service.core.threads import Threads
from store import BotInfo, HeadStore, StoreUnavailable

log = logging.getLogger(__name__)


class Bots:
    """The bots of one process's store.

    Args:
        store: the store.
        pinned: the pinned bots (`--pin`: always resident).
        threads: where the store is read and written, off the event loop.
        candidate_stats: this process's comparison of each candidate with its live version.
    """

    def __init__(self, store: HeadStore, pinned: Sequence[str], threads: Threads,
                 candidate_stats: CandidateStats) -> None:
        self._store = store
        self._pinned = frozenset(pinned)
        self._threads = threads
        self._candidate_stats = candidate_stats

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
