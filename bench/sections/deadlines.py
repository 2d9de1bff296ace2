"""Section `deadlines`: latency objectives at `serve`'s defaults (issue 32, item 5).

Four tenants, each owning one random bot of a store of their own: `noisy` and `quiet-1` (the
flood), `interactive` and `batch` (the trace). Every server runs `serve`'s defaults but for the
feature cache (off: every image goes through the trunk) and what a row below names.

- flood, fifo: `--scheduler fifo`; the noisy tenant's `plan.fairness_noisy_clients` closed-loop
  clients beside the quiet tenant's one, one image per request (`fairness_load.flood`: a
  warm-up of `plan.fairness_warmup_s`, then a window of `plan.deadlines_s`). Its total images/s
  is the machine's capacity C for the trace (full batches in arrival order).
- flood, fair (`serve`'s default scheduler): first the quiet tenant's client alone for
  `plan.deadlines_alone_s`, then the same flood.
- saturation, twice: the noisy tenant's clients alone (no light tenant to keep fast: every
  batch may be full), `plan.fairness_warmup_s` then `plan.deadlines_saturation_s`, on the fair
  server (`serve`'s defaults: the working batch size from the profile) and on a server with
  `serve`'s defaults as they were before issue 32 (`BEFORE_OPTIONS`: full batches of
  `--max-batch-size`, no profile). The issue's "saturation throughput >= 0.95 x today's".
  Under the flood beside the quiet tenant, fair's images/s against fifo's is reported too:
  that is the throughput the quiet tenant's latency costs (its short batches), not a target.
- the trace, three times on three servers, the same schedule and images: arrivals of a Poisson
  process at `LOAD` x C with bursts of `BURST_FACTOR` x its base rate (`bench.stats.
  bursty_arrivals`: bursts of `BURST_S` on average every `GAP_S`) over `plan.deadlines_trace_s`,
  one image per request, `INTERACTIVE_SHARE` of them the interactive tenant's (deadline
  `DEADLINES_MS`[interactive]) and the rest the batch tenant's (its own), sent whatever the
  server is doing (open loop; latency from the scheduled time):
  - `fifo`: `--scheduler fifo --request-timeout-s QUEUE_TIMEOUT_S`, no deadline sent: the
    queue timeout of Triton and OpenVINO Model Server (a row waiting longer is dropped), at the
    longest deadline of the two;
  - `fair`: the same with `--scheduler fair`;
  - `deadline-aware`: `serve`'s defaults (the flood's fair server), each request with its
    tenant's deadline in `X-Multihead-Deadline-Ms`.
  Per tenant: requests refused at admission (504 deadline_unmeetable), admitted (the rest),
  answered within the deadline, answered after it (a trunk image spent on a row past its
  deadline: the cache is off); goodput, the answers within their deadline per second.

Targets (`--check`): the quiet tenant's p50 under the flood, fair <= 0.5 x fifo and <= 4 x
alone; saturation images/s at `serve`'s defaults >= 0.95 x before the profile; fifo's full
batches under the flood run within TRUNK_VS_ALONE x their time alone (the server keeps up
with its trunk: nothing else of the server's takes its cores while it runs,
`service.core.cores`); on the trace with deadlines, >= 99 % of the interactive tenant's
admitted requests answered within 150 ms, goodput >= 1.5 x fifo's, and no trunk image for a
row past its deadline (its deadline passed before its batch's trunk started: issue 32's item 3
drops such a row before the trunk, and never a row with time left: so the target holds by
construction while those drops work, and guards them). A row the trunk ran in time
whose batch ended after its deadline (the trunk slower than its live profile's upper time,
mostly in the trace's bursts) is reported, not judged: the within-deadline target counts it as
a miss, and no estimate can rule it out without dropping rows with time left.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from bench.context import Context, say
from bench.markdown import fmt, table
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.sections.deadlines_load import trace, trace_load, trace_summary
from bench.sections.fairness_load import NOISY, QUIET, flood, warm_up_batch
from bench.sections.fairness_numbers import call_stats, flood_summary
from bench.stats import bursty_arrivals, num, ratio

QUIET_ONE = QUIET[0]
INTERACTIVE, BATCH = "interactive", "batch"
TENANTS = (NOISY, QUIET_ONE, INTERACTIVE, BATCH)
DEADLINES_MS = {INTERACTIVE: 150.0, BATCH: 5000.0}
LOAD = 0.8  # the trace's mean rate, x the capacity
BURST_FACTOR = 10.0
BURST_S, GAP_S = 0.3, 3.0  # mean length of a burst, of the spell between two
INTERACTIVE_SHARE = 0.8
QUEUE_TIMEOUT_S = 5.0
WARMUP_BATCH = 8  # images at once before a load: the trunk's batch shapes

SERVER_OPTIONS = {"feature-cache-size": 0}
# `serve`'s defaults before issue 32 (the saturation target's "today's"): every batch as
# full as the queue allows, up to --max-batch-size, no working size from a profile.
BEFORE_OPTIONS = {"batch-from-profile": False}
SATURATION = ("defaults", "before the profile")  # the saturation floods' servers
MODES = {  # trace mode -> (server options, send deadlines)
    "fifo": ({"scheduler": "fifo", "request-timeout-s": QUEUE_TIMEOUT_S}, False),
    "fair": ({"scheduler": "fair", "request-timeout-s": QUEUE_TIMEOUT_S}, False),
    "deadline-aware": ({}, True),
}

# Targets.
QUIET_VS_FIFO = 0.5
QUIET_VS_ALONE = 4.0
SATURATION_VS_BEFORE = 0.95
INTERACTIVE_MET = 0.99
GOODPUT_VS_FIFO = 1.5
TRUNK_VS_ALONE = 1.15


@dataclass
class DeadlinesResult(Result):
    image: str = ""
    runtime: str | None = None
    noisy_clients: int | None = None
    warmup_s: float | None = None
    duration_s: float | None = None
    alone: dict = field(default_factory=dict)  # the quiet tenant alone (`call_stats`)
    # The fifo server's batch profile: {batch size: ms alone} (/readyz trunk.profile.batch_ms)
    alone_batch_ms: dict[str, float] = field(default_factory=dict)
    floods: dict[str, dict] = field(default_factory=dict)  # scheduler -> `flood_summary`
    # The noisy tenant's clients alone: SATURATION's server -> `flood_summary`
    saturation: dict[str, dict] = field(default_factory=dict)
    saturation_s: float | None = None
    capacity: float | None = None  # images/s of the fifo flood
    # The trace: {"rate", "duration_s", "requests", "bursts", "burst_s"}
    trace: dict = field(default_factory=dict)
    runs: dict[str, dict] = field(default_factory=dict)  # trace mode -> `trace_summary`

    def quiet_p50(self, scheduler: str) -> float | None:
        return ((self.floods.get(scheduler) or {}).get("quiet") or {}).get("p50_ms")

    def flood_rate(self, scheduler: str) -> float | None:
        return (self.floods.get(scheduler) or {}).get("total_images_per_s")

    def saturation_rate(self, server: str) -> float | None:
        return (self.saturation.get(server) or {}).get("total_images_per_s")

    def trunk_vs_alone(self, scheduler: str) -> float | None:
        """The flood's trunk time per batch in the server over the profile's time alone at its
        mean batch size, when that is a size of the profile (fifo's full batches); else None."""
        run_ = self.floods.get(scheduler) or {}
        mean, trunk_ms = run_.get("mean_batch_size"), run_.get("server_trunk_ms")
        if mean is None or trunk_ms is None or abs(mean - round(mean)) > 0.05:
            return None
        return ratio(trunk_ms, self.alone_batch_ms.get(str(round(mean))))


def deadline_store(context: Context) -> tuple[Path, dict[str, str]]:
    """A new store of the section's tenants, each owning one random bot `<tenant>-bot`."""
    from bench.bots import register_tenant_bots

    store = context.tmp / "deadlines-store"
    bots = register_tenant_bots(store, TENANTS, context.plan.classes, context.plan.seed + 32)
    context.share_graph_cache(store)
    return store, bots


def _load(context: Context, server, bots: dict[str, str], clients: dict[str, int],
          seconds: float, what: str) -> dict:
    """`flood`'s closed-loop `clients` after the plan's warm-up, for `seconds`: its
    `flood_summary`."""
    say(f"deadlines {what}, {context.plan.fairness_warmup_s:.0f} s warm-up + {seconds:.0f} s ...")
    data = asyncio.run(flood(server.url, context.jpegs, bots, clients,
                             context.plan.fairness_warmup_s, seconds))
    return flood_summary(data, clients)


def _flood(context: Context, server, bots: dict[str, str], scheduler: str,
           result: DeadlinesResult) -> None:
    noisy = context.plan.fairness_noisy_clients
    summary = result.floods[scheduler] = _load(
        context, server, bots, {NOISY: noisy, QUIET_ONE: 1}, context.plan.deadlines_s,
        f"{scheduler}: {noisy} noisy clients + 1 quiet")
    say(f"deadlines {scheduler}: {num(summary['total_images_per_s']):.2f} images/s, quiet p50 "
        f"{num(summary['quiet'].get('p50_ms')):.0f} ms")


def _saturation(context: Context, server, bots: dict[str, str], name: str,
                result: DeadlinesResult) -> None:
    noisy = context.plan.fairness_noisy_clients
    summary = result.saturation[name] = _load(
        context, server, bots, {NOISY: noisy}, context.plan.deadlines_saturation_s,
        f"saturation ({name}): {noisy} noisy clients alone")
    say(f"deadlines saturation ({name}): {num(summary['total_images_per_s']):.2f} images/s, "
        f"mean batch {num(summary.get('mean_batch_size')):.1f}")


def _alone(context: Context, server, bots: dict[str, str], result: DeadlinesResult) -> None:
    plan = context.plan
    say(f"deadlines: the quiet tenant alone for {plan.deadlines_alone_s:.0f} s ...")
    data = asyncio.run(flood(server.url, context.jpegs, bots, {QUIET_ONE: 1}, 2.0,
                             plan.deadlines_alone_s))
    begin, end = data["window"]
    result.alone = call_stats(data["calls"], begin, end)


def _trace(context: Context, server, bots: dict[str, str], mode: str, schedule,
           result: DeadlinesResult) -> None:
    send = MODES[mode][1]
    say(f"deadlines trace '{mode}': {len(schedule)} requests over "
        f"{result.trace['duration_s']:.0f} s ...")
    data = asyncio.run(trace_load(server.url, context.jpegs, bots, schedule, DEADLINES_MS,
                                  send_deadlines=send))
    summary = trace_summary(data["calls"], DEADLINES_MS, result.trace["duration_s"],
                            data["late_rows"], data["expired_rows"])
    result.runs[mode] = summary
    fast = summary["tenants"][INTERACTIVE]
    say(f"deadlines trace '{mode}': goodput {summary['goodput_per_s']:.1f}/s, interactive "
        f"{fast['within']}/{fast['admitted']} admitted within {DEADLINES_MS[INTERACTIVE]:g} ms "
        f"({fast['refused_at_admission']} refused at once), {summary['late']} answers late; "
        f"trunk rows run past their deadline {summary['trunk_rows_expired']:.0f}, ended past "
        f"it {summary['trunk_rows_late']:.0f}")


def run(context: Context) -> DeadlinesResult:
    plan = context.plan
    store, bots = deadline_store(context)
    result = DeadlinesResult(image=context.image_summary(),
                             noisy_clients=plan.fairness_noisy_clients,
                             warmup_s=plan.fairness_warmup_s, duration_s=plan.deadlines_s,
                             saturation_s=plan.deadlines_saturation_s)

    def served(name: str, options: dict, *steps) -> None:
        server = context.start(context.server(name, store, **{**SERVER_OPTIONS, **options}))
        try:
            result.runtime = result.runtime or server.runtime()
            asyncio.run(warm_up_batch(server.url, context.jpegs, bots[NOISY], WARMUP_BATCH))
            for step in steps:
                step(server)
        finally:
            server.stop()

    schedule: list = []

    def make_trace(server) -> None:
        result.capacity = result.flood_rate("fifo")
        if not result.capacity:
            raise RuntimeError("no capacity measured (the fifo flood failed): no trace")
        rate = LOAD * result.capacity
        arrivals, bursts = bursty_arrivals(rate, plan.deadlines_trace_s, factor=BURST_FACTOR,
                                           burst_s=BURST_S, gap_s=GAP_S, seed=plan.seed + 32)
        schedule[:] = trace(arrivals, (INTERACTIVE, BATCH), INTERACTIVE_SHARE, plan.seed)
        result.trace = {"rate": rate, "duration_s": plan.deadlines_trace_s,
                        "requests": len(schedule), "bursts": len(bursts),
                        "burst_s": sum(e - b for b, e in bursts)}

    def profile(server) -> None:
        result.alone_batch_ms = dict((server.trunk_info().get("profile") or {}).get("batch_ms")
                                     or {})

    served("deadlines-fifo", {"scheduler": "fifo"}, profile,
           lambda s: _flood(context, s, bots, "fifo", result), make_trace)
    served("deadlines-fair", {},
           lambda s: _alone(context, s, bots, result),
           lambda s: _flood(context, s, bots, "fair", result),
           lambda s: _saturation(context, s, bots, SATURATION[0], result),
           lambda s: _trace(context, s, bots, "deadline-aware", schedule, result))
    try:
        served("deadlines-before", BEFORE_OPTIONS,
               lambda s: _saturation(context, s, bots, SATURATION[1], result))
    except Exception as exc:  # noqa: BLE001 - the trace is still worth measuring
        context.record_error("deadlines-before", exc)
    for mode in ("fifo", "fair"):
        try:
            served(f"deadlines-trace-{mode}", MODES[mode][0],
                   lambda s, m=mode: _trace(context, s, bots, m, schedule, result))
        except Exception as exc:  # noqa: BLE001 - the other runs are still worth measuring
            context.record_error(f"deadlines-trace-{mode}", exc)
    return result


# -- report -------------------------------------------------------------------------------------


def _statuses(counts) -> str:
    return ", ".join(f"{k}: {v}" for k, v in (counts or {}).items()) or "—"


def render(result: DeadlinesResult, results: Results) -> str:
    out = [f"## Latency objectives ({result.runtime or '?'}, {result.image}, feature cache "
           "off, `serve`'s defaults)", ""]
    alone = result.alone or {}
    out += [f"Flood: tenant `{NOISY}` with {result.noisy_clients} closed-loop clients beside "
            f"`{QUIET_ONE}` with one, one image per request, {fmt(result.warmup_s)} s warm-up "
            f"then {fmt(result.duration_s)} s measured; the quiet tenant alone: p50 "
            f"{fmt(alone.get('p50_ms'))} ms, p99 {fmt(alone.get('p99_ms'))} ms.", ""]
    rows = []
    for scheduler in ("fifo", "fair"):
        run_ = result.floods.get(scheduler) or {}
        if run_:
            quiet = run_.get("quiet") or {}
            rows.append([scheduler, run_.get("total_images_per_s"), quiet.get("p50_ms"),
                         quiet.get("p99_ms"), ratio(quiet.get("p50_ms"), alone.get("p50_ms")),
                         ((run_.get("tenants") or {}).get(NOISY) or {}).get("p50_ms"),
                         run_.get("mean_batch_size"), run_.get("server_trunk_ms"),
                         result.trunk_vs_alone(scheduler)])
    out += table(["scheduler", "total images/s", "quiet p50 ms", "quiet p99 ms",
                  "quiet p50 / alone", "noisy p50 ms", "mean batch", "server trunk ms/batch",
                  "trunk / alone"], rows)
    fair_vs_fifo = ratio(result.flood_rate("fair"), result.flood_rate("fifo"))
    out += ["", f"Beside the quiet tenant fair runs {fmt(fair_vs_fifo)} x fifo's images/s: "
            "the price of its short batches (not a target).", ""]
    if result.saturation:
        out += [f"Saturation: the noisy tenant's {result.noisy_clients} clients alone, "
                f"{fmt(result.warmup_s)} s warm-up then {fmt(result.saturation_s)} s measured; "
                "`serve`'s defaults against its defaults before the batch profile "
                "(`--no-batch-from-profile`: every batch as full as the queue allows).", ""]
        out += table(["server", "images/s", "x before", "mean batch", "server trunk ms/batch",
                      "noisy p50 ms"],
                     [[name, result.saturation_rate(name),
                       ratio(result.saturation_rate(name), result.saturation_rate(SATURATION[1])),
                       (result.saturation.get(name) or {}).get("mean_batch_size"),
                       (result.saturation.get(name) or {}).get("server_trunk_ms"),
                       (((result.saturation.get(name) or {}).get("tenants") or {}).get(NOISY)
                        or {}).get("p50_ms")]
                      for name in SATURATION if result.saturation.get(name)])
    t = result.trace
    if t:
        out += ["", f"Trace: {t.get('requests')} requests over {fmt(t.get('duration_s'))} s "
                f"at {fmt(t.get('rate'))} requests/s ({LOAD:.0%} of the fifo flood's "
                f"{fmt(result.capacity)} images/s), {t.get('bursts')} bursts of "
                f"{BURST_FACTOR:g}x ({fmt(t.get('burst_s'))} s in all); "
                f"{INTERACTIVE_SHARE:.0%} of the requests `{INTERACTIVE}`'s (deadline "
                f"{DEADLINES_MS[INTERACTIVE]:g} ms), the rest `{BATCH}`'s "
                f"({DEADLINES_MS[BATCH]:g} ms). fifo and fair: queue timeout "
                f"{QUEUE_TIMEOUT_S:g} s, no deadline sent; deadline-aware: each request's "
                "deadline in its header.", ""]
        rows = []
        for mode in MODES:
            run_ = result.runs.get(mode) or {}
            for tenant, s in (run_.get("tenants") or {}).items():
                rows.append([mode, tenant, s.get("sent"), s.get("refused_at_admission"),
                             s.get("admitted"), s.get("within"), s.get("late"),
                             s.get("met_of_admitted"), s.get("goodput_per_s"),
                             s.get("p50_ms"), s.get("p99_ms"), _statuses(s.get("statuses"))])
        out += table(["mode", "tenant", "sent", "refused at once", "admitted",
                      "within deadline", "late answers", "within / admitted",
                      "goodput /s", "p50 ms", "p99 ms", "answers"], rows)
        rows = [[mode, (result.runs.get(mode) or {}).get("goodput_per_s"),
                 ratio((result.runs.get(mode) or {}).get("goodput_per_s"),
                       (result.runs.get("fifo") or {}).get("goodput_per_s")),
                 (result.runs.get(mode) or {}).get("late"),
                 *([(result.runs.get(mode) or {}).get(k)
                    for k in ("trunk_rows_expired", "trunk_rows_late")]
                   if MODES[mode][1] else ["—", "—"])]
                for mode in MODES if result.runs.get(mode)]
        out += ["", "Goodput (answers within their deadline per second), both tenants; late "
                "answers as the clients saw them; as the server counted them (it knows only "
                "the deadlines sent), the trunk rows it ran past their deadline (passed when "
                "the trunk started) and those whose batch ended past it:", ""]
        out += table(["mode", "goodput /s", "x fifo", "late answers",
                      "trunk rows run past deadline", "trunk rows ended past deadline"], rows)
    out += [""]
    return "\n".join(out)


def targets(result: DeadlinesResult, results: Results) -> list[Target]:
    fair, fifo = num(result.quiet_p50("fair")), num(result.quiet_p50("fifo"))
    alone = num((result.alone or {}).get("p50_ms"))
    now, before = (num(result.saturation_rate(SATURATION[0])),
                   num(result.saturation_rate(SATURATION[1])))
    aware = result.runs.get("deadline-aware") or {}
    fast = (aware.get("tenants") or {}).get(INTERACTIVE) or {}
    good, good_fifo = (num(aware.get("goodput_per_s")),
                       num((result.runs.get("fifo") or {}).get("goodput_per_s")))
    need = ("deadlines",)
    return [
        Target.of("deadlines_quiet_vs_fifo", f"quiet tenant's p50 beside a flood at serve's "
                  f"defaults, fair <= {QUIET_VS_FIFO} x fifo", need, ratio(fair, fifo),
                  QUIET_VS_FIFO, "<=", "x", note("fair {:.0f} ms vs fifo {:.0f} ms", fair, fifo)),
        Target.of("deadlines_quiet_vs_alone", f"quiet tenant's p50 beside a flood at serve's "
                  f"defaults <= {QUIET_VS_ALONE} x alone", need, ratio(fair, alone),
                  QUIET_VS_ALONE, "<=", "x", note("{:.0f} ms vs {:.0f} ms alone", fair, alone)),
        Target.of("deadlines_saturation", f"saturation (one tenant's clients alone): images/s "
                  f"at serve's defaults >= {SATURATION_VS_BEFORE} x before the batch profile "
                  "(full batches)", need, ratio(now, before), SATURATION_VS_BEFORE, ">=", "x",
                  note("{:.2f} vs {:.2f} images/s", now, before)),
        Target.of("deadlines_trunk_in_server", f"fifo's full batches under the flood: the "
                  f"trunk's time in the server <= {TRUNK_VS_ALONE} x its time alone (the "
                  "profile)", need, result.trunk_vs_alone("fifo"), TRUNK_VS_ALONE, "<=", "x",
                  note("{:.0f} ms a batch of {:.0f}", num((result.floods.get("fifo") or {}).get(
                      "server_trunk_ms")), num((result.floods.get("fifo") or {}).get(
                          "mean_batch_size")))),
        Target.of("deadlines_interactive_met", f"bursty trace: interactive requests admitted "
                  f"and answered within {DEADLINES_MS[INTERACTIVE]:g} ms >= "
                  f"{INTERACTIVE_MET:.0%}", need, fast.get("met_of_admitted"),
                  INTERACTIVE_MET, ">=", "",
                  note("{:.0f} of {:.0f} admitted ({:.0f} refused at once)",
                       num(fast.get("within")), num(fast.get("admitted")),
                       num(fast.get("refused_at_admission")))),
        Target.of("deadlines_goodput", f"bursty trace: goodput with deadlines >= "
                  f"{GOODPUT_VS_FIFO} x fifo with a {QUEUE_TIMEOUT_S:g} s queue timeout", need,
                  ratio(good, good_fifo), GOODPUT_VS_FIFO, ">=", "x",
                  note("{:.1f} vs {:.1f} answers in time per s", good, good_fifo)),
        Target.of("deadlines_expired", "bursty trace with deadlines: trunk images for rows "
                  "past their deadline when the trunk started (the server's "
                  "multihead_tenant_rows_run_expired_total)", need,
                  aware.get("trunk_rows_expired"), 0, "<=", "",
                  note("reported, not judged: {:.0f} rows whose batch ended after their "
                       "deadline (multihead_tenant_rows_late_total), {:.0f} answers late as "
                       "the clients saw them (their clock starts before the server reads the "
                       "request)", num(aware.get("trunk_rows_late")), num(aware.get("late")))),
    ]


SECTION = Section("deadlines", DeadlinesResult, run, render, targets)
