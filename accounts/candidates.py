"""Candidates: a second, not yet active version of a bot, scored on the features the trunk
computed for the live version (no I/O here; `store.front.HeadStore` keeps them).

A bot has at most one candidate at a time. Its mode says what it does on the bot's requests:

    shadow      scored on every request of the bot and compared with the live version; never
                returned to the client
    canary:P    answers P % of the bot's requests (0 < P < 100), chosen by a sticky routing key;
                the live version is scored on those too, for the comparison

`multihead bots promote` makes the candidate the active version (the old one stays stored, so
`rollback` goes back to it); `multihead bots discard` deletes it. Registering a new candidate
while one exists replaces it (the old candidate's version is deleted), as a new canary revision
replaces the previous one in KServe.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from accounts.errors import InvalidCandidate, NoCandidate
from heads.errors import UnknownBot
from heads.head import Head

SHADOW = "shadow"
CANARY = "canary"
MODES = (SHADOW, CANARY)
_SYNTAX = "use shadow, or canary:P with 0 < P < 100 (the percent of requests it answers)"


@dataclass(frozen=True)
class CandidateMode:
    """How a candidate is scored: `mode` is SHADOW or CANARY; `percent` (CANARY only) is the
    share of the bot's requests it answers, 0 < percent < 100."""

    mode: str
    percent: float | None = None

    def __post_init__(self) -> None:
        if self.mode == SHADOW and self.percent is None:
            return
        if self.mode == CANARY and _valid_percent(self.percent):
            object.__setattr__(self, "percent", float(self.percent))
            return
        raise InvalidCandidate(f"invalid candidate mode {str(self)!r}: {_SYNTAX}")

    @classmethod
    def parse(cls, text: object) -> CandidateMode:
        """`shadow` or `canary:P` (P a number, 0 < P < 100), as the CLI and HTTP take it.

        Raises:
            InvalidCandidate: anything else, naming it (one line).
        """
        if isinstance(text, CandidateMode):
            return text
        if not isinstance(text, str):
            raise InvalidCandidate(f"invalid candidate mode {text!r}: {_SYNTAX}")
        value = text.strip()
        if value == SHADOW:
            return cls(SHADOW)
        name, sep, percent = value.partition(":")
        if name == CANARY and sep:
            try:
                number = float(percent)
            except ValueError:
                number = math.nan
            if _valid_percent(number):
                return cls(CANARY, number)
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise InvalidCandidate(f"invalid candidate mode {shown!r}: {_SYNTAX}")

    def __str__(self) -> str:
        if self.mode == CANARY and isinstance(self.percent, (int, float)):
            return f"{CANARY}:{self.percent:g}"
        return str(self.mode) if self.percent is None else f"{self.mode}:{self.percent}"


def _valid_percent(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and 0 < value < 100)


@dataclass(frozen=True)
class CandidateInfo:
    """What the registry knows about a bot's candidate: its version's row and its mode."""

    bot_id: str
    version: int
    mode: CandidateMode
    n_classes: int
    labels: tuple[str, ...]
    created: str
    source: str

    def to_dict(self, *, with_source: bool = True) -> dict:
        """JSON-ready fields (`with_source=False` for public answers, as `BotInfo.to_dict`)."""
        out = {"version": self.version, "mode": self.mode.mode, "percent": self.mode.percent,
               "n_classes": self.n_classes, "labels": list(self.labels),
               "created": self.created}
        if with_source:
            out["source"] = self.source
        return out


@dataclass(frozen=True)
class Candidate:
    """A bot's candidate as it is served: its head and its mode."""

    head: Head
    mode: CandidateMode


def required_candidate(bot_id: str, active: int | None,
                       live_candidate: Callable[[int], tuple[int, CandidateMode] | None]
                       ) -> tuple[int, int, CandidateMode]:
    """(active version, candidate version, its mode) of `bot_id`, what promote and discard act
    on, from a backend's reads in one transaction: its active version and a function of it
    giving the live candidate. Raises UnknownBot, NoCandidate."""
    if active is None:
        raise UnknownBot(bot_id)
    found = live_candidate(active)
    if found is None:
        raise NoCandidate(bot_id)
    return active, *found
