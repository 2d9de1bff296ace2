"""Fakes for the unit tests of logic, each defined once.

- `FakeService` (with `FakeStore`, `FakeMetrics`): only what the codecs call, no trunk, no store
  files. The codecs' logic is the subject (parsing, rendering, status codes); the same endpoints
  run against the real `Service` in test_app.py and test_interop.py.
- `FakeClock`: a monotonic clock that moves only when told (the batcher's injected clock, the
  engine's `perf_counter`).
- `FakeTrunk`: features that are a fixed projection of the pixels, no TensorFlow.
- `GatedTrunk`: any trunk (the real one, or a `FakeTrunk`) behind a gate, recording its batches,
  for readiness, overload and shutdown tests.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from backbone.spec import FEATURE_DIM
from heads import Head, HeadLoadError, UnknownBot, top_indices
from service.codecs.base import Request
from service.core.admission import RefusalPacer
from service.core.auth import ANONYMOUS, Authenticator, Principal
from service.core.engine import Images, Prediction, check_image_count
from service.core.errors import HeadUnavailable, NotReady
from service.core.lifecycle import FAILED, LOADING, READY, Readiness
from service.core.settings import Settings
from store import BotInfo


def make_head(bot_id: str, version: int, labels: list[str]) -> Head:
    n = len(labels)
    return Head(bot_id, version, tuple(labels), np.zeros((1536, n), np.float32),
                np.zeros(n, np.float32))


def info_of(head: Head, versions: list[int] | None = None) -> BotInfo:
    return BotInfo(head.bot_id, head.version, head.n_classes, head.labels, "2024-01-01T00:00:00Z",
                   "/server/path", versions=versions or [head.version])


def probabilities(image_index: int, head_index: int, n: int) -> np.ndarray:
    """A distinct, deterministic float32 row per (image, head): the fake classifier's answer."""
    row = np.arange(1, n + 1, dtype=np.float32) + np.float32(3 * image_index + 5 * head_index)
    row = np.roll(row, image_index + head_index)
    return (row / row.sum()).astype(np.float32)


class FakeMetrics:
    def __init__(self) -> None:
        self.resident: tuple[int, int] | None = None

    def set_resident_heads(self, count: int, total_bytes: int) -> None:
        self.resident = (count, total_bytes)

    def render(self) -> tuple[bytes, str]:
        return b"# metrics\n", "text/plain; version=0.0.4"


class FakeStore:
    """What the admin and ops endpoints call on `service.store`, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.next_version = 1
        self.written: dict[str, bytes] = {}

    def register_checkpoint(self, bot_id, prefix, labels_path, **kwargs) -> int:
        from pathlib import Path

        folder = Path(prefix).parent
        self.written = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
        self.calls.append(("register_checkpoint", bot_id, Path(prefix).name,
                           Path(labels_path).name, kwargs))
        return self.next_version

    def remove(self, bot_id: str) -> None:
        self.calls.append(("remove", bot_id))

    def rollback(self, bot_id: str, to: int | None) -> int:
        self.calls.append(("rollback", bot_id, to))
        return 1

    def promote(self, bot_id: str) -> tuple[int, int]:
        self.calls.append(("promote", bot_id))
        return 1, 2

    def discard(self, bot_id: str) -> int:
        self.calls.append(("discard", bot_id))
        return 2

    def cache_stats(self) -> dict:
        return {"resident_heads": 3, "resident_bytes": 4096, "hits": 0}


@dataclasses.dataclass
class FakeService:
    """Heads by bot id; `classify` answers `probabilities(i, j, n)` for image i under head j.
    `FakeService(settings)` is all `dispatch` reads (the auth mode and the admin token: the
    real `Authenticator`, without keys; the caller is the fake itself, every bot in sight, with
    the members of `service.core.caller.Caller` that the codecs call)."""

    settings: Settings = dataclasses.field(
        default_factory=lambda: Settings(top_k_default=2, auth="none"))
    heads: dict[str, Head] = dataclasses.field(default_factory=dict)
    readiness: Readiness = dataclasses.field(default_factory=lambda: Readiness(status=READY))
    store: FakeStore = dataclasses.field(default_factory=FakeStore)
    metrics: FakeMetrics = dataclasses.field(default_factory=FakeMetrics)
    broken: set[str] = dataclasses.field(default_factory=set)  # heads that fail to load
    classified: list[tuple[Images, list[str], int]] = dataclasses.field(default_factory=list)
    blocking: list[str] = dataclasses.field(default_factory=list)
    pacer: RefusalPacer = dataclasses.field(default_factory=RefusalPacer)

    principal: Principal = ANONYMOUS
    route_key: str | None = None  # the last call's (its header)
    route_keys: list[str | None] = dataclasses.field(default_factory=list)  # per classify

    def caller(self, authorization: str | None, access: str, *,
               route_key: str | None = None) -> FakeService:
        self.principal = self._auth().admit(authorization, access)
        self.route_key = route_key
        return self

    def may(self, access: str) -> bool:
        return self._auth().allows(access, self.principal)

    @property
    def ready(self) -> bool:
        return self.readiness.ready

    @property
    def status(self) -> str:
        return self.readiness.status

    @property
    def top_k_default(self) -> int:
        return self.settings.top_k_default

    def _auth(self) -> Authenticator:
        return Authenticator(self.settings.auth, self.settings.admin_token)

    def require_ready(self) -> None:
        if not self.readiness.ready:
            raise NotReady(self.readiness.error or "the trunk is still loading; retry shortly")

    def readiness_report(self) -> dict:
        body: dict[str, Any] = {"status": self.readiness.status}
        if self.readiness.error:
            body["error"] = self.readiness.error
        return body

    async def run_blocking(self, fn, *args):
        self.blocking.append(getattr(fn, "__name__", "?"))
        return fn(*args)

    async def heads_for(self, bot_ids) -> list[Head]:
        self.require_ready()  # as `Service.heads_for`: the request's one readiness check
        return [self._head(b) for b in bot_ids]

    async def head(self, bot_id: str) -> Head:
        (head,) = await self.heads_for([bot_id])
        return head

    def _head(self, bot_id: str) -> Head:
        if bot_id in self.broken:
            try:
                raise HeadLoadError("corrupt")
            except HeadLoadError:
                raise HeadUnavailable(f"bot '{bot_id}' is registered but its head cannot be "
                                      f"loaded") from None
        try:
            return self.heads[bot_id]
        except KeyError:
            raise UnknownBot(bot_id) from None

    async def info(self, bot_id: str) -> BotInfo:
        return info_of(self._head(bot_id))

    async def bots(self) -> list[BotInfo]:
        return [info_of(h) for h in self.heads.values()]

    def is_pinned(self, bot_id: str) -> bool:
        return bot_id in self.settings.pinned_bots

    def candidate_report(self, info: BotInfo) -> dict | None:
        return None

    async def int8_agreement(self, info: BotInfo) -> float | None:
        return None  # no INT8 trunk

    def register_checkpoint(self, bot_id, prefix, labels_path, **options) -> int:
        return self.store.register_checkpoint(bot_id, prefix, labels_path, **options)

    async def remove(self, bot_id: str) -> None:
        self.store.remove(bot_id)

    async def rollback(self, bot_id: str, to) -> int:
        return self.store.rollback(bot_id, to)

    async def promote(self, bot_id: str) -> tuple[int, int]:
        self._head(bot_id)
        return self.store.promote(bot_id)

    async def discard(self, bot_id: str) -> int:
        self._head(bot_id)
        return self.store.discard(bot_id)

    metrics_scope = None  # the operator's view: everything (as `Caller.metrics_scope`)

    def render_metrics(self) -> tuple[bytes, str]:
        stats = self.store.cache_stats()
        self.metrics.set_resident_heads(stats["resident_heads"], stats["resident_bytes"])
        return self.metrics.render()

    async def classify(self, images: Images, heads, *, top_k: int,
                       route_key: str | None = None,
                       all_scores: bool = False) -> list[list[Prediction]]:
        check_image_count(len(images), self.settings.max_images_per_request)  # the engine's rule
        self.classified.append((images, [h.bot_id for h in heads], top_k))
        self.route_keys.append(route_key or self.route_key)
        out = []
        for i in range(len(images)):
            row = []
            for j, head in enumerate(heads):
                p = probabilities(i, j, head.n_classes)
                row.append(Prediction(head.bot_id, head.version,
                                      [(head.labels[c], float(p[c]))
                                       for c in top_indices(p, top_k)], p))
            out.append(row)
        return out


def loading() -> Readiness:
    return Readiness(status=LOADING)


def failed(error: str = "trunk failed to load: no such file") -> Readiness:
    return Readiness(status=FAILED, error=error)


def req(method: str = "GET", path: str = "/x", *, params=None, query=None, headers=None,
        body: bytes | None = None) -> Request:
    async def read() -> bytes:
        return body

    return Request(method, path, params or {}, query or {},
                   {k.lower(): v for k, v in (headers or {}).items()},
                   read if body is not None else None)


class FakeClock:
    """A monotonic clock (`time.monotonic` / `time.perf_counter` stand-in) that moves only when
    told, from any thread."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeTrunk:
    """Features = a fixed projection of the pixels (no TensorFlow)."""

    checkpoint_prefix, device = "fake", "/cpu:0"

    def features(self, images: np.ndarray) -> np.ndarray:
        flat = images.reshape(len(images), -1)
        return np.stack([np.resize(row[:4096], FEATURE_DIM) for row in flat]).astype(np.float32)


class GatedTrunk:
    """`trunk` behind a gate: `features` sets `entered`, blocks until `gate` is set (at once if
    `open`), records the batch's size and dtype, advances `clock` by `run_s`, then answers with
    `trunk`'s features. Everything else is `trunk`'s."""

    def __init__(self, trunk, *, open: bool = False, clock: FakeClock | None = None,
                 run_s: float = 0.0, wait_s: float = 60.0, owns_cores: bool = False) -> None:
        self._trunk = trunk
        self.owns_cores = owns_cores  # True: the engine keeps decodes off its batches
        self.gate = threading.Event()
        if open:
            self.gate.set()
        self.entered = threading.Event()
        self.batches: list[int] = []
        self.dtypes: list[np.dtype] = []
        self.clock, self.run_s, self.wait_s = clock, run_s, wait_s
        self.checkpoint_prefix = trunk.checkpoint_prefix
        self.device = trunk.device

    def features(self, images: np.ndarray) -> np.ndarray:
        self.entered.set()
        assert self.gate.wait(self.wait_s), "the test never opened the gate"
        self.batches.append(len(images))
        self.dtypes.append(images.dtype)
        if self.clock is not None:
            self.clock.advance(self.run_s)
        return self._trunk.features(images)
