"""The life of one process's service: bring-up, readiness, drain.

`Lifecycle.start()` opens nothing but launches the bring-up (resolve the trunk, import the
runtime it needs (no TensorFlow where the compiled model is cached or the trunk is INT8), build
or import and restore the trunk, warm it up and take its batch profile, start the engine; the
pinned and preloaded heads beside it) as a background task, so health checks answer at once
and readiness says "loading" meanwhile;
`close()` waits for a bring-up still running, drains the engine (queued rows finish), then
closes the store and the trunk session, in that order. Readiness is decided here, in one
place, and every protocol reports it (`readiness_report`, with what `/metrics` shows).

The INT8 gate: the trunk's choice judges an INT8 trunk for the active bots (`Int8Agreement`
scores each on its held-out features), so `--precision auto` serves the float trunk when one
of them is below the bound; the log and the full readiness report say which precision and why.

Hot bots: `--pin` and `--preload` load heads before readiness says ready (`preload_heads`).

The batch profile (`backbone.profile`): the trunk's time per batch alone at 1, 2, 4, ... up to
max_batch_size, measured at warm-up (the measurement's first runs are the warm-up) and kept
next to the graph cache, so a restart loads it instead (`Lifecycle.batch_profile`, in the full
readiness report as `trunk.profile`). A trunk given (tests, the benchmark's in-process
services) is warmed as before and not profiled.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backbone.gate import FidelityReport
from backbone.profile import CACHED, BatchProfile, profile_trunk
from backbone.spec import FEATURE_DIM
from backbone.trunk import discard_prefetched, warm_up
from heads import HeadLoadError, UnknownBot
from service.core.bots import Int8Agreement
from service.core.engine import Engine
from service.core.errors import NotReady, ServiceError
from service.core.metrics import Metrics
from service.core.metrics_scope import Scope, scoped
from service.core.settings import Settings
from service.core.threads import Threads
from service.core.tracing import Tracing
from store import BotInfo, HeadStore

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
    (A start that measures the batch profile runs every size anyway: its first runs.)
    """
    if "GPU" not in device.upper():
        return (1,)
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [max_batch_size])


# -- hot bots: heads loaded before ready -----------------------------------------------------------

class PreloadError(ServiceError):
    """A pinned bot is not registered, or its head cannot be loaded: the service is not ready
    (and `multihead serve` refuses to start)."""


@dataclass(frozen=True)
class Preloaded:
    """What the bring-up loaded besides the trunk.

    Attributes:
        pinned: the pinned bots (all resident, never evicted).
        preloaded: the bots `--preload` loaded, most recently registered first.
        skipped: the ones it chose but left out: they did not fit in the heads memory budget.
    """

    pinned: tuple[str, ...] = ()
    preloaded: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()


# The parts of the trunk's readiness report a tenant's key does not read: the gate's figures
# count (and `lowest_head` names) every tenant's heads, `why` may name a head, `in_server`
# counts every tenant's batches.
TENANTS_UNSEEN = ("gate", "why", "in_server")


def head_bytes(info: BotInfo) -> int:
    """What a bot's head will take resident (as `Head.nbytes` counts it), from the registry's
    view alone: weights [1536, n] and biases [n] in float32, and the label strings."""
    return (FEATURE_DIM + 1) * info.n_classes * 4 + sum(sys.getsizeof(label)
                                                         for label in info.labels)


def _registered_at(info: BotInfo) -> datetime:
    try:
        when = datetime.fromisoformat(info.created)
    except (TypeError, ValueError):
        return datetime.min.replace(tzinfo=UTC)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def most_recent(infos: Sequence[BotInfo], n: int, *, exclude: Sequence[str] = ()) -> list[BotInfo]:
    """The `n` most recently registered bots (by their active version's registration time; ties
    by id), newest first, leaving out `exclude`."""
    skip = set(exclude)
    ordered = sorted((i for i in infos if i.bot_id not in skip),
                     key=lambda i: (_registered_at(i), i.bot_id), reverse=True)
    return ordered[:n]


def check_pinned_bots(store: HeadStore, pinned: Sequence[str], *, where: str = "the store"
                      ) -> None:
    """Refuses (PreloadError, one line naming each) pinned bots that are not registered."""
    missing = [b for b in pinned if not store.exists(b)]
    if missing:
        raise PreloadError(f"--pin: {', '.join(repr(b) for b in missing)} not registered in "
                           f"{where}; register {'them' if len(missing) > 1 else 'it'} first "
                           f"(multihead register) or leave {'them' if len(missing) > 1 else 'it'}"
                           f" out")


def preload_heads(store: HeadStore, pinned: Sequence[str], n: int) -> Preloaded:
    """Loads the pinned heads, then the heads of the `n` most recently registered other bots
    that fit in the store's heads memory budget. Blocking: run it in a worker thread.

    Preloaded heads are chosen newest first, each kept only if it fits beside what is already
    resident (a bigger one is skipped, a later smaller one may still fit), then loaded oldest
    first, so the newest ends up the most recently used: under memory pressure the cache evicts
    the older ones first.

    Raises:
        PreloadError: a pinned bot is not registered or its head cannot be loaded.
    """
    check_pinned_bots(store, pinned)
    for bot_id in pinned:
        try:
            store.get(bot_id)
        except UnknownBot:
            raise PreloadError(f"pinned bot {bot_id!r} is not registered") from None
        except HeadLoadError as exc:
            raise PreloadError(f"pinned bot {bot_id!r} cannot be loaded: {exc}") from None
    if n <= 0:
        return Preloaded(tuple(pinned))
    stats = store.cache_stats()
    budget, used = stats["memory_budget_bytes"], stats["resident_bytes"]
    chosen, skipped = [], []
    for info in most_recent(store.list(), n, exclude=pinned):
        size = head_bytes(info)
        if used + size > budget:
            skipped.append(info.bot_id)
            continue
        chosen.append(info.bot_id)
        used += size
    loaded = []
    for bot_id in reversed(chosen):
        try:
            store.get(bot_id)
        except (UnknownBot, HeadLoadError) as exc:  # removed meanwhile, or broken: not fatal
            log.warning("preload: bot %r not loaded: %s", bot_id, exc)
            continue
        loaded.append(bot_id)
    if skipped:
        log.warning("preload: %d of %d bots left out: their heads do not fit in the heads "
                    "memory budget (%.0f MiB) beside the ones already resident",
                    len(skipped), len(chosen) + len(skipped), budget / 2**20)
    return Preloaded(tuple(pinned), tuple(reversed(loaded)), tuple(skipped))


def import_runtime(plan) -> tuple[str, ...]:
    """Imports the packages a planned trunk's load needs (`backbone.trunk.TrunkPlan.packages`:
    no TensorFlow for a compiled model in the cache or an INT8 trunk); returns their names.
    Blocking."""
    from backbone.trunk import import_packages

    packages = plan.packages
    import_packages(packages, plan.request.device)
    return packages


def newest_int8_trunk(prefix: str):
    """The newest INT8 trunk calibrated for the checkpoint `prefix` (passing or not: a
    `backbone.quantize.Int8Artifact`), where `multihead quantize` writes them; None if none."""
    from backbone.checkpoint import cache_dir_of
    from backbone.quantize import Int8Artifact

    found = Int8Artifact.available(cache_dir_of(prefix), prefix)
    return found[0] if found else None


def gate_figures(gate: FidelityReport) -> dict[str, Any]:
    """An INT8 trunk's gate for /readyz: whether it passed, its figures against their bounds
    and the lowest head (its heads' agreements one by one are in GET /bots/{id})."""
    lowest = gate.lowest_head
    return {"passed": gate.passed, "images": gate.images, "heads": len(gate.agreement),
            "lowest_head": lowest[0] if lowest else None,
            "min_agreement": lowest[1] if lowest else None,
            "overall_agreement": gate.overall_agreement,
            "mean_cosine": gate.mean_cosine, "min_cosine": gate.min_cosine,
            "bounds": {"head_agreement": gate.min_agreement_bound,
                       "overall_agreement": gate.overall_agreement_bound,
                       "mean_cosine": gate.mean_cosine_bound},
            "failures": len(gate.failures)}


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


class Lifecycle:
    """Bring-up, readiness and drain of one process's service (see the module doc).

    Args:
        settings: the validated settings.
        store: the store (closed here at the end only if `own_store`).
        metrics: the metrics registry.
        threads: the service's executors (the lookup threads load the preloaded heads; shut
            down on close).
        engine_for: builds the engine around the trunk once it is warm: engine_for(trunk,
            batch size, the profile's seconds_at or None).
        on_ready: called once readiness says ready (gives the build's garbage back).
        trunk: an already-built trunk to use (tests, benchmark); it is then not closed here.
        own_store: whether `close()` closes the store.
        tracing: the tracer (shut down last on close), or None when tracing is off.
        int8: each bot's agreement with the INT8 trunk (judged at the bring-up; a fresh one by
            default).
    """

    def __init__(self, settings: Settings, store: HeadStore, metrics: Metrics, threads: Threads,
                 *, engine_for: Callable[..., Engine], on_ready: Callable[[], None],
                 trunk=None, own_store: bool = False, tracing: Tracing | None = None,
                 int8: Int8Agreement | None = None) -> None:
        self._settings = settings
        self._store = store
        self._metrics = metrics
        self._threads = threads
        self._engine_for = engine_for
        self._on_ready = on_ready
        self._given_trunk = trunk
        self._own_store = own_store
        self._tracing = tracing
        self._int8 = int8 if int8 is not None else Int8Agreement(store)
        self.readiness = Readiness()
        self.preloaded = Preloaded()
        self.trunk = None
        self.trunk_kind = "unknown"
        # The trunk's time per batch alone (`backbone.profile.BatchProfile`), once warm; None
        # before, with --no-warmup and no saved profile, or for a trunk given.
        self.batch_profile: BatchProfile | None = None
        self.engine: Engine | None = None
        # Who answers, for transports with several processes (the Ray replica sets it).
        self.identity: dict[str, Any] = {}
        self._bring_up_task: asyncio.Task | None = None

    # -- bring-up ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the bring-up in the background and returns at once (in the event loop)."""
        self._bring_up_task = asyncio.get_running_loop().create_task(self._bring_up())

    async def wait_ready(self) -> bool:
        """Waits for the bring-up to end; True if the service is ready."""
        if self._bring_up_task is not None:
            await asyncio.shield(self._bring_up_task)
        return self.readiness.ready

    async def _preload(self) -> None:
        """Pinned and preloaded heads, beside the trunk build (numpy and file reads only)."""
        settings = self._settings
        start = time.perf_counter()
        self.preloaded = await self._threads.lookup(
            preload_heads, self._store, settings.pinned_bots, settings.preload)
        self.readiness.timings["preload_s"] = time.perf_counter() - start
        self._metrics.set_preloaded_heads(len(self.preloaded.preloaded))
        if settings.pinned_bots or settings.preload:
            log.info("heads resident before ready: %d pinned, %d preloaded (%d skipped: over "
                     "the heads memory budget) in %.2fs", len(self.preloaded.pinned),
                     len(self.preloaded.preloaded), len(self.preloaded.skipped),
                     self.readiness.timings["preload_s"])

    async def _bring_up(self) -> None:
        readiness = self.readiness
        loop = asyncio.get_running_loop()
        preload = loop.create_task(self._preload())
        try:
            await self._bring_up_trunk(loop)
        except Exception as exc:  # noqa: BLE001 - reported by readiness and the log
            readiness.status, readiness.error = FAILED, f"trunk failed to load: {exc}"
            log.error("%s", readiness.error, exc_info=exc)
            discard_prefetched()  # `serve`'s early load of it, if any, is not taken now
            await asyncio.wait([preload])
            if not preload.cancelled() and preload.exception() is not None:
                log.error("head preload failed too: %s", preload.exception())
            return
        try:
            await preload
        except Exception as exc:  # noqa: BLE001 - reported by readiness and the log
            readiness.status, readiness.error = FAILED, f"head preload failed: {exc}"
            log.error("%s", readiness.error, exc_info=not isinstance(exc, PreloadError))
            return
        readiness.timings["ready_s"] = time.monotonic() - readiness.started_s
        readiness.status = READY
        self._on_ready()
        log.info("ready: trunk %s (%s) in %.1fs", self.trunk.checkpoint_prefix, self.trunk_kind,
                 readiness.timings["ready_s"])

    async def _bring_up_trunk(self, loop: asyncio.AbstractEventLoop) -> None:
        """Resolve the trunk, import its runtime, build or import it and restore it, warm it
        up (and take its batch profile), then start the engine."""
        settings, readiness = self._settings, self.readiness
        trunk = self._given_trunk
        if trunk is None:
            from backbone import Trunk
            from backbone.checkpoint import cache_dir_of, default_trunk_checkpoint

            prefix = settings.trunk_checkpoint or default_trunk_checkpoint(settings.store)
            self.trunk_kind = trunk_kind(prefix)
            # Next to the trunk checkpoint: <store>/trunk/graph_cache for the store's own trunk.
            # The INT8 trunks `multihead quantize` writes there are found without the cache.
            cache_dir = cache_dir_of(prefix) if settings.graph_cache else None
            # NOTE: `auto` passes over an INT8 trunk whose gate fails for an active bot.
            plan = await loop.run_in_executor(None, lambda: Trunk.plan(
                prefix, device=settings.device, graph_cache_dir=cache_dir,
                precision=settings.precision, runtime=settings.runtime,
                int8_dir=cache_dir_of(prefix), heads=self._int8.judge))
            start = time.perf_counter()
            packages = await loop.run_in_executor(None, import_runtime, plan)
            readiness.timings["import_s"] = time.perf_counter() - start
            log.info("imported %s in %.2fs%s", " and ".join(packages) or "nothing",
                     readiness.timings["import_s"],
                     "" if "tensorflow" in packages else
                     " (no TensorFlow: the trunk loads without it)")
            trunk = await loop.run_in_executor(None, lambda: Trunk.load(
                plan, warmup_batch_sizes=()))
            readiness.timings.update(build_s=trunk.timings.build_s,
                                     restore_s=trunk.timings.restore_s,
                                     compile_s=trunk.timings.compile_s)
        self.trunk = trunk
        self.trunk_kind = trunk_kind(trunk.checkpoint_prefix)
        await loop.run_in_executor(None, self._judge_bots, trunk)
        self._metrics.bind_int8_agreement(self._int8.current)
        self._metrics.bind_trunk_profile(
            lambda: self.batch_profile.seconds if self.batch_profile is not None else None)
        calibration = getattr(trunk, "calibration", None)
        self._metrics.set_trunk(device=trunk.device,
                                runtime=getattr(trunk, "runtime", "tf"),
                                precision=getattr(trunk, "precision", "fp32"),
                                calibration=calibration)
        start = time.perf_counter()
        self.batch_profile = await loop.run_in_executor(None, self._warm_up, trunk)
        readiness.timings["warmup_s"] = time.perf_counter() - start
        self.engine = self._engine_for(
            trunk, self.batch_size(),
            self.batch_profile.seconds_at if self.batch_profile is not None else None)
        self._metrics.set_batch_size(self.engine.batcher.max_batch_size,
                                     self.engine.batcher.sharing.shared)
        await self.engine.batcher.start()

    def batch_size(self) -> int:
        """The batcher's batch size: the profile's working size (`BatchProfile.working_size`),
        at most --max-batch-size; --max-batch-size without a profile or with
        --no-batch-from-profile."""
        settings = self._settings
        if settings.batch_from_profile and self.batch_profile is not None:
            return min(settings.max_batch_size, self.batch_profile.working_size())
        return settings.max_batch_size

    def _warm_up(self, trunk) -> BatchProfile | None:
        """Warms the trunk up and returns its batch profile: the saved one (then the usual
        warm-up runs), else measured when warm-up is on (its first runs warm every size up),
        else None (--no-warmup without a saved profile; a trunk given). Blocking."""
        from backbone.checkpoint import cache_dir_of

        settings = self._settings
        sizes = warmup_batch_sizes(settings.max_batch_size, trunk.device) if settings.warmup else ()
        profile = None
        if self._given_trunk is None:
            cache_dir = cache_dir_of(trunk.checkpoint_prefix) if settings.graph_cache else None
            profile = profile_trunk(trunk, max_batch_size=settings.max_batch_size,
                                    cache_dir=cache_dir, measure_if_missing=settings.warmup)
        if profile is None or profile.source == CACHED:
            warm_up(trunk.features, sizes)
        return profile

    def _judge_bots(self, trunk) -> None:
        """Scores the active bots on the INT8 trunk the choice judged, else on the newest one
        calibrated for the trunk's checkpoint (a trunk given, or a float precision asked for),
        if any. Blocking."""
        choice = getattr(trunk, "choice", None)
        artifact = choice.judged if choice is not None else None
        try:
            if artifact is None:
                artifact = newest_int8_trunk(trunk.checkpoint_prefix)
            if artifact is None:
                return
            if self._int8.artifact is None or self._int8.artifact.key != artifact.key:
                self._int8.attach(artifact)
            self._int8.refresh()
        except (OSError, ValueError) as exc:  # unreadable: serve, without agreements
            log.warning("INT8 agreement of the bots not scored: %s", exc)

    # -- drain -------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Waits for a running bring-up, drains the engine, closes the store and the trunk."""
        if self._bring_up_task is not None and not self._bring_up_task.done():
            await self._bring_up_task
        self._int8.close()
        if self.engine is not None:
            await self.engine.close()
        await self._threads.close()
        if self._own_store:
            self._store.close()
        if self._given_trunk is None and self.trunk is not None:
            self.trunk.close()
        if self._tracing is not None:  # the last spans (the drained batches') go out now
            await asyncio.get_running_loop().run_in_executor(None, self._tracing.shutdown)

    # -- readiness, and what operations read -------------------------------------------------------

    def require_ready(self) -> None:
        """`NotReady` (503 + Retry-After) while loading or after a failure."""
        if not self.readiness.ready:
            raise NotReady(self.readiness.error or "the trunk is still loading; retry shortly")

    def trunk_info(self) -> dict[str, Any]:
        """The trunk for /readyz and the page: weights, checkpoint, device, runtime,
        precision and why it was chosen; an INT8 trunk also its float layers' precision and
        calibration set; where one was judged, its gate's figures."""
        info: dict[str, Any] = {"weights": self.trunk_kind}
        if self.trunk is not None:
            info.update(checkpoint=self.trunk.checkpoint_prefix, device=self.trunk.device,
                        runtime=getattr(self.trunk, "runtime", "tf"),
                        precision=getattr(self.trunk, "precision", "fp32"))
            calibration = getattr(self.trunk, "calibration", None)
            if calibration is not None:
                info.update(float_precision=self.trunk.float_precision,
                            calibration=calibration.to_json())
            choice = getattr(self.trunk, "choice", None)
            if choice is not None:
                info["why"] = choice.why
                if choice.gate is not None:
                    info["gate"] = gate_figures(choice.gate)
        if self.batch_profile is not None:
            info["profile"] = self.batch_profile.report()
        if self.engine is not None:
            info["batch_size"] = self.engine.batcher.max_batch_size
            info["shared_batch_size"] = self.engine.batcher.sharing.shared
            info["light_batch_size"] = self.engine.batcher.sharing.light
            # Whether the trunk runs alone on the cores, and the heads' BLAS threads (1 then).
            info["cores"] = {"owned": self.engine.cores.exclusive,
                             "blas_threads": self.engine.blas_threads}
            if self.engine.live is not None:  # the profile as live batches run it here
                info["live_batch_ms"] = self.engine.live.report()
                # The work around a batch's trunk that deadlines allow (`Schedule.around_s`).
                info["around_ms"] = round(1000 * self.engine.batcher.deadlines.around_s(), 3)
        in_server = self._metrics.trunk_in_server()
        if in_server:
            info["in_server"] = {
                "batch_ms": {str(n): round(1000 * mean, 3) for n, (_, mean) in in_server.items()},
                "batches": {str(n): count for n, (count, _) in in_server.items()}}
        return info

    def readiness_report(self, scope: Scope | None = None) -> dict[str, Any]:
        """The one description of readiness: status, trunk, timings (and error if failed).

        With a `scope` (a tenant's key): its own bots only among the pinned, preloaded and
        skipped heads, and the trunk without what counts every tenant's heads or traffic (the
        gate's figures over all heads, the choice's `why` that may name one, the batches run
        inside the server)."""
        r, p = self.readiness, self.preloaded
        mine = (lambda bots: list(bots)) if scope is None else (
            lambda bots: [b for b in bots if b in scope.bots])
        heads: dict[str, Any] = {"pinned": mine(self._settings.pinned_bots),
                                 "preloaded": len(mine(p.preloaded))}
        if mine(p.skipped):
            heads["preload_skipped"] = len(mine(p.skipped))
        snapshot = self._store.snapshot
        trunk = self.trunk_info()
        if scope is not None:
            for part in TENANTS_UNSEEN:
                trunk.pop(part, None)
        body: dict[str, Any] = {"status": r.status, "trunk": trunk,
                                "timings": {k: round(v, 3) for k, v in r.timings.items()},
                                "heads": heads,
                                "store": {"kind": self._store.kind, "read": snapshot.is_read,
                                          "snapshot_age_s": round(
                                              self._store.snapshot_age_s(), 3),
                                          "serving_processes": self._store.processes.count()}}
        if r.error:
            body["error"] = r.error
        if self.identity:
            body["replica"] = dict(self.identity)
        return body

    def render_metrics(self, scope: Scope | None = None) -> tuple[bytes, str]:
        """The Prometheus text (and its content type), the heads cache gauges read now; the
        bots' INT8 agreements as last scored (and a refresh started for the next scrape).
        With a `scope` (a tenant's key): its own series only (`metrics_scope.scoped`)."""
        self._int8.refresh_soon()
        stats = self._store.cache_stats()
        self._metrics.set_resident_heads(stats["resident_heads"], stats["resident_bytes"])
        body, content_type = self._metrics.render()
        return (body if scope is None else scoped(body, scope)), content_type
