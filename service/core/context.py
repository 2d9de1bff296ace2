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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from accounts import Candidate
from accounts.tenants import DEFAULT_TENANT, ApiKey, AuditRecord, TenantInfo, TenantLimits
from accounts.tenants import OPERATOR as OPERATOR_ACTOR
from backbone.spec import FEATURE_DIM
from backbone.tfimport import import_tensorflow
from backbone.trunk import warm_up
from heads import Head, HeadLoadError, UnknownBot
from service.core import logs, memory
from service.core.admission import ByteBudget
from service.core.auth import MANAGE, Authenticator, Principal
from service.core.candidates import CandidateStats
from service.core.engine import Engine, Images, Prediction
from service.core.errors import (
    Forbidden,
    HeadUnavailable,
    NotReady,
    ServiceError,
)
from service.core.metrics import Metrics
from service.core.quota import Quotas
from service.core.settings import Settings
from service.core.tracing import Tracing
from store import BotInfo, HeadStore, StoreUnavailable

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


# -- hot bots: heads loaded before ready ---------------------------------------------------------

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
        tracer_provider: an OpenTelemetry SDK tracer provider to trace with (tests); by
            default tracing follows the settings and the OTEL_* variables
            (`Tracing.configure`), and is off unless they turn it on.
    """

    def __init__(self, settings: Settings, *, trunk=None, store: HeadStore | None = None,
                 metrics: Metrics | None = None, tracer_provider: Any = None) -> None:
        self.settings = settings
        # None when tracing is off: then no OpenTelemetry module is even imported.
        self.tracing: Tracing | None = (Tracing(tracer_provider) if tracer_provider is not None
                                        else Tracing.configure(settings.tracing))
        logs.register_secret(settings.admin_token)
        self.metrics = metrics or Metrics(top_bots=settings.metrics_top_bots,
                                          top_tenants=settings.metrics_top_tenants)
        self._own_store = store is None
        pinned = settings.pinned_bots
        if store is not None and set(store.pinned) != set(pinned):
            # NOTE: what /bots and /metrics call pinned must be what the cache never evicts.
            raise ValueError(f"the given store pins {sorted(store.pinned)}, the settings "
                             f"{sorted(pinned)}: open it with pinned=settings.pinned_bots")
        self.store = store if store is not None else HeadStore(
            settings.store, heads_memory_mb=settings.heads_memory_mb, pinned=pinned)
        self.auth = Authenticator(settings.auth, settings.admin_token,
                                  keys=self.store.key_table, mark_used=self.store.mark_used)
        # Fair sharing: each tenant's settings from the store (read from memory, re-read when
        # the store changes), the serve flags for what a tenant leaves unset.
        self.quotas = Quotas(self.tenant_rate, divisor=settings.quota_divisor)
        self._tenant_defaults = TenantLimits(
            weight=settings.tenant_weight, rate=settings.tenant_rate,
            burst=settings.tenant_burst, max_queued=settings.tenant_max_queued)
        self._limits_table: dict | None = None
        self._limits_filled: dict[str, TenantLimits] = {}
        self.preloaded = Preloaded()
        # The comparison of each bot's candidate with its live version, in this process.
        self.candidate_stats = CandidateStats()
        self.metrics.set_pinned_bots(pinned)
        self.metrics.bind_pinned_heads(
            lambda: self.store.cache_stats().get("pinned_resident", 0))
        self._given_trunk = trunk
        self.trunk = None
        self.trunk_kind = "unknown"
        self.engine: Engine | None = None
        self.readiness = Readiness()
        # Who answers, for transports with several processes (the Ray replica sets it).
        self.identity: dict[str, Any] = {}
        # Admission: every transport of this process reserves request bytes here first. The
        # memory of a burst of large bodies goes back to the OS when it is over; so does what
        # the trunk's build freed, once ready (service.core.memory).
        self.trimmer = memory.Trimmer()
        self.inflight = ByteBudget(settings.max_inflight_bytes, on_burst_end=self.trimmer)
        self.metrics.bind_inflight_bytes(lambda: self.inflight.used_bytes)
        self._bring_up_task: asyncio.Task | None = None
        # NOTE: head lookups (the hot path, milliseconds at most) get their own threads, so
        # they never queue behind body parsing or registrations on the default executor.
        self._lookups = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="multihead-lookup")

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the bring-up in the background and returns at once."""
        if self.auth.keys_enabled:
            log.info("auth: API keys (a key sees only its tenant's bots); operator token %s",
                     "set" if self.settings.admin_token else "unset (tenant and key routes "
                     "disabled)")
        else:
            log.warning("auth none: no API keys; every client that reaches the port may list "
                        "and call every bot")
        self._bring_up_task = asyncio.get_running_loop().create_task(self._bring_up())

    async def wait_ready(self) -> bool:
        """Waits for the bring-up to end; True if the service is ready."""
        if self._bring_up_task is not None:
            await asyncio.shield(self._bring_up_task)
        return self.readiness.ready

    async def _preload(self) -> None:
        """Pinned and preloaded heads, beside the trunk build (numpy and file reads only)."""
        settings = self.settings
        start = time.perf_counter()
        self.preloaded = await asyncio.get_running_loop().run_in_executor(
            self._lookups, preload_heads, self.store, settings.pinned_bots, settings.preload)
        self.readiness.timings["preload_s"] = time.perf_counter() - start
        self.metrics.set_preloaded_heads(len(self.preloaded.preloaded))
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
        self.trimmer()  # the build's and restore's garbage (TF graph, checkpoint reads)
        log.info("ready: trunk %s (%s) in %.1fs", self.trunk.checkpoint_prefix, self.trunk_kind,
                 readiness.timings["ready_s"])

    async def _bring_up_trunk(self, loop: asyncio.AbstractEventLoop) -> None:
        """Import, build, restore and warm the trunk, then start the engine."""
        settings, readiness = self.settings, self.readiness
        trunk = self._given_trunk
        if trunk is None:
            from backbone.checkpoint import cache_dir_of, default_trunk_checkpoint

            start = time.perf_counter()
            await loop.run_in_executor(None, import_tensorflow, settings.device)
            readiness.timings["import_s"] = time.perf_counter() - start
            from backbone import Trunk

            prefix = settings.trunk_checkpoint or default_trunk_checkpoint(settings.store)
            self.trunk_kind = trunk_kind(prefix)
            # Next to the trunk checkpoint: <store>/trunk/graph_cache for the store's own trunk.
            # The INT8 trunks `multihead quantize` writes there are found without the cache.
            cache_dir = cache_dir_of(prefix) if settings.graph_cache else None
            trunk = await loop.run_in_executor(None, lambda: Trunk.from_checkpoint(
                prefix, device=settings.device, warmup_batch_sizes=(),
                graph_cache_dir=cache_dir, precision=settings.precision,
                runtime=settings.runtime, int8_dir=cache_dir_of(prefix)))
            readiness.timings.update(build_s=trunk.timings.build_s,
                                     restore_s=trunk.timings.restore_s,
                                     compile_s=trunk.timings.compile_s)
        self.trunk = trunk
        self.trunk_kind = trunk_kind(trunk.checkpoint_prefix)
        calibration = getattr(trunk, "calibration", None)
        self.metrics.set_trunk(device=trunk.device,
                               runtime=getattr(trunk, "runtime", "tf"),
                               precision=getattr(trunk, "precision", "fp32"),
                               calibration=calibration)
        sizes = warmup_batch_sizes(settings.max_batch_size, trunk.device) if settings.warmup else ()
        readiness.timings["warmup_s"] = await loop.run_in_executor(
            None, warm_up, trunk.features, sizes)
        self.engine = Engine(trunk, settings, self.metrics, quotas=self.quotas,
                             weight=self.tenant_weight, max_queued=self.tenant_max_queued,
                             tracing=self.tracing,
                             candidate_stats=self.candidate_stats)
        await self.engine.batcher.start()

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
        if self.tracing is not None:  # the last spans (the drained batches') go out now
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    # -- readiness ------------------------------------------------------------------------------

    def require_ready(self) -> None:
        """`NotReady` (503 + Retry-After) while loading or after a failure. A request checks it
        once, through `heads_for` / `head`."""
        if not self.readiness.ready:
            raise NotReady(self.readiness.error or "the trunk is still loading; retry shortly")

    def trunk_info(self) -> dict[str, Any]:
        """The trunk for /readyz and the page: weights, checkpoint, device, runtime,
        precision; an INT8 trunk also its float layers' precision and calibration set."""
        info: dict[str, Any] = {"weights": self.trunk_kind}
        if self.trunk is not None:
            info.update(checkpoint=self.trunk.checkpoint_prefix, device=self.trunk.device,
                        runtime=getattr(self.trunk, "runtime", "tf"),
                        precision=getattr(self.trunk, "precision", "fp32"))
            calibration = getattr(self.trunk, "calibration", None)
            if calibration is not None:
                info.update(float_precision=self.trunk.float_precision,
                            calibration=calibration.to_json())
        return info

    def readiness_report(self) -> dict[str, Any]:
        """The one description of readiness: status, trunk, timings (and error if failed)."""
        r, p = self.readiness, self.preloaded
        heads: dict[str, Any] = {"pinned": list(self.settings.pinned_bots),
                                 "preloaded": len(p.preloaded)}
        if p.skipped:
            heads["preload_skipped"] = len(p.skipped)
        body: dict[str, Any] = {"status": r.status, "trunk": self.trunk_info(),
                                "timings": {k: round(v, 3) for k, v in r.timings.items()},
                                "heads": heads}
        if r.error:
            body["error"] = r.error
        if self.identity:
            body["replica"] = dict(self.identity)
        return body

    # -- tenants' shares of the trunk (from memory: called per request and per batch) --------

    def tenant_limits(self, tenant: str) -> TenantLimits:
        """`tenant`'s limits, each its own or else the serve default (`TenantLimits.filled`).
        Called per request and per batch row: kept per tenant until the store's table of
        limits is re-read (`HeadStore.tenant_limits` returns the same dict until then)."""
        table = self.store.tenant_limits()
        if table is not self._limits_table:
            self._limits_table, self._limits_filled = table, {}
        filled = self._limits_filled.get(tenant)
        if filled is None:
            own = table.get(tenant) or TenantLimits()
            filled = self._limits_filled[tenant] = own.filled(self._tenant_defaults)
        return filled

    def tenant_weight(self, tenant: str) -> float:
        return self.tenant_limits(tenant).weight

    def tenant_rate(self, tenant: str) -> tuple[float | None, int | None]:
        """(images per second, burst): None is no quota, and the quota's default burst."""
        limits = self.tenant_limits(tenant)
        return limits.rate, limits.burst

    def tenant_max_queued(self, tenant: str) -> int | None:
        return self.tenant_limits(tenant).max_queued

    # -- the store, off the event loop -----------------------------------------------------------

    def caller(self, authorization: str | None, access: str, *,
               route_key: str | None = None) -> Caller:
        """This service as the caller of one call sees it, after checking that the caller
        may call an endpoint with rule `access` (`service.core.auth`): the one place where a
        call's credential is read, for every transport. `route_key` is the call's routing key
        for canaries (`service.core.candidates.ROUTE_KEY_HEADER`), if it carries one.

        Raises:
            Unauthorized, Forbidden: see `Authenticator.identify` and `authorize`.
        """
        principal = self.auth.admit(authorization, access)
        if principal.tenant is not None:
            logs.note(tenant=principal.tenant)
        return Caller(self, principal, route_key=route_key)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the default executor (parsing, registrations, file writes)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def _lookup(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._lookups, fn, *args)

    async def heads_for(self, bot_ids: Sequence[str]) -> list[Head]:
        """The active heads of the bots a request will be scored with.

        This is a request's one readiness check, before any work on it: NotReady (503 +
        Retry-After) while the trunk loads or after it failed; then UnknownBot (404),
        HeadUnavailable, StoreUnavailable per bot, in order.
        """
        logs.note(bots=bot_ids)
        self.require_ready()
        # NOTE: resolved once per request: the request keeps this version even if the bot is
        # replaced or removed while it waits in the queue.
        heads = [await self._head(bot_id) for bot_id in bot_ids]
        logs.note(heads=heads)
        return heads

    async def head(self, bot_id: str) -> Head:
        """`heads_for([bot_id])[0]`: readiness, then the bot's active head."""
        (head,) = await self.heads_for([bot_id])
        return head

    async def _head(self, bot_id: str) -> Head:
        try:
            return await self._lookup(self.store.get, bot_id)
        except StoreUnavailable:
            raise  # the database is down and the head is not resident: 503, retry
        except HeadLoadError as exc:
            log.error("bot %r cannot be loaded: %s", bot_id, exc)
            raise HeadUnavailable(f"bot '{bot_id}' is registered but its head cannot be "
                                  f"loaded") from None

    async def info(self, bot_id: str) -> BotInfo:
        return await self._lookup(self.store.info, bot_id)

    async def bots(self) -> list[BotInfo]:
        return await self._lookup(self.store.list)

    def is_pinned(self, bot_id: str) -> bool:
        """Whether the bot's head is pinned (always resident, never evicted)."""
        return bot_id in self.settings.pinned_bots

    def candidate_report(self, info: BotInfo) -> dict | None:
        """The bot's candidate as `GET /bots/{id}` shows it to a caller that may manage the
        bot: the registry's view and this process's comparison with the live version (`stats`:
        `CandidateStats.report`). None if it has no candidate."""
        if info.candidate is None:
            return None
        return {**info.candidate.to_dict(with_source=False),
                "stats": self.candidate_stats.report(info.bot_id, info.candidate.version)}

    # -- bot changes (admin), off the event loop ---------------------------------------------

    def register_checkpoint(self, bot_id: str, prefix: Path, labels_path: Path,
                            **options: Any) -> int:
        """Registers a head checkpoint as the bot's new active version; returns the version
        (`options` as `HeadStore.register_checkpoint` takes them: `tenant`, `actor`, ...).
        Blocking (it reads the checkpoint): call it in a worker thread (`run_blocking`)."""
        return self.store.register_checkpoint(bot_id, prefix, labels_path, **options)

    async def remove(self, bot_id: str, *, actor: str = OPERATOR_ACTOR) -> None:
        """Removes a bot and every version of it."""
        await self.run_blocking(functools.partial(self.store.remove, bot_id, actor=actor))

    async def rollback(self, bot_id: str, to: int | None, *,
                       actor: str = OPERATOR_ACTOR) -> int:
        """Makes version `to` (default: the previous one) the bot's active version."""
        return await self.run_blocking(functools.partial(self.store.rollback, bot_id, to,
                                                         actor=actor))

    async def promote(self, bot_id: str, *, actor: str = OPERATOR_ACTOR) -> tuple[int, int]:
        """Makes the bot's candidate its active version: (previous, new active version)."""
        return await self.run_blocking(functools.partial(self.store.promote, bot_id,
                                                         actor=actor))

    async def discard(self, bot_id: str, *, actor: str = OPERATOR_ACTOR) -> int:
        """Deletes the bot's candidate; returns its version."""
        return await self.run_blocking(functools.partial(self.store.discard, bot_id,
                                                         actor=actor))

    # -- tenants, keys, audit (the operator's; a manage key reads its tenant's audit) --------

    async def tenants(self) -> list[TenantInfo]:
        return await self.run_blocking(self.store.tenants)

    async def add_tenant(self, name: str, *, actor: str = OPERATOR_ACTOR,
                         limits: TenantLimits | None = None) -> TenantInfo:
        return await self.run_blocking(functools.partial(self.store.add_tenant, name,
                                                         actor=actor, limits=limits))

    async def set_tenant_limits(self, name: str, *, actor: str = OPERATOR_ACTOR,
                                **changes: float | int | None) -> TenantLimits:
        """Changes a tenant's limits (`HeadStore.set_tenant_limits`: None is back to the serve
        default, a limit not given keeps its value); returns them."""
        return await self.run_blocking(functools.partial(self.store.set_tenant_limits, name,
                                                         actor=actor, **changes))

    async def remove_tenant(self, name: str, *, force: bool = False,
                            actor: str = OPERATOR_ACTOR) -> None:
        await self.run_blocking(functools.partial(self.store.remove_tenant, name, force=force,
                                                  actor=actor))

    async def keys(self, tenant: str | None = None) -> list[ApiKey]:
        return await self.run_blocking(self.store.keys, tenant)

    async def add_key(self, tenant: str, scope: str, *,
                      actor: str = OPERATOR_ACTOR) -> tuple[ApiKey, str]:
        return await self.run_blocking(functools.partial(self.store.add_key, tenant, scope,
                                                         actor=actor))

    async def revoke_key(self, key_id: str, *, actor: str = OPERATOR_ACTOR) -> ApiKey:
        return await self.run_blocking(functools.partial(self.store.revoke_key, key_id,
                                                         actor=actor))

    async def audit(self, *, tenant: str | None = None, since: str | None = None,
                    limit: int = 1000) -> list[AuditRecord]:
        return await self.run_blocking(functools.partial(self.store.audit, tenant=tenant,
                                                         since=since, limit=limit))

    # -- operations --------------------------------------------------------------------------

    def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus text (and its content type), the heads cache gauges read now."""
        stats = self.store.cache_stats()
        self.metrics.set_resident_heads(stats["resident_heads"], stats["resident_bytes"])
        return self.metrics.render()

    # -- classification ---------------------------------------------------------------------------

    def deadline(self) -> float:
        return time.monotonic() + self.settings.request_timeout_s

    async def classify(self, images: Images, heads: Sequence[Head], *,
                       top_k: int, tenant: str = DEFAULT_TENANT,
                       route_key: str | None = None) -> list[list[Prediction]]:
        """Every image under every head: result[i][j] is image i under heads[j], charged to
        `tenant` (quota, fair share). A bot's candidate, if it has one, is scored beside it
        and a canary answers its share of the requests, by `route_key` (else the first image's
        digest): `service.core.candidates`.

        `heads` come from `heads_for()` / `head()`, which checked readiness for the request: the
        engine exists from then on (it is started before readiness says ready, and readiness
        never goes back).
        """
        engine = self.engine
        assert engine is not None, "heads_for() checks readiness before a request is scored"
        candidates = await self._candidates(heads, len(images))
        if images.arrays is not None:
            return await engine.classify_arrays(images.arrays, heads, top_k=top_k,
                                                deadline=self.deadline(), tenant=tenant,
                                                candidates=candidates, route_key=route_key)
        return await engine.classify(images.encoded, heads, top_k=top_k,
                                     deadline=self.deadline(), tenant=tenant,
                                     candidates=candidates, route_key=route_key)

    async def _candidates(self, heads: Sequence[Head], n_images: int
                          ) -> tuple[Candidate | None, ...]:
        """The candidate of each head's bot (None for a bot without one), or () when none has
        one: then no thread hop (the store answers from memory)."""
        if not any(self.store.has_candidate(h.bot_id) for h in heads):
            return ()
        return tuple(await self._lookup(self._load_candidates, heads, n_images))

    def _load_candidates(self, heads: Sequence[Head], n_images: int) -> list[Candidate | None]:
        out: list[Candidate | None] = []
        for head in heads:
            try:
                candidate = self.store.candidate(head.bot_id)
            except HeadLoadError as exc:  # StoreUnavailable too: the live version answers
                candidate = None
                found = self.store.candidate_mode(head.bot_id)
                log.error("candidate of bot %r cannot be loaded: %s", head.bot_id, exc)
                if found is not None:
                    self.candidate_stats.observe(head.bot_id, found[0], found[1].mode, None,
                                                 failed=n_images)
                    self.metrics.observe_candidate(head.bot_id, found[0], failed=n_images)
            if candidate is not None and candidate.head.version == head.version:
                candidate = None  # promoted since the request took its head
            out.append(candidate)
        return out


class Caller:
    """The `Service` as the caller of one call sees it: what `dispatch` (and the gRPC
    transport) hand to a codec, so that every protocol gets the same tenant rules at one place.

    A key's caller reaches only its tenant's bots: another tenant's bot is an unknown bot (the
    same UnknownBot, 404 / NOT_FOUND, same body) for every lookup, listing and change, and a
    new bot goes into the key's tenant. The operator (and anyone with --auth none) reaches
    every bot; a new bot goes into the tenant asked for, else `default`. Changes are recorded
    in the audit log under the caller's name. Everything else is the `Service`'s own.

    A classification is charged to the tenant that owns the bots (a key's own tenant; for the
    operator, the tenant of the first bot named): its quota and fair share (`Engine`).
    """

    def __init__(self, service: Service, principal: Principal, *,
                 route_key: str | None = None) -> None:
        self._service = service
        self.principal = principal
        self.route_key = route_key  # the call's routing key for canaries, if it gave one
        self._charged: str | None = None  # the tenant of this call's classification

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)

    @property
    def tenant(self) -> str | None:
        """The one tenant this caller sees, or None for every tenant."""
        return self.principal.tenant

    def may(self, access: str) -> bool:
        """Whether this caller may call an endpoint with rule `access`."""
        return self._service.auth.allows(access, self.principal)

    async def _own(self, bot_id: str) -> None:
        if self.tenant is None:
            return
        owner = await self._service._lookup(self._service.store.owner, bot_id)
        if owner != self.tenant:
            raise UnknownBot(bot_id)

    async def heads_for(self, bot_ids: Sequence[str]) -> list[Head]:
        logs.note(bots=bot_ids)
        self._service.require_ready()
        for bot_id in bot_ids:
            await self._own(bot_id)
        heads = await self._service.heads_for(bot_ids)
        self._charged = self._charge_to(heads)
        logs.note(tenant=self._charged)
        return heads

    def _charge_to(self, heads: Sequence[Head]) -> str:
        if self.tenant is not None:
            return self.tenant
        if not heads:
            return DEFAULT_TENANT
        try:
            return self._service.store.owner(heads[0].bot_id)
        except UnknownBot:  # removed since its head was resolved: the request still runs
            return DEFAULT_TENANT

    async def classify(self, images: Images, heads: Sequence[Head], *,
                       top_k: int, route_key: str | None = None) -> list[list[Prediction]]:
        """As `Service.classify`; `route_key` (an OIP request's parameter) wins over the call's
        own (its header or metadata)."""
        tenant = self._charged if self._charged is not None else self._charge_to(heads)
        return await self._service.classify(images, heads, top_k=top_k, tenant=tenant,
                                            route_key=route_key or self.route_key)

    async def head(self, bot_id: str) -> Head:
        (head,) = await self.heads_for([bot_id])
        return head

    async def info(self, bot_id: str) -> BotInfo:
        await self._own(bot_id)
        return await self._service.info(bot_id)

    def candidate_report(self, info: BotInfo) -> dict | None:
        """The candidate of a bot this caller reached, as a caller that may manage it sees it;
        refused (Forbidden) to one that may not."""
        if not self.may(MANAGE):
            raise Forbidden("a bot's candidate is shown to a manage key or the operator only")
        return self._service.candidate_report(info)

    async def bots(self) -> list[BotInfo]:
        infos = await self._service.bots()
        return infos if self.tenant is None else [i for i in infos if i.tenant == self.tenant]

    def tenant_for(self, bot_id: str, asked: str | None) -> str:
        """Where a registration of `bot_id` by this caller goes: a key's own tenant (naming
        another is 403); for the operator the tenant asked for, else the bot's own if it
        exists, else `default`. Blocking (a store lookup)."""
        if self.tenant is not None:
            if asked not in (None, self.tenant):
                raise Forbidden("an API key registers bots in its own tenant only")
            return self.tenant
        if asked is not None:
            return asked
        try:
            return self._service.store.owner(bot_id)
        except UnknownBot:
            return DEFAULT_TENANT

    def register_checkpoint(self, bot_id: str, prefix: Path, labels_path: Path,
                            **options: Any) -> int:
        options["tenant"] = self.tenant_for(bot_id, options.get("tenant"))
        return self._service.register_checkpoint(bot_id, prefix, labels_path,
                                                 actor=self.principal.actor, **options)

    async def remove(self, bot_id: str) -> None:
        await self._own(bot_id)
        await self._service.remove(bot_id, actor=self.principal.actor)

    async def rollback(self, bot_id: str, to: int | None) -> int:
        await self._own(bot_id)
        return await self._service.rollback(bot_id, to, actor=self.principal.actor)

    async def promote(self, bot_id: str) -> tuple[int, int]:
        await self._own(bot_id)
        return await self._service.promote(bot_id, actor=self.principal.actor)

    async def discard(self, bot_id: str) -> int:
        await self._own(bot_id)
        return await self._service.discard(bot_id, actor=self.principal.actor)

    async def add_tenant(self, name: str, *, limits: TenantLimits | None = None) -> TenantInfo:
        return await self._service.add_tenant(name, actor=self.principal.actor, limits=limits)

    async def set_tenant_limits(self, name: str, **changes: float | int | None) -> TenantLimits:
        return await self._service.set_tenant_limits(name, actor=self.principal.actor,
                                                     **changes)

    async def remove_tenant(self, name: str, *, force: bool = False) -> None:
        await self._service.remove_tenant(name, force=force, actor=self.principal.actor)

    async def add_key(self, tenant: str, scope: str) -> tuple[ApiKey, str]:
        return await self._service.add_key(tenant, scope, actor=self.principal.actor)

    async def revoke_key(self, key_id: str) -> ApiKey:
        return await self._service.revoke_key(key_id, actor=self.principal.actor)

    async def audit(self, *, tenant: str | None = None, since: str | None = None,
                    limit: int = 1000) -> list[AuditRecord]:
        if self.tenant is not None:
            if tenant not in (None, self.tenant):
                raise Forbidden("an API key reads its own tenant's audit log only")
            tenant = self.tenant
        return await self._service.audit(tenant=tenant, since=since, limit=limit)
