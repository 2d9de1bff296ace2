"""Candidates at serving time: which requests a canary answers, how a candidate compares with
the live version, and the per-process tally of that comparison (`accounts.candidates` says what a
candidate is; `service.core.scoring.score` scores it on the features of the live version's
rows, in the same batch).

Routing. A canary at P % answers a request of its bot when the request's routing key falls
below P in [0, 100): `route_bucket(bot id, key)` is blake2b of the bot id and the key (never
Python's `hash`, which is salted per process), so the split is the same in every process,
replica and machine, and the same key always gets the same version while P stays. Raising P
keeps every key that was answered by the candidate on it. The key is, in order: the
`X-Multihead-Route-Key` header (gRPC: the `x-multihead-route-key` metadata), the OIP request's
`route_key` parameter (it wins over the header), else the digest of the request's first image.
All images of one request go the same way, so an answer names one version.

Comparison, per image scored by both versions (a shadow: every image of its bot; a canary:
every image too, the live version being scored on the canary's rows as well):

    agreed        the candidate's top-1 label equals the live version's (labels, not class
                  indices, are compared: a candidate may have other classes)
    abs_diff      |p_live[t] - p_candidate[t]|, t the live version's top-1 label and p each
                  version's softmax probability of that label (0 for a candidate without it)

`CandidateStats` sums them per bot and candidate version in this process's memory (they start
at zero in every process and are gone at its restart); `/metrics` has the same sums as
counters, which add up across replicas.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from accounts import Candidate
from heads import Head

ROUTE_KEY_HEADER = "X-Multihead-Route-Key"
ROUTE_KEY_METADATA = ROUTE_KEY_HEADER.lower()  # gRPC metadata keys are lower case
ROUTE_KEY_PARAMETER = "route_key"  # in an OIP request's `parameters`
MAX_ROUTE_KEY_CHARS = 1024
TOP_DISAGREEMENTS = 5
# Label pairs counted per candidate; beyond it the least counted is replaced (space-saving:
# the top ones' counts stay exact unless more than this many pairs ever disagreed).
PAIR_CAPACITY = 256
_PERSON = b"multihead-route"


def route_key(given: str | None, digest: bytes) -> bytes:
    """The bytes a request is routed by: the key the client gave (header, metadata or OIP
    parameter), else its first image's digest. The two never collide (distinct prefixes)."""
    if given:
        return b"k:" + given.encode("utf-8", "surrogatepass")
    return b"d:" + digest


def route_bucket(bot_id: str, key: bytes) -> float:
    """Where `key` falls for `bot_id`, in [0, 100): stable across processes and machines."""
    h = hashlib.blake2b(bot_id.encode() + b"\0" + key, digest_size=8, person=_PERSON)
    return int.from_bytes(h.digest(), "big") * 100.0 / 2**64


@dataclass(frozen=True)
class Route:
    """A bot's candidate for one request: its head, and whether it answers the request (a
    canary whose share the request's key falls in) or is only compared (a shadow, or a canary's
    other requests)."""

    head: Head
    mode: str
    answers: bool


def route_for(candidate: Candidate, bot_id: str, key: bytes) -> Route:
    percent = candidate.mode.percent
    answers = percent is not None and route_bucket(bot_id, key) < percent
    return Route(candidate.head, candidate.mode.mode, answers)


@dataclass(frozen=True)
class Comparison:
    """A candidate against the live version on some images (see the module doc)."""

    images: int
    agreed: int
    abs_diff: float
    disagreements: dict[tuple[str, str], int]


def compare(live: Head, live_p: np.ndarray, candidate: Head, candidate_p: np.ndarray
            ) -> Comparison:
    """Compares the two versions' softmax rows of the same images: `live_p` [R, n] of `live`,
    `candidate_p` [R, m] of `candidate` (row r is the same image in both)."""
    rows = np.arange(len(live_p))
    top = live_p.argmax(axis=1)  # the first of equal maxima, as `top_indices` takes it
    theirs = candidate_p.argmax(axis=1)
    live_labels = [live.labels[i] for i in top]
    their_labels = [candidate.labels[j] for j in theirs]
    if candidate.labels == live.labels:
        same = top
    else:
        index = {label: j for j, label in enumerate(candidate.labels)}
        same = np.array([index.get(label, -1) for label in live_labels], dtype=np.int64)
    p_candidate = np.where(same >= 0, candidate_p[rows, np.maximum(same, 0)], 0.0)
    abs_diff = float(np.abs(live_p[rows, top].astype(np.float64) - p_candidate).sum())
    disagreements: dict[tuple[str, str], int] = {}
    agreed = 0
    for mine, yours in zip(live_labels, their_labels):
        if mine == yours:
            agreed += 1
        else:
            disagreements[(mine, yours)] = disagreements.get((mine, yours), 0) + 1
    return Comparison(len(live_p), agreed, abs_diff, disagreements)


@dataclass
class _Tally:
    mode: str
    since: str
    images: int = 0
    agreed: int = 0
    abs_diff: float = 0.0
    answered: int = 0
    failures: int = 0
    pairs: dict[tuple[str, str], int] = field(default_factory=dict)

    def count_pairs(self, pairs: dict[tuple[str, str], int]) -> None:
        for pair, n in pairs.items():
            if pair not in self.pairs and len(self.pairs) >= PAIR_CAPACITY:
                weakest = min(self.pairs, key=self.pairs.__getitem__)
                n += self.pairs.pop(weakest)  # space-saving: the newcomer inherits its count
            self.pairs[pair] = self.pairs.get(pair, 0) + n


class CandidateStats:
    """The comparison of each bot's current candidate with its live version, in this process
    (see the module doc). One tally per bot: a new candidate version starts a new one.
    Thread-safe (the batch thread and the decode pool score; the event loop reads)."""

    def __init__(self) -> None:
        self._tallies: dict[str, tuple[int, _Tally]] = {}
        self._lock = threading.Lock()

    def observe(self, bot_id: str, version: int, mode: str, comparison: Comparison | None, *,
                answered: int = 0, failed: int = 0) -> None:
        """Counts one scoring of `bot_id`'s candidate `version`: its comparison (None when it
        failed), the images it answered (a canary) and the images it failed on."""
        with self._lock:
            current = self._tallies.get(bot_id)
            if current is None or current[0] != version:
                current = (version, _Tally(mode, datetime.now(UTC).isoformat(
                    timespec="seconds")))
                self._tallies[bot_id] = current
            tally = current[1]
            tally.mode = mode
            if comparison is not None:
                tally.images += comparison.images
                tally.agreed += comparison.agreed
                tally.abs_diff += comparison.abs_diff
                tally.count_pairs(comparison.disagreements)
            tally.answered += answered
            tally.failures += failed

    def report(self, bot_id: str, version: int) -> dict:
        """The JSON-ready tally of `bot_id`'s candidate `version` (zeros if never scored here):
        since (when this process first scored it), images (scored by both versions), agreed,
        agreement (agreed / images), mean_abs_diff (abs_diff / images; both None before any
        image), answered (images the candidate answered), failures (images it failed on: the
        live answer was given), and the most frequent disagreements, most frequent first."""
        with self._lock:
            current = self._tallies.get(bot_id)
            if current is None or current[0] != version:
                tally = _Tally("", "")
                since = None
            else:
                tally, since = current[1], current[1].since
            pairs = sorted(tally.pairs.items(), key=lambda kv: (-kv[1], kv[0]))
            images = tally.images
            return {
                "since": since, "images": images, "agreed": tally.agreed,
                "agreement": tally.agreed / images if images else None,
                "mean_abs_diff": tally.abs_diff / images if images else None,
                "answered": tally.answered, "failures": tally.failures,
                "disagreements": [{"live": live, "candidate": theirs, "images": n}
                                  for (live, theirs), n in pairs[:TOP_DISAGREEMENTS]]}
