"""The protocol-agnostic service of one process: settings, store, trunk, engine, readiness.

Every transport (the aiohttp app, and later a Ray Serve replica or a gRPC server) owns one
`Service` and hands it to the codecs' endpoints; nothing here knows HTTP.

Lifecycle: `start()` opens nothing but launches the bring-up (import TensorFlow, build and
restore the trunk, warm it up, start the engine) as a background task, so health checks answer
at once and readiness says "loading" meanwhile; `close()` waits for a bring-up still running,
drains the engine (queued rows finish), then closes the store and the trunk session, in that
order. Readiness is decided here, in one place, and every protocol reports it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backbone.spec import INPUT
from backbone.tfimport import import_tensorflow
from heads import BotInfo, Head, HeadLoadError, HeadStore
from service.admission import ByteBudget
from service.engine import Engine, Images, Prediction
from service.errors import HeadUnavailable, NotReady
from service.metrics import Metrics
from service.settings import Settings

log = logging.getLogger(__name__)

LOADING, READY, FAILED = "loading", "ready", "failed"


def trunk_kind(prefix: str) -> str:
    """What readiness reports: the official weights, the demo random ones, or another file."""
    from backbone.checkpoint import DEMO_CHECKPOINT, OFFICIAL_CHECKPOINT

    name = Path(prefix).name
    if name == OFFICIAL_CHECKPOINT:
        return "official"
    if name == DEMO_CHECKPOINT:
        return "demo (seeded random weights)"
    return "custom"


def warmup_batch_sizes(max_batch_size: int, device: str) -> tuple[int, ...]:
    """Batch sizes run before readiness says ready.

    On a GPU: 1, 2, 4, ... and max_batch_size, since cuDNN picks its kernels per shape and a
    first run at a new shape can take seconds. On the CPU: batch 1 only (session start-up, memory
    arenas, oneDNN primitives): measured here, a first run at a new batch size costs 20-100 ms
    more than the next one, while warming every size would add about 3 s to each restart.
    """
    if "GPU" not in device.upper():
        return (1,)
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [max_batch_size])


@dataclass
class Readiness:
    """Where the bring-up is: `status` is loading, ready or failed (with `error`)."""

    status: str = LOADING
    error: str | None = None
    started_s: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.status == READY


class Service:
    """One process's serving state, shared by every protocol and transport.

    Args:
        settings: the validated settings.
        trunk: an already-built trunk to use (tests, benchmark); it is then not closed here.
        store: an already-open store to use; likewise not closed here.
        metrics: the metrics registry (a fresh one by default).
    """

    def __init__(self, settings: Settings, *, trunk=None, store: HeadStore | None = None,
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics(top_bots=settings.metrics_top_bots)
        self._own_store = store is None
        self.store = store if store is not None else HeadStore(
            settings.store, heads_memory_mb=settings.heads_memory_mb)
        self._given_trunk = trunk
        self.trunk = None
        self.trunk_kind = "unknown"
        self.engine: Engine | None = None
        self.readiness = Readiness()
        # Admission: every transport of this process reserves request bytes here first.
        self.inflight = ByteBudget(settings.max_inflight_bytes)
        self.metrics.bind_inflight_bytes(lambda: self.inflight.used_bytes)
        self._bring_up_task: asyncio.Task | None = None
        # NOTE: head lookups (the hot path, milliseconds at most) get their own threads, so
        # they never queue behind body parsing or registrations on the default executor.
        self._lookups = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="multihead-lookup")

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the bring-up in the background and returns at once."""
        self._bring_up_task = asyncio.get_running_loop().create_task(self._bring_up())

    async def wait_ready(self) -> bool:
        """Waits for the bring-up to end; True if the service is ready."""
        if self._bring_up_task is not None:
            await asyncio.shield(self._bring_up_task)
        return self.readiness.ready

    async def _bring_up(self) -> None:
        settings, readiness = self.settings, self.readiness
        loop = asyncio.get_running_loop()
        try:
            trunk = self._given_trunk
            if trunk is None:
                from backbone.checkpoint import default_trunk_checkpoint

                start = time.perf_counter()
                await loop.run_in_executor(None, import_tensorflow, settings.device)
                readiness.timings["import_s"] = time.perf_counter() - start
                from backbone import Trunk

                prefix = settings.trunk_checkpoint or default_trunk_checkpoint(settings.store)
                self.trunk_kind = trunk_kind(prefix)
                cache_dir = (Path(settings.store) / "trunk" / "graph_cache"
                             if settings.graph_cache else None)
                trunk = await loop.run_in_executor(None, lambda: Trunk.from_checkpoint(
                    prefix, device=settings.device, warmup_batch_sizes=(),
                    graph_cache_dir=cache_dir, precision=settings.precision,
                    runtime=settings.runtime))
                readiness.timings.update(build_s=trunk.timings.build_s,
                                         restore_s=trunk.timings.restore_s,
                                         compile_s=trunk.timings.compile_s)
            self.trunk = trunk
            self.trunk_kind = trunk_kind(trunk.checkpoint_prefix)
            self.metrics.set_trunk(device=trunk.device,
                                   runtime=getattr(trunk, "runtime", "tf"),
                                   precision=getattr(trunk, "precision", "fp32"))
            start = time.perf_counter()
            if settings.warmup:
                for size in warmup_batch_sizes(settings.max_batch_size, trunk.device):
                    batch = np.zeros((size, *INPUT.shape), np.float32)
                    await loop.run_in_executor(None, trunk.features, batch)
            readiness.timings["warmup_s"] = time.perf_counter() - start
            self.engine = Engine(trunk, settings, self.metrics)
            await self.engine.batcher.start()
            readiness.timings["ready_s"] = time.monotonic() - readiness.started_s
            readiness.status = READY
            log.info("ready: trunk %s (%s) in %.1fs", trunk.checkpoint_prefix, self.trunk_kind,
                     readiness.timings["ready_s"])
        except Exception as exc:  # noqa: BLE001 - reported by readiness and the log
            readiness.status, readiness.error = FAILED, f"trunk failed to load: {exc}"
            log.error("%s", readiness.error, exc_info=exc)

    async def close(self) -> None:
        """Waits for a running bring-up, drains the engine, closes the store and the trunk."""
        if self._bring_up_task is not None and not self._bring_up_task.done():
            await self._bring_up_task
        if self.engine is not None:
            await self.engine.close()
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self._lookups.shutdown, wait=True))
        if self._own_store:
            self.store.close()
        if self._given_trunk is None and self.trunk is not None:
            self.trunk.close()

    # -- readiness ------------------------------------------------------------------------------

    def require_engine(self) -> Engine:
        """The engine, or `NotReady` (503 + Retry-After) while loading or after a failure."""
        if self.engine is None or not self.readiness.ready:
            raise NotReady(self.readiness.error or "the trunk is still loading; retry shortly")
        return self.engine

    def trunk_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"weights": self.trunk_kind}
        if self.trunk is not None:
            info.update(checkpoint=self.trunk.checkpoint_prefix, device=self.trunk.device,
                        runtime=getattr(self.trunk, "runtime", "tf"),
                        precision=getattr(self.trunk, "precision", "fp32"))
        return info

    def readiness_report(self) -> dict[str, Any]:
        """The one description of readiness: status, trunk, timings (and error if failed)."""
        r = self.readiness
        body: dict[str, Any] = {"status": r.status, "trunk": self.trunk_info(),
                                "timings": {k: round(v, 3) for k, v in r.timings.items()}}
        if r.error:
            body["error"] = r.error
        return body

    # -- the store, off the event loop -----------------------------------------------------------

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the default executor (parsing, registrations, file writes)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def _lookup(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._lookups, fn, *args)

    async def head(self, bot_id: str) -> Head:
        """The active head of a bot (UnknownBot -> 404, before any work on the request)."""
        # NOTE: resolved once per request: the request keeps this version even if the bot is
        # replaced or removed while it waits in the queue.
        try:
            return await self._lookup(self.store.get, bot_id)
        except HeadLoadError as exc:
            log.error("bot %r cannot be loaded: %s", bot_id, exc)
            raise HeadUnavailable(f"bot '{bot_id}' is registered but its head cannot be "
                                  f"loaded") from None

    async def info(self, bot_id: str) -> BotInfo:
        return await self._lookup(self.store.info, bot_id)

    async def bots(self) -> list[BotInfo]:
        return await self._lookup(self.store.list)

    # -- classification ---------------------------------------------------------------------------

    def deadline(self) -> float:
        return time.monotonic() + self.settings.request_timeout_s

    async def classify(self, images: Images, heads: Sequence[Head], *,
                       top_k: int) -> list[list[Prediction]]:
        """Every image under every head: result[i][j] is image i under heads[j]."""
        engine = self.require_engine()
        if images.arrays is not None:
            return await engine.classify_arrays(images.arrays, heads, top_k=top_k,
                                                deadline=self.deadline())
        return await engine.classify(images.encoded, heads, top_k=top_k,
                                     deadline=self.deadline())
