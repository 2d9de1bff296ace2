"""The protocol-agnostic service of one process: settings, store, trunk, engine, readiness.

Every transport (the aiohttp app, a Ray Serve replica, the gRPC server) owns one `Service`
and hands each call's `Caller` (`Service.caller`) to the codecs' endpoints; nothing here knows
HTTP. The service is composed of one part per concern, each a module of its own:

    lifecycle   bring-up, readiness, drain; hot bots; what operations read
    bots        heads, versions, candidates and their changes
    tenancy     tenants, keys, audit, limits (the engine's per-tenant callbacks)
    inference   classification on the engine, candidates looked up per request
    caller      the access and ownership rules of every call
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

from service.core import logs, memory
from service.core.admission import ByteBudget, RefusalPacer
from service.core.auth import Authenticator
from service.core.bots import Bots
from service.core.caller import Caller, Core
from service.core.candidates import CandidateStats
from service.core.connections import Connections
from service.core.engine import Engine
from service.core.inference import Inference
from service.core.lifecycle import Lifecycle, Readiness
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.core.sockets import SocketShares
from service.core.tenancy import Tenancy
from service.core.threads import Threads
from service.core.tracing import Tracing
from store import HeadStore

log = logging.getLogger(__name__)


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
        # `multihead serve` sets it (`run_app`): one service a process, alive until it exits.
        # Not in a process that makes many (the tests): what is frozen is never collected.
        self.freeze_gc_when_ready = False
        self.metrics = metrics or Metrics(top_bots=settings.metrics_top_bots,
                                          top_tenants=settings.metrics_top_tenants)
        pinned = settings.pinned_bots
        if store is not None and set(store.pinned) != set(pinned):
            # NOTE: what /bots and /metrics call pinned must be what the cache never evicts.
            raise ValueError(f"the given store pins {sorted(store.pinned)}, the settings "
                             f"{sorted(pinned)}: open it with pinned=settings.pinned_bots")
        own_store = store is None
        self.store = store if store is not None else HeadStore(
            settings.store, heads_memory_mb=settings.heads_memory_mb, pinned=pinned)
        # NOTE: the first snapshot is read here, before any request: from now on the request
        # path (keys, owners, limits, active versions) reads only the snapshot, which a
        # background thread keeps current (store.snapshot).
        self.store.watch()
        # This process serves the store: its lease counts it among the store's serving
        # processes, the quota divisor outside Ray (store.leases, service.core.quota).
        self.store.processes.join()
        self.auth = Authenticator(settings.auth, settings.admin_token,
                                  keys=self.store.key_table, mark_used=self.store.mark_used)
        # The open WebSockets by the key that opened them: closed when it is revoked.
        self.connections = Connections(self.store.key_table)
        self.metrics.set_pinned_bots(pinned)
        self.metrics.bind_pinned_heads(
            lambda: self.store.cache_stats().get("pinned_resident", 0))
        # Admission: every transport of this process reserves request bytes here first. The
        # memory of a burst of large bodies goes back to the OS when it is over; so does what
        # the trunk's build freed, once ready (service.core.memory).
        self.trimmer = memory.Trimmer()
        self.inflight = ByteBudget(settings.max_inflight_bytes, on_burst_end=self.trimmer,
                                   weight=lambda tenant: self.tenancy.weight(tenant))
        self.metrics.bind_inflight_bytes(lambda: self.inflight.used_bytes)
        self.metrics.bind_store(self.store.snapshot_age_s, self.store.processes.count)
        threads = Threads()
        # The comparison of each bot's candidate with its live version, in this process.
        candidate_stats = CandidateStats()
        self.tenancy = Tenancy(settings, self.store, threads)
        self.sockets = SocketShares(settings.max_websockets, self.tenancy.weight)
        self.pacer = RefusalPacer()  # a tenant's rate refusals answered late
        self.bots = Bots(self.store, pinned, threads, candidate_stats)

        def engine_for(trunk, batch_size: int | None = None,
                       batch_seconds: Callable[[int], float] | None = None) -> Engine:
            return Engine(trunk, settings, self.metrics, quotas=self.tenancy.quotas,
                          weight=self.tenancy.weight, max_queued=self.tenancy.max_queued,
                          tracing=self.tracing, candidate_stats=candidate_stats,
                          batch_size=batch_size, batch_seconds=batch_seconds)

        # Each bot's agreement with the INT8 trunk: judged at the bring-up, shown per bot.
        self.lifecycle = Lifecycle(settings, self.store, self.metrics, threads,
                                   engine_for=engine_for, on_ready=self._ready, trunk=trunk,
                                   own_store=own_store, tracing=self.tracing,
                                   int8=self.bots.int8)
        self.inference = Inference(settings, self.store, self.lifecycle, self.metrics, threads,
                                   candidate_stats)
        self._core = Core(settings, self.auth, self.store, threads, self.lifecycle, self.bots,
                          self.tenancy, self.inference)

    # -- what the transports read ------------------------------------------------------------------

    @property
    def readiness(self) -> Readiness:
        return self.lifecycle.readiness

    @property
    def engine(self) -> Engine | None:
        """The engine, once the bring-up started it."""
        return self.lifecycle.engine

    @property
    def trunk(self):
        """The trunk, once the bring-up built it (or the one given)."""
        return self.lifecycle.trunk

    @property
    def batch_profile(self):
        """The trunk's time per batch alone by batch size (a `backbone.profile.BatchProfile`:
        `seconds_at(n)`, `seconds`, `source`), once the bring-up warmed the trunk; None before,
        with --no-warmup and no saved profile, or for a trunk given."""
        return self.lifecycle.batch_profile

    @property
    def identity(self) -> dict[str, Any]:
        """Who answers, for transports with several processes (the Ray replica sets it):
        in the full readiness report."""
        return self.lifecycle.identity

    @identity.setter
    def identity(self, value: dict[str, Any]) -> None:
        self.lifecycle.identity = value

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the bring-up in the background and returns at once."""
        if self.auth.keys_enabled:
            log.info("auth: API keys (a key sees only its tenant's bots); operator token %s",
                     "set" if self.settings.admin_token else "unset (tenant and key routes "
                     "disabled)")
        else:
            log.warning("auth none: no API keys; every client that reaches the port may list "
                        "and call every bot")
        self.lifecycle.start()

    async def wait_ready(self) -> bool:
        """Waits for the bring-up to end; True if the service is ready."""
        return await self.lifecycle.wait_ready()

    async def close(self) -> None:
        """Waits for a running bring-up, drains the engine, closes the store and the trunk."""
        await self.lifecycle.close()

    def _ready(self) -> None:
        if self.freeze_gc_when_ready:
            # What is alive once ready (the runtimes' modules, the trunk's graph: millions of
            # objects with TensorFlow) leaves the collector's sight, so that a full collection
            # scans what requests made, not that: one took 120 ms on 2 cores, a stall that
            # every tenant's p99 saw. What is collectable now is collected first.
            gc.collect()
            gc.freeze()
        self.trimmer()  # the build's and restore's garbage (TF graph, checkpoint reads)

    def readiness_report(self) -> dict[str, Any]:
        """The one description of readiness: status, trunk, timings (and error if failed)."""
        return self.lifecycle.readiness_report()

    def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus text (and its content type), the heads cache gauges read now."""
        return self.lifecycle.render_metrics()

    # -- one call ----------------------------------------------------------------------------------

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
        return Caller(self._core, principal, route_key=route_key)
