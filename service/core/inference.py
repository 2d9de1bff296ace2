"""Classification at serving time: a request's images under its heads (and their bots'
candidates, if any), through the engine that the bring-up started, within the request timeout.
No access rule here: a call reaches this through `service.core.caller.Caller`, which applies
them (and resolved the heads: readiness, ownership)."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from accounts import Candidate
from accounts.tenants import DEFAULT_TENANT
from heads import Head, HeadLoadError
from service.core import deadlines
from service.core.candidates import CandidateStats
from service.core.engine import Images, Prediction
from service.core.errors import AnswerTooLarge
from service.core.lifecycle import Lifecycle
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.core.threads import Threads
from store import HeadStore

log = logging.getLogger(__name__)

# Upper bounds of what an answer spends around its labels, in bytes of JSON (a gRPC answer is
# smaller): a prediction (`{"label": "", "score": 1.2345678901234567e-05}, `), a score of the
# whole probability row (TF Serving's and OIP's `probabilities`), one image's result under one
# head (`{"predictions": []}, `) and one head's part of the answer (its bot id, <= 64
# characters, its version, the keys around them).
PREDICTION_BYTES = 64
SCORE_BYTES = 32
RESULT_BYTES = 64
HEAD_BYTES = 256


def answer_bound(n_images: int, heads: Sequence[Head], top_k: int, *,
                 all_scores: bool = False) -> int:
    """An upper bound of the size of the answer of `n_images` under `heads` with `top_k`
    predictions each (at most a head's classes): its longest label in every prediction;
    with `all_scores`, every class's probability too."""
    total = 0
    for head in heads:
        per_image = (min(top_k, head.n_classes) * (head.label_json_bytes + PREDICTION_BYTES)
                     + RESULT_BYTES + (head.n_classes * SCORE_BYTES if all_scores else 0))
        total += n_images * per_image + HEAD_BYTES
    return total


class Inference:
    """Scores requests on the engine of `lifecycle`.

    Args:
        settings: the request timeout.
        store: where each bot's candidate is looked up.
        lifecycle: has the engine once ready.
        metrics: counts a candidate that cannot be loaded.
        threads: where a candidate is loaded, off the event loop.
        candidate_stats: this process's comparison of each candidate with its live version.
    """

    def __init__(self, settings: Settings, store: HeadStore, lifecycle: Lifecycle,
                 metrics: Metrics, threads: Threads, candidate_stats: CandidateStats) -> None:
        self._settings = settings
        self._store = store
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._threads = threads
        self._candidate_stats = candidate_stats

    def deadline(self) -> float:
        """When a request taken now times out (`time.monotonic` seconds): after
        `request_timeout_s`, or at its own deadline if sooner (`service.core.deadlines`)."""
        return deadlines.earliest(time.monotonic() + self._settings.request_timeout_s)

    async def classify(self, images: Images, heads: Sequence[Head], *,
                       top_k: int, tenant: str = DEFAULT_TENANT,
                       route_key: str | None = None,
                       all_scores: bool = False) -> list[list[Prediction]]:
        """Every image under every head: result[i][j] is image i under heads[j], charged to
        `tenant` (quota, fair share). A bot's candidate, if it has one, is scored beside it
        and a canary answers its share of the requests, by `route_key` (else the first image's
        digest): `service.core.candidates`.

        `heads` were resolved for the request after its readiness check: the engine exists
        from then on (it is started before readiness says ready, and readiness never goes
        back).

        Before any image is decoded, the answer's upper bound (`answer_bound`, `all_scores`
        when the protocol renders every class's probability; a candidate counted as its bot's
        head where it is larger) must be within `max_answer_bytes`, else AnswerTooLarge.
        """
        engine = self._lifecycle.engine
        assert engine is not None, "heads are resolved after the readiness check"
        candidates = await self._candidates(heads, len(images))
        self._check_answer(len(images), heads, candidates, top_k, all_scores)
        if images.arrays is not None:
            return await engine.classify_arrays(images.arrays, heads, top_k=top_k,
                                                deadline=self.deadline(), tenant=tenant,
                                                candidates=candidates, route_key=route_key)
        return await engine.classify(images.encoded, heads, top_k=top_k,
                                     deadline=self.deadline(), tenant=tenant,
                                     candidates=candidates, route_key=route_key)

    def _check_answer(self, n_images: int, heads: Sequence[Head],
                      candidates: Sequence[Candidate | None], top_k: int,
                      all_scores: bool) -> None:
        # A canary answers in its bot's place: per bot, the larger bound of the two counts.
        pairs = [(head, c.head if c is not None else None)
                 for head, c in zip(heads, candidates or [None] * len(heads))]
        bound = sum(max(answer_bound(n_images, [h], top_k, all_scores=all_scores)
                        for h in pair if h is not None) for pair in pairs)
        limit = self._settings.max_answer_bytes
        if bound > limit:
            answering = [h for pair in pairs for h in pair if h is not None]
            k = min(top_k, max(h.n_classes for h in answering))
            longest = max(h.label_json_bytes for h in answering)
            raise AnswerTooLarge(
                f"the answer could reach {bound:,} bytes ({n_images} image(s) x {len(heads)} "
                f"bot(s) x up to {k} prediction(s), labels up to {longest:,} bytes as JSON"
                f"{', with every class score' if all_scores else ''}), over the limit of "
                f"{limit:,} (max_answer_bytes): ask for fewer images, bots or a smaller top_k")

    async def _candidates(self, heads: Sequence[Head], n_images: int
                          ) -> tuple[Candidate | None, ...]:
        """The candidate of each head's bot (None for a bot without one), or () when none has
        one: then no thread hop (the store answers from memory)."""
        if not any(self._store.has_candidate(h.bot_id) for h in heads):
            return ()
        return tuple(await self._threads.lookup(self._load_candidates, heads, n_images))

    def _load_candidates(self, heads: Sequence[Head], n_images: int) -> list[Candidate | None]:
        out: list[Candidate | None] = []
        for head in heads:
            try:
                candidate = self._store.candidate(head.bot_id)
            except HeadLoadError as exc:  # StoreUnavailable too: the live version answers
                candidate = None
                found = self._store.candidate_mode(head.bot_id)
                log.error("candidate of bot %r cannot be loaded: %s", head.bot_id, exc)
                if found is not None:
                    self._candidate_stats.observe(head.bot_id, found[0], found[1].mode, None,
                                                  failed=n_images)
                    self._metrics.observe_candidate(head.bot_id, found[0], failed=n_images)
            if candidate is not None and candidate.head.version == head.version:
                candidate = None  # promoted since the request took its head
            out.append(candidate)
        return out
