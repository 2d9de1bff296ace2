"""Prometheus metrics of one app, in the app's own `CollectorRegistry`.

Each `Metrics` owns its registry (never the global one), so several apps can live in one process
(tests build many). Per-bot and per-tenant series are bounded: only the busiest `top_bots` bots
get their own `bot` label and the busiest `top_tenants` tenants their own `tenant` label, every
other one counts under "other", so thousands of bots or tenants cannot explode label cardinality.

    metrics = Metrics(top_bots=settings.metrics_top_bots)
    batcher = Batcher(..., on_batch=metrics.observe_batch)
    metrics.bind_queue_depth(lambda: batcher.queue_depth)
    metrics.bind_tenant_state(read)  # read() -> {tenant: (queued rows, virtual counter)}
    body, content_type = metrics.render()
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from service.core.topn import OTHER, TopN

NAMESPACE = "multihead"
# Why a tenant's request was refused (`Metrics.observe_refusal`), a closed set (a series each per
# labelled tenant): its quota, its share of the queue, the queue full, or its share of the
# process's bytes in flight, WebSockets or gRPC calls.
REFUSAL_CODES = ("rate_limited", "queue_share", "overloaded", "inflight_share", "socket_share",
                 "call_share", "deadline_unmeetable", "deadline_exceeded")

# Seconds: from a cached-feature request (~1 ms) to a full CPU batch of 16 (several seconds).
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


# Its name from before tenants shared it (tests/service/core/test_metrics.py still uses it).
TopBots = TopN


class Metrics:
    """All metrics of one app.

    Per-tenant series share one labelled set: the `top_tenants` busiest tenants by traffic
    (trunk images plus refusals, `TopN`) have their own `tenant` label, the others count under
    `tenant="other"`; a tenant really named "other" is always among those. A tenant that loses
    its label (another one overtook it) loses its counter series too, like a bot in
    `bot_requests_total`: from then on its traffic counts under "other", and the labels' sum is
    what was counted since each series appeared (`batch_size`'s sum keeps the exact total).

    Args:
        top_bots: bots with their own `bot` label in `bot_requests_total`; the rest are "other".
        top_tenants: tenants with their own `tenant` label in the tenant_* metrics; the rest are
            "other".
        registry: where to register (default: a new `CollectorRegistry` of this object's own).

    Attributes (prometheus_client objects, usable directly):
        requests_total{route,status}, request_seconds{route} (route: the endpoint's name),
        decode_seconds, decode_wait_seconds_total,
        queue_wait_seconds, trunk_seconds, trunk_batch_seconds_total{batch_size},
        trunk_batches_total{batch_size} (both from `observe_trunk`),
        trunk_alone_seconds{batch_size} (set from `bind_trunk_profile` at each `render`),
        batch_size_working, batch_size_shared (the batcher's batch sizes alone and shared:
        `set_batch_size`), heads_seconds,
        batch_size, batch_bots, queue_depth,
        resident_heads, resident_head_bytes, pinned_heads, pinned_bot{bot}, preloaded_heads,
        bot_int8_agreement{bot} (set from `bind_int8_agreement` at each `render`),
        feature_cache_hits_total,
        feature_cache_misses_total, bot_requests_total{bot},
        tenant_images_total{tenant}, tenant_rows_late_total{tenant} (`observe_rows_late`),
        tenant_rows_run_expired_total{tenant} (`observe_rows_run_expired`),
        tenant_refusals_total{tenant,code} (code: one of
        `REFUSAL_CODES`), tenant_queued_rows{tenant}, tenant_counter{tenant} (the last two set
        from `bind_tenant_state` at each `render`), candidate_images_total{bot,version},
        candidate_agreed_total, candidate_top1_abs_diff_total, candidate_answers_total,
        candidate_failures_total (the same labels: `observe_candidate`).

    Candidate series follow the bots' labels: a labelled bot's candidate has its own series
    (`bot`, and its `version`), the others count under bot="other", version="other"; a bot
    keeps the series of its latest candidate version only, and loses them with its label.
    """

    def __init__(
        self,
        top_bots: int = 20,
        top_tenants: int = 20,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        ns = NAMESPACE
        self.requests_total = Counter(
            "requests", "requests by endpoint name (unmatched: no endpoint) and status code",
            ["route", "status"], namespace=ns, registry=r,
        )
        self.request_seconds = Histogram(
            "request_seconds", "end-to-end request latency by endpoint name",
            ["route"], namespace=ns, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.decode_seconds = Histogram(
            "decode_seconds", "image decode and preprocessing time per image",
            namespace=ns, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.decode_wait_seconds = Counter(
            "decode_wait_seconds", "seconds image decodes waited for a trunk batch to finish "
            "(a CPU trunk runs alone on the cores: --own-cores)", namespace=ns, registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "queue_wait_seconds", "time a row waited in the batcher queue before its batch ran",
            namespace=ns, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.trunk_seconds = Histogram(
            "trunk_seconds", "trunk (Inception-V4) run time per batch",
            namespace=ns, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.trunk_batch_seconds_total = Counter(
            "trunk_batch_seconds", "seconds the trunk ran inside the server, by batch size "
            "(with trunk_batches: its time per batch under load, next to trunk_alone_seconds)",
            ["batch_size"], namespace=ns, registry=r,
        )
        self.trunk_batches_total = Counter(
            "trunk_batches", "trunk batches run, by batch size", ["batch_size"],
            namespace=ns, registry=r,
        )
        self.trunk_alone_seconds = Gauge(
            "trunk_alone_seconds", "the trunk's time per batch alone, by batch size: its "
            "warm-up profile, measured with nothing else running (set from "
            "`bind_trunk_profile` at each scrape)", ["batch_size"], namespace=ns, registry=r,
        )
        self._trunk_profile: Callable[[], Mapping[int, float] | None] | None = None
        self.batch_size_working = Gauge(
            "batch_size_working", "most images the batcher puts in one trunk batch below "
            "saturation: the smallest size of the trunk's profile within 5 % of its best "
            "images/s, at most --max-batch-size", namespace=ns, registry=r,
        )
        self.batch_size_shared = Gauge(
            "batch_size_shared", "a tenant's share of a trunk batch while the trunk is shared "
            "with a light tenant: a batch takes this many images per tenant waiting "
            "(--shared-batch-ms)",
            namespace=ns, registry=r,
        )
        self._trunk_by_size: dict[int, list[float]] = {}  # size -> [batches, seconds]
        self.heads_seconds = Histogram(
            "heads_seconds", "time applying the heads (all bots) per batch",
            namespace=ns, buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.batch_size = Histogram(
            "batch_size", "rows per trunk batch", namespace=ns, buckets=BATCH_BUCKETS, registry=r,
        )
        self.batch_bots = Histogram(
            "batch_bots", "distinct bots per trunk batch (cross-bot batching at work)",
            namespace=ns, buckets=BATCH_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge(
            "queue_depth", "rows waiting in the batcher queue", namespace=ns, registry=r,
        )
        self.trunk_info = Gauge(
            "trunk_info", "the trunk in use (value 1): device, runtime and precision; an int8 "
            "trunk's calibration set (digest prefix, image count) and date (empty otherwise)",
            ["device", "runtime", "precision", "calibration", "calibration_images",
             "calibration_date"], namespace=ns, registry=r,
        )
        self.inflight_bytes = Gauge(
            "inflight_bytes", "request bytes admitted and not yet answered (the admission "
            "budget in use)", namespace=ns, registry=r,
        )
        self.resident_heads = Gauge(
            "resident_heads", "heads loaded in memory", namespace=ns, registry=r,
        )
        self.resident_head_bytes = Gauge(
            "resident_head_bytes", "bytes of the heads loaded in memory", namespace=ns, registry=r,
        )
        self.pinned_heads = Gauge(
            "pinned_heads", "heads of pinned bots (--pin) resident in memory; never evicted",
            namespace=ns, registry=r,
        )
        self.pinned_bot = Gauge(
            "pinned_bot", "the pinned bots (--pin), value 1 each", ["bot"],
            namespace=ns, registry=r,
        )
        self.store_snapshot_age = Gauge(
            "store_snapshot_age_seconds", "seconds since the snapshot of the store this process "
            "serves from (bots, owners, keys, limits, candidates) was last confirmed current; "
            "grows while the store cannot be read", namespace=ns, registry=r)
        self.store_serving_processes = Gauge(
            "store_serving_processes", "processes serving this store, by their live leases (one "
            "quota share each outside Ray)", namespace=ns, registry=r)
        self.preloaded_heads = Gauge(
            "preloaded_heads", "heads loaded before ready by --preload (most recently "
            "registered bots); evictable", namespace=ns, registry=r,
        )
        self.feature_cache_hits_total = Counter(
            "feature_cache_hits", "images whose trunk features came from the cache",
            namespace=ns, registry=r,
        )
        self.feature_cache_misses_total = Counter(
            "feature_cache_misses", "images that needed a trunk run",
            namespace=ns, registry=r,
        )
        self.bot_requests_total = Counter(
            "bot_requests", f"classification requests per bot (busiest {top_bots}; rest '{OTHER}')",
            ["bot"], namespace=ns, registry=r,
        )
        tenants = f"busiest {top_tenants} tenants by images and refusals; rest '{OTHER}'"
        self.tenant_images_total = Counter(
            "tenant_images", f"trunk images served per tenant: rows that ran in a trunk batch "
            f"({tenants})", ["tenant"], namespace=ns, registry=r,
        )
        self.tenant_rows_late_total = Counter(
            "tenant_rows_late", f"trunk images per tenant whose batch ended after the row's "
            f"deadline: the trunk's work for an answer too late ({tenants})", ["tenant"],
            namespace=ns, registry=r,
        )
        self.tenant_rows_run_expired_total = Counter(
            "tenant_rows_run_expired", f"trunk images per tenant for rows whose deadline had "
            f"passed when the trunk started (the engine drops such rows first: 504 "
            f"deadline_exceeded; any counted here is trunk work for an answer already too "
            f"late) ({tenants})", ["tenant"], namespace=ns, registry=r,
        )
        self.tenant_refusals_total = Counter(
            "tenant_refusals", f"requests refused per tenant by error code: "
            f"{', '.join(REFUSAL_CODES)} ({tenants})", ["tenant", "code"], namespace=ns, registry=r)
        self.tenant_queued_rows = Gauge(
            "tenant_queued_rows", f"rows waiting in the batcher queue per tenant ({tenants}: "
            "their sum)", ["tenant"], namespace=ns, registry=r,
        )
        self.tenant_counter = Gauge(
            "tenant_counter", f"the fair scheduler's virtual counter per tenant: weighted trunk "
            f"images served ({tenants}: the largest among them)", ["tenant"],
            namespace=ns, registry=r,
        )
        bots = f"busiest {top_bots} bots; rest '{OTHER}'"
        self.candidate_images_total = Counter(
            "candidate_images", f"images scored by a bot's candidate (shadow or canary) and by "
            f"its live version ({bots})", ["bot", "version"], namespace=ns, registry=r,
        )
        self.candidate_agreed_total = Counter(
            "candidate_agreed", "of candidate_images, those whose top-1 label is the live "
            "version's (agreement: the ratio of their rates)", ["bot", "version"],
            namespace=ns, registry=r,
        )
        self.candidate_top1_abs_diff_total = Counter(
            "candidate_top1_abs_diff", "sum over candidate_images of |p_live - p_candidate| "
            "of the live version's top-1 label (mean: divide by candidate_images)",
            ["bot", "version"], namespace=ns, registry=r,
        )
        self.candidate_answers_total = Counter(
            "candidate_answers", "images answered by a canary candidate instead of the live "
            "version", ["bot", "version"], namespace=ns, registry=r,
        )
        self.candidate_failures_total = Counter(
            "candidate_failures", "images a candidate failed to score (its head raised or "
            "could not be loaded); the live version answered them", ["bot", "version"],
            namespace=ns, registry=r,
        )
        self.bot_int8_agreement = Gauge(
            "bot_int8_agreement", "share of the INT8 trunk's held-out images on which a bot's "
            "active version answers as on the float trunk (top-1), per bot: the busiest "
            f"{top_bots} bots, then those of lowest agreement up to {top_bots}; '{OTHER}': the "
            "lowest of the rest. No series without an INT8 trunk for the serving checkpoint",
            ["bot"], namespace=ns, registry=r,
        )
        self._int8_agreement: Callable[[], Mapping[str, float]] | None = None
        self._candidate_counters = (
            self.candidate_images_total, self.candidate_agreed_total,
            self.candidate_top1_abs_diff_total, self.candidate_answers_total,
            self.candidate_failures_total)
        self._candidate_series: dict[str, str] = {}  # labelled bot -> its version label
        self._top = TopN(top_bots, name="top_bots")
        self._top_tenants = TopN(top_tenants, name="top_tenants")
        self._tenant_state: Callable[[], Mapping[str, tuple[int, float]]] | None = None
        self._lock = threading.Lock()
        # NOTE: held around a whole render so that two scrapes never interleave the clearing and
        # refilling of the tenant gauges; never taken by the observe_* methods, and the bound
        # tenant-state callback runs outside `_lock` (it may take the scheduler's own lock, and
        # the scheduler calls observe_* holding it).
        self._render_lock = threading.Lock()

    # -- recording ------------------------------------------------------------------------------

    def observe_request(self, route: str, status: int, seconds: float | None = None) -> None:
        """One answered request, whatever its transport (HTTP, gRPC, Ray).

        Args:
            route: the name of the endpoint that answered (`Endpoint.name`: `classify`,
                `oip_infer`, ...; an RPC mapped to an endpoint uses that endpoint's name), or
                `unmatched` when no endpoint matched. Never a raw path or anything a client
                chooses, or every bot id would become a label.
            status: the HTTP status of the answer (for gRPC: the one its outcome has on HTTP).
            seconds: its latency; None counts it without timing it (a WebSocket).
        """
        self.requests_total.labels(route=route, status=str(int(status))).inc()
        if seconds is not None:
            self.request_seconds.labels(route=route).observe(seconds)

    def observe_bot(self, bot_id: str, n: int = 1) -> str:
        """Count `n` requests for `bot_id`; returns the label used (`bot_id` or "other")."""
        with self._lock:
            label, demoted = self._top.observe(bot_id, n)
            if demoted is not None:
                # Its series goes away (bounded cardinality); its later requests count under
                # "other". requests_total keeps the exact total.
                try:
                    self.bot_requests_total.remove(demoted)
                except KeyError:
                    pass
                self._drop_candidate_series(demoted)
            self.bot_requests_total.labels(bot=label).inc(n)
        return label

    def observe_candidate(self, bot_id: str, version: int, *, images: int = 0,
                          agreed: int = 0, abs_diff: float = 0.0, answered: int = 0,
                          failed: int = 0) -> tuple[str, str]:
        """Count one scoring of `bot_id`'s candidate `version` (see the candidate_* metrics);
        returns the (bot, version) labels used. Does not count the bot's traffic
        (`observe_bot` does)."""
        with self._lock:
            if bot_id in self._top.labelled and bot_id != OTHER:
                labels = (bot_id, str(int(version)))
                if self._candidate_series.get(bot_id) not in (None, labels[1]):
                    self._drop_candidate_series(bot_id)  # a new candidate: one series a bot
                self._candidate_series[bot_id] = labels[1]
            else:
                labels = (OTHER, OTHER)
            for counter, value in zip(self._candidate_counters,
                                      (images, agreed, abs_diff, answered, failed)):
                child = counter.labels(*labels)
                if value:
                    child.inc(value)
        return labels

    def _drop_candidate_series(self, bot_id: str) -> None:
        """The candidate series of `bot_id` go (the caller holds the lock)."""
        version = self._candidate_series.pop(bot_id, None)
        if version is None:
            return
        for counter in self._candidate_counters:
            try:
                counter.remove(bot_id, version)
            except KeyError:
                pass

    def observe_batch(
        self, size: int, groups: int, queue_wait_s: Sequence[float], run_s: float
    ) -> None:
        """The batcher's `on_batch` hook (same signature)."""
        self.batch_size.observe(size)
        self.batch_bots.observe(groups)
        for wait in queue_wait_s:
            self.queue_wait_seconds.observe(wait)

    def observe_tenant_images(self, counts: Mapping[str, int]) -> None:
        """Count the trunk images of one batch per tenant (`{tenant: rows}`), once per batch.

        Raises:
            ValueError: a negative row count (nothing of the batch is counted then).
        """
        for tenant, rows in counts.items():
            if rows < 0:
                raise ValueError(f"rows must be >= 0, got {rows} for tenant {tenant!r}")
        batch = [(tenant, rows) for tenant, rows in counts.items() if rows]
        with self._lock:
            for (_, rows), label in zip(batch, self._observe_tenants(batch)):
                self.tenant_images_total.labels(tenant=label).inc(rows)

    def observe_rows_late(self, counts: Mapping[str, int]) -> None:
        """Count the rows of one batch that ended after their deadline, per tenant (the
        batcher's `Schedule.on_late`)."""
        self._count_rows(self.tenant_rows_late_total, counts)

    def observe_rows_run_expired(self, counts: Mapping[str, int]) -> None:
        """Count the rows the trunk ran whose deadline had passed when it started, per
        tenant (the engine, as its trunk starts)."""
        self._count_rows(self.tenant_rows_run_expired_total, counts)

    def _count_rows(self, counter: Counter, counts: Mapping[str, int]) -> None:
        batch = [(tenant, rows) for tenant, rows in counts.items() if rows > 0]
        with self._lock:
            for (_, rows), label in zip(batch, self._observe_tenants(batch)):
                counter.labels(tenant=label).inc(rows)

    def observe_refusal(self, tenant: str, code: str) -> str:
        """Count one request of `tenant` refused with `code` (one of `REFUSAL_CODES`); returns
        the tenant label used (`tenant` or "other").

        Raises:
            ValueError: `code` is not in `REFUSAL_CODES`.
        """
        if code not in REFUSAL_CODES:
            raise ValueError(
                f"unknown refusal code {code!r}; expected one of {', '.join(REFUSAL_CODES)}")
        with self._lock:
            [label] = self._observe_tenants([(tenant, 1)])
            self.tenant_refusals_total.labels(tenant=label, code=code).inc()
        return label

    def _observe_tenants(self, traffic: Sequence[tuple[str, int]]) -> list[str]:
        """Count each `(tenant, n)` of traffic in the labelled set and return their labels, as
        the labelled set stands after all of them; the caller holds the lock.

        A tenant that lost its label here loses its counter series (bounded cardinality), like
        a demoted bot; the gauges follow at the next render. Resolving labels only once the
        whole batch is counted means a tenant labelled by one row of a batch and overtaken by
        a later one never gets a series that vanishes before any scrape could see it.
        """
        top = self._top_tenants
        labels, demoted = [], set()
        for tenant, n in traffic:
            label, lost = top.observe(tenant, n)
            labels.append(label)
            if lost is not None:
                demoted.add(lost)
        for tenant in demoted - top.labelled:
            self.tenant_images_total.remove(tenant)
            self.tenant_rows_late_total.remove(tenant)
            self.tenant_rows_run_expired_total.remove(tenant)
            for code in REFUSAL_CODES:
                self.tenant_refusals_total.remove(tenant, code)
        return [label if label in top.labelled else OTHER for label in labels]

    def observe_cache(self, hit: bool, n: int = 1) -> None:
        (self.feature_cache_hits_total if hit else self.feature_cache_misses_total).inc(n)

    def set_resident_heads(self, count: int, total_bytes: int) -> None:
        self.resident_heads.set(count)
        self.resident_head_bytes.set(total_bytes)

    def set_pinned_bots(self, bot_ids: Sequence[str]) -> None:
        """The pinned bots, as `multihead_pinned_bot{bot="a"} 1` (as many series as pins: the
        operator's list, so the label set stays small)."""
        for bot_id in bot_ids:
            self.pinned_bot.labels(bot=bot_id).set(1)

    def observe_trunk(self, size: int, seconds: float) -> None:
        """One trunk batch of `size` images that ran `seconds` inside the server."""
        self.trunk_seconds.observe(seconds)
        self.trunk_batch_seconds_total.labels(batch_size=str(size)).inc(seconds)
        self.trunk_batches_total.labels(batch_size=str(size)).inc()
        with self._lock:
            entry = self._trunk_by_size.setdefault(size, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds

    def trunk_in_server(self) -> dict[int, tuple[int, float]]:
        """{batch size: (batches run, mean seconds per batch)} inside the server so far."""
        with self._lock:
            return {size: (int(n), total / n) for size, (n, total)
                    in sorted(self._trunk_by_size.items())}

    def bind_trunk_profile(self, read: Callable[[], Mapping[int, float] | None]) -> None:
        """Read the trunk's warm-up profile `{batch size: seconds per batch alone}` (None:
        not measured) at each `render`, into `trunk_alone_seconds`."""
        self._trunk_profile = read

    def bind_pinned_heads(self, read: Callable[[], float]) -> None:
        """Read the number of resident pinned heads at scrape time."""
        self.pinned_heads.set_function(read)

    def set_batch_size(self, size: int, shared: int | None = None) -> None:
        self.batch_size_working.set(size)
        self.batch_size_shared.set(size if shared is None else shared)

    def set_preloaded_heads(self, count: int) -> None:
        self.preloaded_heads.set(count)

    def set_trunk(self, *, device: str, runtime: str, precision: str,
                  calibration=None) -> None:
        """What the trunk runs on, as `multihead_trunk_info{device,runtime,precision,...} 1`;
        `calibration` (a `backbone.runners.Calibration`, int8 only) fills the calibration
        labels: the first 16 hex digits of its digest, its image count and its date."""
        self.trunk_info.labels(
            device=device, runtime=runtime, precision=precision,
            calibration=calibration.digest[:16] if calibration else "",
            calibration_images=str(calibration.images) if calibration else "",
            calibration_date=calibration.date if calibration else "").set(1)

    def bind_inflight_bytes(self, read: Callable[[], float]) -> None:
        """Read the admission budget in use at scrape time."""
        self.inflight_bytes.set_function(read)

    def bind_store(self, age: Callable[[], float], processes: Callable[[], float]) -> None:
        """Read the age of the store's snapshot (`HeadStore.snapshot_age_s`) and its serving
        processes (`HeadStore.processes.count`) at scrape time."""
        self.store_snapshot_age.set_function(age)
        self.store_serving_processes.set_function(processes)

    def bind_queue_depth(self, read: Callable[[], float]) -> None:
        """Read the queue depth at scrape time (e.g. `lambda: batcher.queue_depth`)."""
        self.queue_depth.set_function(read)

    def bind_tenant_state(self, read: Callable[[], Mapping[str, tuple[int, float]]]) -> None:
        """Read `{tenant: (queued rows, virtual counter)}` from the fair scheduler at each
        `render`, into `tenant_queued_rows` and `tenant_counter`.

        Labelled tenants get their own series; the others are folded into `tenant="other"`
        (queued rows summed, the largest counter), present only when there are such tenants. A
        tenant missing from what `read` returns has no gauge series at all (no stale labels).
        """
        self._tenant_state = read

    def bind_int8_agreement(self, read: Callable[[], Mapping[str, float]]) -> None:
        """Read `{bot: its agreement with the INT8 trunk}` at each `render`, into
        `bot_int8_agreement`: a series per bot with a label of its own (`bot_requests_total`'s
        busiest bots), then per bot of lowest agreement while fewer than `top_bots` have one,
        and `bot="other"` for the lowest of the rest; no series for a bot `read` leaves out."""
        self._int8_agreement = read

    @property
    def labelled_bots(self) -> frozenset[str]:
        """Bots that have their own label right now."""
        with self._lock:
            return frozenset(self._top.labelled)

    @property
    def labelled_tenants(self) -> frozenset[str]:
        """Tenants that have their own label right now."""
        with self._lock:
            return frozenset(self._top_tenants.labelled)

    # -- exposition -----------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type, for `GET /metrics`."""
        with self._render_lock:
            if self._tenant_state is not None:
                self._set_tenant_gauges(self._tenant_state())
            if self._int8_agreement is not None:
                self._set_int8_agreement(self._int8_agreement())
            if self._trunk_profile is not None:
                self.trunk_alone_seconds.clear()
                for size, seconds in sorted((self._trunk_profile() or {}).items()):
                    self.trunk_alone_seconds.labels(batch_size=str(size)).set(seconds)
            return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _set_tenant_gauges(self, state: Mapping[str, tuple[int, float]]) -> None:
        """The tenant gauges from scratch: labelled tenants of `state`, then "other"."""
        labelled = self.labelled_tenants
        rows: dict[str, float] = {}
        counters: dict[str, float] = {}
        for tenant, (queued_rows, counter) in state.items():
            label = tenant if tenant in labelled else OTHER
            if label in rows:  # only ever "other": labelled tenants are distinct keys
                rows[label] += queued_rows
                counters[label] = max(counters[label], counter)
            else:
                rows[label], counters[label] = queued_rows, counter
        self.tenant_queued_rows.clear()
        self.tenant_counter.clear()
        for label in rows:
            self.tenant_queued_rows.labels(tenant=label).set(rows[label])
            self.tenant_counter.labels(tenant=label).set(counters[label])

    def _set_int8_agreement(self, values: Mapping[str, float]) -> None:
        """The agreement gauge from scratch (see `bind_int8_agreement`)."""
        busiest = self.labelled_bots
        own = sorted(bot for bot in values if bot in busiest and bot != OTHER)
        rest = sorted((bot for bot in values if bot not in busiest or bot == OTHER),
                      key=lambda bot: (values[bot], bot))
        room = max(0, self._top.n - len(own))
        # A bot named "other" never gets a label of its own (it would merge with the rest's).
        lowest = [bot for bot in rest if bot != OTHER][:room]
        own += lowest
        taken = set(lowest)
        rest = [bot for bot in rest if bot not in taken]
        self.bot_int8_agreement.clear()
        for bot in own:
            self.bot_int8_agreement.labels(bot=bot).set(values[bot])
        if rest:
            self.bot_int8_agreement.labels(bot=OTHER).set(min(values[bot] for bot in rest))
