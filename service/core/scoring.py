"""Scoring a batch's features: each distinct head once on the rows that asked for it, each
bot's candidate (shadow or canary, `service.core.candidates`) once on its rows, and the
per-row answers (`Prediction`). Runs in the batcher's worker thread (`Engine.run_batch`) and,
for fully cached requests, in the light pool. Pure numpy: no asyncio, no trunk.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from heads import Head, top_indices
from service.core.candidates import Comparison, Route, compare
from service.core.tracing import RowTrace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """One head's answer for one image.

    Attributes:
        version: the version that answered: the live one, or the bot's canary candidate.
        labels_scores: the top-k (label, probability), best first.
        probabilities: float32 [n], read-only: the whole softmax row in class index order
            (`labels[i]` is entry i). Not part of equality or repr.
        labels: the answering version's labels, in class index order. Not part of equality
            or repr.
    """

    bot_id: str
    version: int
    labels_scores: list[tuple[str, float]]
    probabilities: np.ndarray | None = field(default=None, repr=False, compare=False)
    labels: tuple[str, ...] = field(default=(), repr=False, compare=False)


@dataclass(frozen=True)
class Item:
    """One image of a request: the batcher's row payload."""

    image: np.ndarray | None  # [299, 299, 3] float32, None when the features were cached
    features: np.ndarray | None  # [1536] from the feature cache
    digest: bytes  # the key its features are cached under (`cache_key`)
    heads: tuple[Head, ...]
    top_k: int
    trace: RowTrace | None = None  # the request's span, for the batch thread (tracing on)
    # Per head, its bot's candidate for this request (or None); () when no bot has one.
    routes: tuple[Route | None, ...] = ()


# How `score` reports a candidate's scoring: (live head, its route, the comparison or None if
# the candidate failed, images it answered, images it failed on).
ObserveCandidate = Callable[[Head, Route, Comparison | None, int, int], None]


def _answer(head: Head, p: np.ndarray, top_k: int) -> tuple[Head, list[tuple[str, float]],
                                                             np.ndarray]:
    top = top_indices(p, top_k)
    return head, [(head.labels[i], float(p[i])) for i in top], p


def score(features: np.ndarray, items: Sequence[Item],
          observe: ObserveCandidate | None = None) -> list[list[Prediction] | Exception]:
    """Applies each distinct head once to the rows that asked for it, then each candidate
    (`Item.routes`) once to the rows of its bot.

    A candidate answers the rows its route says it answers (a canary's); the live head is
    scored on every row anyway, for the comparison. A candidate that raises fails alone: its
    rows keep the live answer, and `observe` counts the failure.

    Args:
      features: float32 [R, 1536], row r for items[r].
      observe: told of each candidate's scoring (see `ObserveCandidate`).

    Returns:
      Per item, its predictions in the order of its heads, or the Exception of a failing live
      head (that item alone fails; other rows are untouched).
    """
    by_head: dict[int, list[int]] = collections.defaultdict(list)
    heads: dict[int, Head] = {}
    # (live head, candidate head) -> [(row, its route)]: one candidate matmul per batch, each
    # row answered as its own request's route says.
    by_route: dict[tuple[int, int], list[tuple[int, Route]]] = collections.defaultdict(list)
    for row, item in enumerate(items):
        for head in item.heads:
            by_head[id(head)].append(row)
            heads[id(head)] = head
        for head, route in zip(item.heads, item.routes):
            if route is not None:
                by_route[(id(head), id(route.head))].append((row, route))
    answers: dict[tuple[int, int], tuple[Head, list[tuple[str, float]], np.ndarray]] = {}
    scored: dict[int, np.ndarray] = {}  # live head -> its probabilities of its rows
    failed: dict[int, Exception] = {}
    for key, rows in by_head.items():
        head = heads[key]
        try:
            probabilities = head.probabilities(features[rows])  # [len(rows), n]
        except Exception as exc:  # a broken head fails its rows only
            log.exception("head %s v%s failed", head.bot_id, head.version)
            for row in rows:
                failed[row] = exc
            continue
        probabilities.setflags(write=False)  # rows are handed out as Prediction.probabilities
        scored[key] = probabilities
        for position, row in enumerate(rows):
            answers[(row, key)] = _answer(head, probabilities[position], items[row].top_k)
    for (key, _), routed in by_route.items():
        _score_candidate(features, items, heads[key], routed, by_head[key], scored.get(key),
                         answers, observe)
    results: list[list[Prediction] | Exception] = []
    for row, item in enumerate(items):
        if row in failed:
            results.append(failed[row])
            continue
        predictions = []
        for h in item.heads:
            head, labels_scores, p = answers[(row, id(h))]
            predictions.append(Prediction(h.bot_id, head.version, labels_scores, p, head.labels))
        results.append(predictions)
    return results


def _score_candidate(features: np.ndarray, items: Sequence[Item], live: Head,
                     routed: list[tuple[int, Route]], live_rows: list[int],
                     live_p: np.ndarray | None, answers: dict,
                     observe: ObserveCandidate | None) -> None:
    """One candidate on its rows: its answers replace the live ones where the row's route says
    it answers; its comparison with the live head (when that one did not fail) goes to
    `observe`."""
    rows = [row for row, _ in routed]
    route = routed[0][1]
    try:
        p = route.head.probabilities(features[rows])  # [len(rows), m]
    except Exception:  # noqa: BLE001 - a candidate fails alone: the live answers stand
        log.exception("candidate v%s of bot %s failed", route.head.version, live.bot_id)
        _observe(observe, live, route, None, 0, len(rows))
        return
    p.setflags(write=False)
    if live_p is None:  # the live head failed: these rows fail with it
        return
    answered = 0
    for position, (row, row_route) in enumerate(routed):
        if row_route.answers:
            answers[(row, id(live))] = _answer(route.head, p[position], items[row].top_k)
            answered += 1
    if observe is not None:
        where = {row: i for i, row in enumerate(live_rows)}
        mine = live_p[[where[row] for row in rows]]
        _observe(observe, live, route, lambda: compare(live, mine, route.head, p), answered, 0)


def _observe(observe: ObserveCandidate | None, live: Head, route: Route,
             comparison: Callable[[], Comparison] | None, answered: int, failed: int) -> None:
    if observe is None:
        return
    try:
        observe(live, route, comparison() if comparison is not None else None, answered,
                failed)
    except Exception:  # noqa: BLE001 - stats must never fail the answers
        log.exception("candidate stats of bot %s failed", live.bot_id)
