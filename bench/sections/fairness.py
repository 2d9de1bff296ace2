"""Section `fairness`: tenants sharing one server (`service.core.fair`, `service.core.quota`).

Five tenants each own one bot of a store of their own: `noisy`, `quiet-1..3` and `limited`.
Every server runs `serve`'s defaults (runtime and precision auto; /readyz says which) with the
feature cache off (every image goes through the trunk) and a request deadline of 300 s (so that
no request of either scheduler is dropped: a dropped one would hide its latency).

- flood, twice: `--scheduler fair`, then `--scheduler fifo` (two servers one after the other,
  the same store and images). The noisy tenant runs `plan.fairness_noisy_clients` closed-loop
  clients, each quiet tenant one, every request one image (the run's JPEGs in turn). After
  `plan.fairness_warmup_s` (and a first burst of one full batch), the window of
  `plan.fairness_s` seconds: latencies of the requests SENT inside it (the clients keep the
  load on until each of them is answered), images/s ANSWERED inside it from the first trunk
  batch's answers to the last one's (`batch_rates`); the server's own batch sizes, trunk time
  per batch and per-tenant served images over it.
- quota: a third server (fair), the limited tenant at a rate R of trunk images per second
  (min(8, the fair flood's images/s / 4)) and a burst of 16, ONE closed-loop client that
  honours Retry-After (on a 429 it sleeps exactly that many seconds, then sends the same
  request again), beside the three quiet tenants at one client each. The client opens with one
  request of 16 images (the burst: its first 429 comes at once instead of after the bucket
  drains at the client's pace minus R), then sends 4 images per request. The window starts at
  its first 429 (the initial burst is not counted) and lasts `plan.quota_s` seconds, and the
  run until the client's first 429 after it.
- the raw trunk's time for one full batch (`plan.fairness_batch_size`, 8: the servers' batch
  size here, see `bench.plan`) on the runtime x precision the
  servers ran: from the trunk section's table (or the service section's raw trunk) when this
  run measured it, else measured here, in this process, once the servers are stopped.

The section's load (the clients) is `bench.sections.fairness_load`'s; the numbers taken from it
(per tenant, the flood's and the quota's summaries, the raw trunk's batch) are
`bench.sections.fairness_numbers`'; the runs on their servers, the report and the targets are
here.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.context import Context, say
from bench.markdown import fmt, table
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.sections.fairness_load import (
    LIMITED,
    NOISY,
    QUIET,
    TENANTS,
    flood,
    quota_load,
    warm_up_batch,
)
from bench.sections.fairness_numbers import call_stats, flood_summary, quota_summary, raw_batch
from bench.stats import num, ratio

SCHEDULERS = ("fair", "fifo")

# Every server of the section: no feature cache (every request's images reach the trunk) and a
# deadline no request reaches (a 504 would drop a slow request's latency from the numbers).
SERVER_OPTIONS = {"feature-cache-size": 0, "request-timeout-s": 300}  # + the batch size

# The quota scenario: R = min(QUOTA_MAX_RATE, capacity / QUOTA_CAPACITY_SHARE) images/s, well
# below the pace of the limited client alone (4 images in a batch beside 3 quiet ones: about
# 0.4 of the capacity on 2 cores), so that the bucket, not the server, holds it back.
QUOTA_MAX_RATE = 8.0
QUOTA_CAPACITY_SHARE = 4.0
QUOTA_BURST = 16
QUOTA_IMAGES = 4  # images per request of the limited client

# Targets.
QUIET_P50_VS_FIFO = 0.5  # quiet tenants' p50, fair / fifo
QUIET_P50_VS_BATCH = 2.5  # quiet tenants' p50 with fair / the raw trunk's full batch
THROUGHPUT_VS_FIFO = 0.95  # total images/s, fair / fifo
RATE_TOLERANCE = 0.10  # |accepted rate / R - 1|


@dataclass
class FairnessResult(Result):
    image: str = ""
    noisy_clients: int | None = None
    quiet_clients: int | None = None  # per quiet tenant
    warmup_s: float | None = None
    duration_s: float | None = None
    # scheduler -> {"server": {runtime, ready_s, pid}, "window_s", "tenants": {tenant: stats},
    # "quiet": the quiet tenants' requests pooled, "measured_s" (the images/s' span, see
    # `batch_rates`), "total_images_per_s", "batches", "mean_batch_size", "server_trunk_ms",
    # "server_heads_ms", "served": {tenant: trunk images by the server's
    # multihead_tenant_images_total}, "refused": {"code tenant": n}}
    runs: dict[str, dict] = field(default_factory=dict)
    # The raw trunk of the servers' runtime x precision at their batch size: {name, batch_size,
    # batch_s, images_per_s, source}.
    raw_trunk: dict | None = None
    # The quota scenario (`quota_summary`), plus "server" and "quiet" (pooled stats).
    quota: dict = field(default_factory=dict)

    def quiet_p50_ms(self, scheduler: str) -> float | None:
        return ((self.runs.get(scheduler) or {}).get("quiet") or {}).get("p50_ms")

    def total_images_per_s(self, scheduler: str) -> float | None:
        return (self.runs.get(scheduler) or {}).get("total_images_per_s")


# -- the raw trunk ------------------------------------------------------------------------------


def _measure_in_process(context: Context):
    def measure(name: str, batch_size: int) -> dict:
        """`name` at `batch_size`, in this process, from the graph the servers saved next to
        the checkpoint (as `serve` does: no second build)."""
        from backbone import Trunk
        from backbone.checkpoint import cache_dir_of
        from bench.sections.trunk import preprocessed, time_batches

        runtime, precision = name.split("-", 1)
        say(f"raw trunk on {name} at batch {batch_size} for the fairness comparison ...")
        cache = cache_dir_of(context.prefix)
        trunk = Trunk.from_checkpoint(context.prefix, warmup_batch_sizes=(), runtime=runtime,
                                      precision=precision, graph_cache_dir=cache,
                                      int8_dir=cache)
        try:
            return time_batches(trunk, preprocessed(context, batch_size), (batch_size,),
                                context.plan.trunk_runs)[0]
        finally:
            trunk.close()

    return measure


# -- the section -------------------------------------------------------------------------------


def tenant_store(context: Context) -> tuple[Path, dict[str, str]]:
    """A new store with the five tenants, each owning one random bot `<tenant>-bot`; returns
    (store, {tenant: bot})."""
    from bench.bots import register_tenant_bots

    store = context.tmp / "fairness-store"
    bots = register_tenant_bots(store, TENANTS, context.plan.classes, context.plan.seed + 22)
    context.share_graph_cache(store)
    return store, bots


def quota_rate(result: FairnessResult) -> tuple[float, float | None]:
    """(R, the capacity it was taken from): min(8, images/s / 4) of the fair flood (else the
    fifo one's); 0.5 image/s when neither was measured."""
    capacity = next((c for c in (result.total_images_per_s(s) for s in SCHEDULERS)
                     if c and not math.isnan(c)), None)
    if capacity is None:
        return 0.5, None
    return round(min(QUOTA_MAX_RATE, capacity / QUOTA_CAPACITY_SHARE), 2), capacity


def _facts(server) -> dict:
    return {"ready_s": server.ready_s, "pid": server.pid, "runtime": server.runtime()}


def _run_flood(context: Context, store: Path, bots: dict[str, str], scheduler: str,
               result: FairnessResult) -> str | None:
    """One flood on a new server with `scheduler`; returns the server's runtime."""
    plan = context.plan
    clients = {NOISY: plan.fairness_noisy_clients, **dict.fromkeys(QUIET, 1)}
    server = context.start(context.server(f"fairness-{scheduler}", store, scheduler=scheduler,
                                          **{**SERVER_OPTIONS,
                                             "max-batch-size": plan.fairness_batch_size}))
    try:
        facts = _facts(server)
        asyncio.run(warm_up_batch(server.url, context.jpegs, bots[NOISY], plan.fairness_batch_size))
        say(f"fairness {scheduler}: {plan.fairness_noisy_clients} noisy clients + "
            f"{len(QUIET)} quiet ones, {plan.fairness_warmup_s:.0f} s warm-up + "
            f"{plan.fairness_s:.0f} s ...")
        data = asyncio.run(flood(server.url, context.jpegs, bots, clients,
                                 plan.fairness_warmup_s, plan.fairness_s))
        summary = flood_summary(data, clients)
        result.runs[scheduler] = {"server": facts, **summary}
        noisy = summary["tenants"][NOISY]
        say(f"fairness {scheduler}: {summary['total_images_per_s']:.2f} images/s, quiet p50 "
            f"{summary['quiet']['p50_ms']:.0f} ms, noisy p50 {noisy['p50_ms']:.0f} ms, mean "
            f"batch {num(summary.get('mean_batch_size')):.1f}")
        return facts["runtime"]
    finally:
        server.stop()


def _run_quota(context: Context, store: Path, bots: dict[str, str],
               result: FairnessResult) -> None:
    from store import HeadStore

    plan = context.plan
    rate, capacity = quota_rate(result)
    with HeadStore(store) as heads:
        heads.set_tenant_limits(LIMITED, rate=rate, burst=QUOTA_BURST)
    server = context.start(context.server("fairness-quota", store, scheduler="fair",
                                          **{**SERVER_OPTIONS,
                                             "max-batch-size": plan.fairness_batch_size}))
    try:
        facts = _facts(server)
        say(f"quota: tenant '{LIMITED}' at {rate:g} images/s (burst {QUOTA_BURST}), "
            f"{QUOTA_IMAGES} images per request, {plan.quota_s:.0f} s from its first 429 ...")
        data = asyncio.run(quota_load(server.url, context.jpegs, bots[LIMITED],
                                      {t: bots[t] for t in QUIET}, QUOTA_IMAGES, plan.quota_s,
                                      opening_images=QUOTA_BURST))
    finally:
        server.stop()
    summary = quota_summary(data["calls"], data["first_429"], rate, QUOTA_BURST, QUOTA_IMAGES,
                            plan.quota_s)
    first = data["first_429"]
    quiet = call_stats([c for c in data["calls"] if c.tenant in QUIET], first,
                       first + plan.quota_s)
    result.quota = {"server": facts, "capacity_images_per_s": capacity, **summary,
                    "quiet": quiet}
    say(f"quota: {num(summary.get('accepted_images_per_s')):.2f} images/s accepted at a rate "
        f"of {rate:g}; {summary['refusals']} refusals ({summary['refusals_improper']} not "
        f"rate_limited + Retry-After), {summary['retries_refused']} honoured retries refused")


def run(context: Context) -> FairnessResult:
    plan = context.plan
    store, bots = tenant_store(context)
    result = FairnessResult(image=context.image_summary(),
                            noisy_clients=plan.fairness_noisy_clients, quiet_clients=1,
                            warmup_s=plan.fairness_warmup_s, duration_s=plan.fairness_s)
    runtime = None
    for scheduler in SCHEDULERS:
        try:
            runtime = _run_flood(context, store, bots, scheduler, result) or runtime
        except Exception as exc:  # noqa: BLE001 - the other runs are still worth measuring
            context.record_error(f"fairness-{scheduler}", exc)
    try:
        _run_quota(context, store, bots, result)
    except Exception as exc:  # noqa: BLE001 - as above
        context.record_error("fairness-quota", exc)
    # The servers are stopped: a raw trunk measured now has the machine to itself.
    if runtime is not None:
        try:
            result.raw_trunk = raw_batch(runtime, plan.fairness_batch_size,
                                         context.results.get("trunk"),
                                         context.results.get("service"),
                                         _measure_in_process(context))
        except Exception as exc:  # noqa: BLE001 - keep the load numbers
            context.record_error("fairness-raw-trunk", exc)
    return result


# -- report -------------------------------------------------------------------------------------


def _statuses(counts: Mapping[str, int] | None) -> str:
    return ", ".join(f"{k}: {v}" for k, v in (counts or {}).items()) or "—"


def render(result: FairnessResult, results: Results) -> str:
    raw = result.raw_trunk or {}
    runtime = next((r["server"].get("runtime") for r in result.runs.values()
                    if r.get("server")), None) or raw.get("name", "?")
    out = [f"## Fair sharing between tenants ({runtime}, {result.image}, feature cache off)",
           ""]
    out += [f"Flood: tenant `{NOISY}` with {result.noisy_clients} closed-loop clients, "
            f"{len(QUIET)} quiet tenants with {result.quiet_clients} each, one image per "
            f"request; {fmt(result.warmup_s)} s warm-up, then {fmt(result.duration_s)} s "
            "measured (latency of the requests sent in it; images/s answered in it, from the "
            "first trunk batch's answers to the last one's), one server per scheduler:", ""]
    rows = []
    for scheduler in SCHEDULERS:
        run_ = result.runs.get(scheduler) or {}
        served = run_.get("served") or {}
        for tenant, s in (run_.get("tenants") or {}).items():
            rows.append([scheduler, tenant, s.get("clients"), s.get("requests"),
                         s.get("images_per_s"), s.get("p50_ms"), s.get("p95_ms"),
                         _statuses(s.get("statuses")), served.get(tenant)])
    out += table(["scheduler", "tenant", "clients", "requests", "images/s", "p50 ms",
                  "p95 ms", "answers", "trunk images (server)"], rows)
    rows = []
    for scheduler in SCHEDULERS:
        run_ = result.runs.get(scheduler) or {}
        if not run_:
            continue
        quiet = run_.get("quiet") or {}
        rows.append([scheduler, run_.get("total_images_per_s"), quiet.get("p50_ms"),
                     quiet.get("p95_ms"), ((run_.get("tenants") or {}).get(NOISY) or {}).get(
                         "p50_ms"), run_.get("mean_batch_size"), run_.get("server_trunk_ms"),
                     run_.get("server_heads_ms"),
                     ratio(quiet.get("p50_ms"), run_.get("server_trunk_ms"))])
    if rows:
        out += ["", f"Per scheduler (quiet: the {len(QUIET)} quiet tenants' requests pooled; "
                "server: its own histograms over the window; the last column tells a slower "
                "machine from a longer wait):", ""]
        out += table(["scheduler", "total images/s", "quiet p50 ms", "quiet p95 ms",
                      "noisy p50 ms", "mean batch", "server trunk ms/batch",
                      "server heads ms/batch", "quiet p50 in server batches"], rows)
    if raw:
        out += ["", f"Raw {raw.get('name')} trunk, one batch of {raw.get('batch_size')}: "
                f"{fmt(1000 * num(raw.get('batch_s')))} ms ({fmt(raw.get('images_per_s'))} "
                f"images/s; from the {raw.get('source', '?').removeprefix('measured in the ')})"
                "."]
    q = result.quota
    if q:
        out += ["", f"Quota: tenant `{LIMITED}` at {fmt(q.get('rate'))} images/s (burst "
                f"{q.get('burst')}; from {fmt(q.get('capacity_images_per_s'))} images/s of "
                f"capacity), one client of {q.get('images_per_request')} images per request "
                f"(the first one: {q.get('burst')}) honouring Retry-After, beside the quiet "
                f"tenants at one client each; {fmt(q.get('window_s'))} s from its first 429 "
                "(the rate: from that 429 to the client's last one):", ""]
        quiet = q.get("quiet") or {}
        out += table(["rate", "accepted images in the window", "accepted / window",
                      "accepted rate (bucket-corrected)", "× rate", "answers", "Retry-After s",
                      "not 429 rate_limited + Retry-After", "honoured retries refused",
                      "quiet p50 ms"],
                     [[q.get("rate"), q.get("accepted_images"), q.get("plain_images_per_s"),
                       q.get("accepted_images_per_s"),
                       ratio(q.get("accepted_images_per_s"), q.get("rate")),
                       _statuses(q.get("statuses")), _statuses(q.get("retry_after_s")),
                       q.get("refusals_improper"), q.get("retries_refused"),
                       quiet.get("p50_ms")]])
    out += [""]
    return "\n".join(out)


def targets(result: FairnessResult, results: Results) -> list[Target]:
    fair_p50, fifo_p50 = num(result.quiet_p50_ms("fair")), num(result.quiet_p50_ms("fifo"))
    fair_rate, fifo_rate = (num(result.total_images_per_s("fair")),
                            num(result.total_images_per_s("fifo")))
    raw = result.raw_trunk or {}
    batch_ms = 1000 * num(raw.get("batch_s"))
    q = result.quota
    rate, accepted = num(q.get("rate")), num(q.get("accepted_images_per_s"))
    improper, retried = num(q.get("refusals_improper")), num(q.get("retries_refused"))
    bad = improper + retried if q.get("refusals") else math.nan  # no refusal: not exercised
    return [
        Target.of("fair_quiet_p50", f"quiet tenants' p50 under a flood, fair <= "
                  f"{QUIET_P50_VS_FIFO} x fifo (same run)", ("fairness",),
                  ratio(fair_p50, fifo_p50), QUIET_P50_VS_FIFO, "<=", "x",
                  note("fair {:.0f} ms vs fifo {:.0f} ms", fair_p50, fifo_p50)),
        Target.of("fair_quiet_vs_batch", f"quiet tenants' p50 under a flood with fair <= "
                  f"{QUIET_P50_VS_BATCH} x one full raw trunk batch", ("fairness",),
                  ratio(fair_p50, batch_ms), QUIET_P50_VS_BATCH, "<=", "x",
                  note(f"{{:.0f}} ms vs raw {raw.get('name', '?')} batch of "
                       f"{raw.get('batch_size', '?')} {{:.0f}} ms", fair_p50, batch_ms)),
        Target.of("fair_throughput", f"total images/s under a flood, fair >= "
                  f"{THROUGHPUT_VS_FIFO} x fifo", ("fairness",), ratio(fair_rate, fifo_rate),
                  THROUGHPUT_VS_FIFO, ">=", "x",
                  note("fair {:.2f} vs fifo {:.2f} images/s", fair_rate, fifo_rate)),
        Target.of("quota_rate", f"a limited tenant's accepted images/s within "
                  f"{RATE_TOLERANCE:.0%} of its rate: |accepted / rate - 1|", ("fairness",),
                  abs(ratio(accepted, rate) - 1), RATE_TOLERANCE, "<=", "",
                  note("{:.2f} images/s accepted at a rate of {:g}", accepted, rate)),
        Target.of("quota_retry_after", "quota refusals not 429 rate_limited + Retry-After, "
                  "plus honoured retries refused again", ("fairness",), bad, 0, "<=", "",
                  note("{:.0f} refusals: {:.0f} improper, {:.0f} retries refused",
                       num(q.get("refusals")), improper, retried)),
    ]


SECTION = Section("fairness", FairnessResult, run, render, targets)
