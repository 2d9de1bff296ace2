"""Section `cancellation`: what clients that give up cost the clients that stay (issue 23).

Closed-loop clients (one store of 16 bots, the default tenant), one image per request (the
run's JPEGs in turn). Every server runs `serve`'s defaults (runtime and precision auto, the
30 s request deadline, the 256-row queue bound) with the feature cache off (every image reaches
the trunk) and `--max-batch-size 8` (`Plan.cancellation_batch_size`: 16 one-image clients keep
a batch queued behind the one running). The loads, `SCENARIOS`, in order:

- `one-client`, on a server with cancellation (`--cancel-on-disconnect`, the default): one
  client alone (2 s, then 10 s measured). Its p50 is THE median m: what a request takes when it
  does not queue.
- `all-patient`, on the same server: 16 clients, a bot each, all wait for their answers (the
  16-client throughput, and what 8 patient clients get beside 8 others that wait too). The
  server's trunk time per batch and per image over its window (B, and B over the mean batch)
  set the impatient clients of the next two loads (`BATCH_SCENARIO`).
- `cancel`, on the same server: 8 patient clients, and N impatient ones whose every request has
  a client timeout T (`bench.sections.impatience`: T = B / 4, at least m; N = 8, or more when
  T is m, so that they abandon 4 x the rows the trunk runs a second, whatever its speed). On a
  timeout aiohttp closes the request's connection (the client goes away: a 499 on the server)
  and the client at once sends its next request (after a refusal, it sleeps its Retry-After,
  as every client of the benchmark). The impatient clients use the 8 bots the patient ones do
  not, in turn.
- `no-cancel`: the same load on a second server with `--no-cancel-on-disconnect` (same store,
  images and batch size): a request given up on runs to its end, its answer dropped.

Each load: a warm-up (`Plan.cancellation_warmup_s`), then a window of `Plan.cancellation_s`.
Per group of clients (patient, impatient): the requests SENT in the window, their statuses and
the p50/p95 of those answered, and `goodput`, the images of those answered per second of window
(charged to when they were sent: the clients keep the load on until each is answered or
refused, so an overload that grows during the window is charged in full); the images/s
answered in the window (`fairness_numbers.batch_rates`); the server's trunk images over the
window (its trunk batches' rows, `multihead_batch_size`'s sum) against the images answered in
it; over the whole load, the clients' give-ups and the requests still in flight when the load
stopped (abandoned too) against the server's classify requests by status
(`multihead_requests_total`).

Why T comes from B and not from m alone: `bench.sections.impatience` (2 x m abandoned 2-5 x
the trunk's rows on one CPU and under 1 x on another). Why not from the 16-client median: that
load holds 16 rows, so a request waits for one batch and runs in the next, whatever the
machine; its latency spreads little, and the rare request that outlives 2 x that median is
late because its batch runs slow, so it is in the running batch when its client leaves, where
nothing can be withdrawn any more. Run that way (a median of 11.9 s on 2 loaded cores), no
request of either comparison load took longer than 14.1 s: no give-up, and the two servers
could not differ. With cancellation the abandoned rows leave the queue; without, they stay
until the trunk runs them or the deadline (30 s) drops them, and the patient clients' rows wait
behind them. Rows already in the running batch are run either way (T is shorter than a batch:
every impatient row a batch takes), so with cancellation the impatient clients cost the patient
ones what as many patient clients would: docs/performance.md#cancellation has the expectation
and the numbers.

- `shadow`: the 16 patient clients on a third server (`--cancel-on-disconnect`, as
  `all-patient`'s) after `register_shadows` gave EVERY bot of the store a shadow candidate
  (`HeadStore.register(..., candidate="shadow")`, as `multihead register BOT ... --candidate
  shadow`): another seeded random head with the same labels, so that the comparison does real
  work. Each row is then scored by two heads, the live one answering. Last, as its `prepare`
  changes the store for every server after it.

A scenario is one line of `SCENARIOS` on a server of `SERVERS` (its `serve` flags, and
`prepare`, run on the store before that server starts).

The shadow's cost (`shadow_cost`), `shadow` against `all-patient` (same store but for the
candidates, same batch size, one run): the clients' answered images/s, and the server's own
time per trunk image (`multihead_trunk_seconds` + `multihead_heads_seconds` over
`multihead_batch_size`'s rows, over the window). A candidate costs heads time only (it is
scored on the features the trunk computed once for the row), and in a closed loop that keeps a
batch queued the throughput is rows per batch time: so the target takes `server_ratio`, the
shadow run's per-image time with the heads time of the run without candidates in place of its
own, ÷ its own. The two runs are two servers one after the other, whose trunk time per batch
drifts with the machine (by 20-50 %, either way, in the runs measured: far more than the 3 %
bound), which the clients' ratio carries in full and `server_ratio` does not:
docs/performance.md#cancellation has both measured. That
the shadows ran: `multihead_candidate_images_total` (all series) over the window against the
trunk images in it (every row of a bot with a shadow is scored by it: equal, but for a batch
scored between the scrapes' reads of the two metrics).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.context import Context, say
from bench.markdown import fmt, table
from bench.prometheus import by_labels, histograms
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.sections.fairness_load import Call, flood, warm_up_batch
from bench.sections.fairness_numbers import batch_rates, call_stats
from bench.sections.impatience import Impatience, impatience
from bench.stats import num, ratio

CLIENTS = 16  # the bots of the store, and the clients of the loads without give-ups
PATIENT, IMPATIENT = "patient", "impatient"
MEDIAN_SCENARIO = "one-client"  # the scenario whose p50 is the median
BATCH_SCENARIO = "all-patient"  # the one whose trunk time sets the impatient clients

# Every server of the section: `serve`'s defaults but no feature cache (every image reaches
# the trunk) and the plan's batch size.
SERVER_OPTIONS = {"feature-cache-size": 0}
SETTLE_S = 10.0  # longest wait for the server to count the last disconnects of a load
STOP_S = 3.0  # a server's graceful stop, then SIGKILL (its backlog is nobody's: measured)

# Targets.
PATIENT_GOODPUT_WITHOUT = 0.5  # patient goodput, no-cancel / cancel
UNCOUNTED_GIVE_UPS = 0.02  # share of the give-ups the server did not count as 499
SHADOW_RATIO = 0.97  # throughput with a shadow on every bot / without (`shadow_cost`)
SHADOW_SCORED = 0.99  # candidate images / trunk images over the shadow window
SHADOW_SEED = 7919  # added to the plan's seed for the candidates' heads


@dataclass(frozen=True)
class Server:
    """A server of the section: its `serve` flags beyond `SERVER_OPTIONS`, whether it cancels
    the requests of clients that go away, and `prepare(context, store, bots)`, run on the store
    before it starts when given."""

    options: Mapping[str, object]
    cancels: bool = True
    prepare: Callable[[Context, Path, list[str]], None] | None = None


@dataclass(frozen=True)
class Scenario:
    """One load: `patient` closed-loop clients and, when `impatient`, the run's impatient ones
    (`Impatience`: how many, and after how long they give up), on `server` (scenarios of one
    server run on it one after the other, in order); `text`, its clients in words ("{patient}"
    and "{impatient}" filled in); its warm-up and window in seconds, when not the plan's."""

    name: str
    server: str
    patient: int
    impatient: bool
    text: str
    warmup_s: float | None = None
    window_s: float | None = None


def register_shadows(context: Context, store: Path, bots: list[str]) -> None:
    """Gives every bot of `bots` a shadow candidate: a seeded random head (another seed than
    the bots') with the bot's labels, registered into the store at `store`."""
    from bench.bots import random_head
    from store import HeadStore

    rng = np.random.default_rng(context.plan.seed + SHADOW_SEED)
    heads = HeadStore(store)
    try:
        for bot in bots:
            weights, biases, _ = random_head(rng, context.plan.classes)
            heads.register(bot, weights, biases, heads.info(bot).labels,
                           source="bench shadow", candidate="shadow")
    finally:
        heads.close()
    say(f"cancellation: a shadow candidate on each of the {len(bots)} bots")


SERVERS: dict[str, Server] = {
    "cancel": Server({"cancel-on-disconnect": True}),
    "no-cancel": Server({"cancel-on-disconnect": False}, cancels=False),
    "shadow": Server({"cancel-on-disconnect": True}, prepare=register_shadows),
}
SCENARIOS: tuple[Scenario, ...] = (
    Scenario(MEDIAN_SCENARIO, "cancel", 1, False, "1 client: the median", 2.0, 10.0),
    Scenario(BATCH_SCENARIO, "cancel", CLIENTS, False, "{patient} patient"),
    Scenario("cancel", "cancel", CLIENTS // 2, True,
             "{patient} patient + {impatient} giving up, `--cancel-on-disconnect`"),
    Scenario("no-cancel", "no-cancel", CLIENTS // 2, True,
             "{patient} patient + {impatient} giving up, `--no-cancel-on-disconnect`"),
    Scenario("shadow", "shadow", CLIENTS, False,
             "{patient} patient, a shadow candidate on every bot"),
)
SHADOW_BASE = "all-patient"  # the scenario the shadow one is compared with


@dataclass
class CancellationResult(Result):
    image: str = ""
    clients: int | None = None
    batch_size: int | None = None
    warmup_s: float | None = None
    duration_s: float | None = None
    median_ms: float | None = None  # the one-client scenario's p50
    # From `BATCH_SCENARIO`'s server: its trunk ms per batch and per image over the window.
    batch_ms: float | None = None
    image_ms: float | None = None
    impatient: int | None = None  # the clients that give up (`impatience`)
    timeout_s: float | None = None  # after how long
    overload: float | None = None  # the requests they abandon a second ÷ the trunk's rows
    # scenario -> `load_summary`, plus "server": {runtime, ready_s, pid, cancels}, "warmup_s"
    runs: dict[str, dict] = field(default_factory=dict)

    def patient_goodput(self, scenario: str) -> float | None:
        """The patient clients' goodput in `scenario` (`load_summary`)."""
        return ((self.runs.get(scenario) or {}).get(PATIENT) or {}).get("goodput")


# -- numbers ------------------------------------------------------------------------------------


def gave_up(call: Call) -> bool:
    """A request its client gave up on (its timeout passed: no answer)."""
    return call.status == -1 and "Timeout" in call.code


def _group_of(label: str) -> str:
    """"patient" of the client label "patient-3"."""
    return label.split("-", 1)[0]


def _histogram_delta(before: str, after: str, name: str):
    hb, ha = histograms(before), histograms(after)
    return ha[name].minus(hb.get(name)) if name in ha else None


def _counter_delta(before: str, after: str, name: str) -> float | None:
    """A counter's increase between two /metrics texts, over all its series; None when
    `after` has none of them."""
    a = by_labels(after, name)
    if not a:
        return None
    return sum(a.values()) - sum(by_labels(before, name).values())


def statuses(before: str, after: str) -> dict[str, int]:
    """The server's classify requests by status between two /metrics texts."""
    b = by_labels(before, "multihead_requests_total")
    a = by_labels(after, "multihead_requests_total")
    out = {}
    for key, value in sorted(a.items()):
        route, _, status = key.partition(" ")
        if route == "classify" and value - b.get(key, 0.0):
            out[status] = int(value - b.get(key, 0.0))
    return out


def load_summary(data: Mapping, whole: Mapping[str, str] | None = None) -> dict:
    """One load's numbers, from `fairness_load.flood`'s data (client labels "patient-i",
    "impatient-i") and `whole`, the /metrics texts "before" the load and "after" it settled
    (see the module doc)."""
    begin, end = data["window"]
    span = end - begin
    calls: Sequence[Call] = data["calls"]
    groups = [g for g in (PATIENT, IMPATIENT) if any(_group_of(c.tenant) == g for c in calls)]
    out: dict = {"window_s": span}
    for group in groups:
        mine = [c for c in calls if _group_of(c.tenant) == group]
        stats = call_stats(mine, begin, end)
        stats["clients"] = len({c.tenant for c in mine})
        stats["gave_up"] = sum(1 for c in mine if gave_up(c) and begin <= c.start < end)
        answered = sum(c.images for c in mine if c.status == 200 and begin <= c.start < end)
        stats["goodput"] = answered / span if span > 0 else math.nan
        out[group] = stats
    out["answered_images"] = sum(c.images for c in calls
                                 if c.status == 200 and begin < c.end <= end)
    before, after = data.get("before") or "", data.get("after") or ""
    trunk_ms = math.nan
    if after:
        size = _histogram_delta(before, after, "multihead_batch_size")
        trunk = _histogram_delta(before, after, "multihead_trunk_seconds")
        heads = _histogram_delta(before, after, "multihead_heads_seconds")
        trunk_ms = 1000 * trunk.mean if trunk else math.nan
        out.update(batches=size.count if size else None,
                   mean_batch_size=size.mean if size else None,
                   trunk_images=size.sum if size else None,
                   server_trunk_ms=None if math.isnan(trunk_ms) else trunk_ms,
                   server_heads_ms=1000 * heads.mean if heads else None,
                   candidate_images=_counter_delta(before, after,
                                                   "multihead_candidate_images_total"))
    # images/s answered in the window: from the first trunk batch's answers to the last one's
    # (half the server's trunk time per batch tells batches apart); else over the window.
    rates, measured = ({}, None) if math.isnan(trunk_ms) else batch_rates(calls, begin, end,
                                                                           trunk_ms / 2000)
    if measured:
        for group in groups:
            out[group]["images_per_s"] = sum(r for t, r in rates.items() if _group_of(t) == group)
    out["measured_s"] = measured or span
    out["total_images_per_s"] = sum(out[g]["images_per_s"] for g in groups)
    out["gave_up"] = sum(1 for c in calls if gave_up(c))
    out["unfinished"] = data.get("unfinished")
    if whole:
        out["server_statuses"] = statuses(whole["before"], whole["after"])
    return out


def uncounted_give_ups(run: Mapping) -> float:
    """The load's give-ups the server did not count as 499: max(0, give-ups - 499s) (the 499s
    may exceed the give-ups by the requests abandoned when the load stopped); NaN when either
    count is missing."""
    if run.get("gave_up") is None or "server_statuses" not in run:
        return math.nan
    return max(0.0, run["gave_up"] - (run["server_statuses"] or {}).get("499", 0))


def rows_for_nobody(run: Mapping) -> float:
    """Trunk images over the window minus the images answered in it: rows of requests whose
    clients had left (up to a batch at either edge of the window); NaN when not measured."""
    return num(run.get("trunk_images")) - num(run.get("answered_images"))


def per_image_ms(run: Mapping, key: str) -> float:
    """`run`'s server time per trunk image over its window, from a per-batch mean (`key`:
    "server_trunk_ms" or "server_heads_ms"); NaN when not measured."""
    images = num(run.get("trunk_images"))
    return num(run.get(key)) * num(run.get("batches")) / images if images else math.nan


def shadow_cost(base: Mapping, shadow: Mapping) -> dict:
    """The shadow candidates' cost, `shadow` (a load on a server with a shadow on every bot)
    against `base` (the same load without candidates), both `load_summary`s (see the module
    doc): per trunk image, each run's server trunk and heads ms; `client_ratio`, the answered
    images/s with shadows ÷ without; `server_ratio`, the shadow run's per-image time with
    `base`'s heads time in place of its own ÷ its own (its throughput without the shadows'
    extra heads time, as its trunk ran); `scored`, the candidate images ÷ the trunk images over
    the shadow window. NaN where a number is missing (or a division by zero)."""
    def div(a: float, b: float) -> float:
        return a / b if b else math.nan

    trunk0, heads0 = per_image_ms(base, "server_trunk_ms"), per_image_ms(base, "server_heads_ms")
    trunk1, heads1 = (per_image_ms(shadow, "server_trunk_ms"),
                      per_image_ms(shadow, "server_heads_ms"))
    return {"trunk_ms": (trunk0, trunk1), "heads_ms": (heads0, heads1),
            "client_ratio": div(num(shadow.get("total_images_per_s")),
                                num(base.get("total_images_per_s"))),
            "server_ratio": div(trunk1 + heads0, trunk1 + heads1),
            "scored": div(num(shadow.get("candidate_images")),
                          num(shadow.get("trunk_images")))}


# -- the section ------------------------------------------------------------------------------


async def _scrape(url: str) -> str:
    from bench.load import client_session

    async with client_session() as session:
        async with session.get(f"{url}/metrics") as response:
            return await response.text() if response.status == 200 else ""


async def _settled(url: str, expected_499: float, timeout_s: float = SETTLE_S) -> str:
    """/metrics once it counts `expected_499` classify 499s or more (the server notices a
    closed connection a moment after the client closed it), or after `timeout_s`."""
    deadline = time.perf_counter() + timeout_s
    while True:
        text = await _scrape(url)
        count = by_labels(text, "multihead_requests_total").get("classify 499", 0.0)
        if count >= expected_499 or time.perf_counter() >= deadline:
            return text
        await asyncio.sleep(0.2)


def client_bots(bots: Sequence[str], patient: int, impatient: int) -> dict[str, str]:
    """{client label: bot}: "patient-i" on `bots[i]`, "impatient-j" on the bots after the
    patient clients', in turn (the scheduler shares the trunk by tenant, so bots shared by
    impatient clients change nothing but the heads they are scored by)."""
    out = {f"{PATIENT}-{i}": bots[i] for i in range(patient)}
    rest = list(bots[patient:]) or list(bots)
    out.update({f"{IMPATIENT}-{j}": rest[j % len(rest)] for j in range(impatient)})
    return out


def impatience_of(result: CancellationResult) -> Impatience:
    """The impatient clients of the run so far: from its median and the trunk time of
    `BATCH_SCENARIO`'s window (`bench.sections.impatience`). ValueError when either is
    missing."""
    base = result.runs.get(BATCH_SCENARIO) or {}
    return impatience(num(result.median_ms), num(base.get("server_trunk_ms")),
                      per_image_ms(base, "server_trunk_ms"), CLIENTS // 2)


def _load(context: Context, url: str, bots: list[str], scenario: Scenario,
          give_up: Impatience | None, cancels: bool) -> dict:
    """`scenario`'s load on the server at `url` (its impatient clients: `give_up`'s):
    `load_summary` and its warm-up."""
    plan = context.plan
    impatient = give_up.clients if scenario.impatient and give_up else 0
    timeout_s = give_up.timeout_s if impatient else None
    clients = client_bots(bots, scenario.patient, impatient)
    warmup_s = scenario.warmup_s if scenario.warmup_s is not None else plan.cancellation_warmup_s
    window_s = scenario.window_s if scenario.window_s is not None else plan.cancellation_s

    async def go() -> dict:
        before = await _scrape(url)
        data = await flood(url, context.jpegs, clients, dict.fromkeys(clients, 1),
                           warmup_s, window_s,
                           timeouts={t: timeout_s for t in clients if t.startswith(IMPATIENT)})
        # Every request given up on or abandoned at the end is a 499 on a server that cancels;
        # on one that does not, none is: read its counts as they are.
        base = by_labels(before, "multihead_requests_total").get("classify 499", 0.0)
        given_up = sum(1 for c in data["calls"] if gave_up(c))
        after = await _settled(url, base + given_up + data["unfinished"] if cancels else 0)
        return {**load_summary(data, {"before": before, "after": after}),
                "warmup_s": warmup_s}

    say(f"cancellation {scenario.name}: {scenario.patient} patient + {impatient} impatient "
        f"clients{'' if timeout_s is None else f' (timeout {timeout_s:.3f} s)'}, "
        f"{warmup_s:.0f} s warm-up + {window_s:.0f} s ...")
    return asyncio.run(go())


def run(context: Context) -> CancellationResult:
    plan = context.plan
    store, bots = context.bot_store("cancellation", CLIENTS)
    result = CancellationResult(image=context.image_summary(), clients=CLIENTS,
                                batch_size=plan.cancellation_batch_size,
                                warmup_s=plan.cancellation_warmup_s,
                                duration_s=plan.cancellation_s)
    server, server_name, facts, give_up = None, None, {}, None
    try:
        for scenario in SCENARIOS:
            spec = SERVERS[scenario.server]
            if scenario.impatient and give_up is None:
                # Without the trunk's time there is no timeout that means the same anywhere.
                context.record_error(f"cancellation-{scenario.name}", RuntimeError(
                    f"no impatient clients: no median from {MEDIAN_SCENARIO} or no trunk "
                    f"time from {BATCH_SCENARIO}"))
                continue
            if scenario.server != server_name:
                if server is not None:
                    server.stop(STOP_S)
                    server = None
                if spec.prepare is not None:
                    spec.prepare(context, store, bots)
                server = context.start(context.server(
                    f"cancellation-{scenario.server}", store,
                    **{**SERVER_OPTIONS, "max-batch-size": plan.cancellation_batch_size,
                       **spec.options}))
                server_name = scenario.server
                facts = {"ready_s": server.ready_s, "pid": server.pid,
                         "runtime": server.runtime(), "cancels": spec.cancels}
                asyncio.run(warm_up_batch(server.url, context.jpegs, bots[0],
                                          plan.cancellation_batch_size))
            try:
                summary = _load(context, server.url, bots, scenario, give_up, spec.cancels)
            except Exception as exc:  # noqa: BLE001 - the other scenarios are still worth it
                if scenario.name == MEDIAN_SCENARIO:
                    raise
                context.record_error(f"cancellation-{scenario.name}", exc)
                continue
            result.runs[scenario.name] = {"server": facts, **summary}
            if scenario.name == MEDIAN_SCENARIO:
                result.median_ms = summary[PATIENT]["p50_ms"]
            if scenario.name == BATCH_SCENARIO:
                try:
                    give_up = impatience_of(result)
                except ValueError as exc:
                    context.record_error("cancellation-impatience", exc)
                else:
                    result.batch_ms, result.image_ms = give_up.batch_ms, give_up.image_ms
                    result.impatient, result.timeout_s = give_up.clients, give_up.timeout_s
                    result.overload = give_up.overload
                    say(f"cancellation: {give_up.clients} impatient clients, timeout "
                        f"{1000 * give_up.timeout_s:.0f} ms (trunk {give_up.batch_ms:.0f} ms "
                        f"per batch, {give_up.image_ms:.1f} per image; median "
                        f"{give_up.median_ms:.0f} ms): {give_up.overload:.2f} x the trunk")
            p = summary.get(PATIENT) or {}
            say(f"cancellation {scenario.name}: patient {num(p.get('goodput')):.2f} "
                f"images/s, p50 {num(p.get('p50_ms')):.0f} ms; {summary['gave_up']} give-ups; "
                f"trunk images {fmt(summary.get('trunk_images'))} vs "
                f"{summary['answered_images']} answered; server "
                f"{_statuses(summary.get('server_statuses'))}")
    finally:
        if server is not None:
            server.stop(STOP_S)
    return result


# -- report -------------------------------------------------------------------------------------


def _statuses(counts: Mapping[str, int] | None) -> str:
    return ", ".join(f"{k}: {v}" for k, v in (counts or {}).items()) or "—"


def _ratio(value) -> str:
    return "—" if math.isnan(num(value)) else f"{num(value):.4f}"


def render(result: CancellationResult, results: Results) -> str:
    runtime = next((r["server"].get("runtime") for r in result.runs.values()
                    if r.get("server")), None) or "?"
    out = [f"## Clients that give up ({runtime}, {result.image}, feature cache off)", ""]
    out += [f"Closed-loop clients, one image per request, `--max-batch-size "
            f"{result.batch_size}`; {fmt(result.warmup_s)} s warm-up, then "
            f"{fmt(result.duration_s)} s measured (the one client: 2 s, then 10 s). The "
            f"clients giving up: {fmt(result.impatient)}, each after {fmt(result.timeout_s)} s "
            f"(a quarter of the server's trunk time per batch under {BATCH_SCENARIO}, "
            f"{fmt(result.batch_ms)} ms, and no less than the one client's median, "
            f"{fmt(result.median_ms)} ms), then at once sending their next request: they "
            f"abandon {fmt(result.overload)} × the rows the trunk runs a second "
            f"({fmt(result.image_ms)} ms per image). Images/s: the answered images of the "
            "requests sent in the window, per second of it (their latency: p50, p95); answered "
            "in the window: from the first trunk batch's answers to the last one's, "
            "everyone's:", ""]
    rows = []
    for scenario in SCENARIOS:
        run_ = result.runs.get(scenario.name)
        if not run_:
            continue
        p, i = run_.get(PATIENT) or {}, run_.get(IMPATIENT) or {}
        text = scenario.text.format(patient=p.get("clients", scenario.patient),
                                    impatient=i.get("clients", 0))
        rows.append([scenario.name, text, p.get("goodput"), p.get("p50_ms"),
                     p.get("p95_ms"), _statuses(p.get("statuses")),
                     i.get("gave_up") if i else "—", run_.get("total_images_per_s"),
                     run_.get("trunk_images"), run_.get("answered_images"),
                     run_.get("mean_batch_size"), run_.get("server_trunk_ms")])
    out += table(["scenario", "clients", "patient images/s", "patient p50 ms",
                  "patient p95 ms", "patient answers", "give-ups", "answered images/s",
                  "trunk images (server)", "answered images", "mean batch",
                  "server trunk ms/batch"], rows)
    rows = [[s.name, run_.get("gave_up"), run_.get("unfinished"),
             _statuses(run_.get("server_statuses"))]
            for s in SCENARIOS if (run_ := result.runs.get(s.name))]
    if rows:
        out += ["", "Over each whole load (warm-up, window and the answers still due): the "
                "clients' give-ups, their requests abandoned when the load stopped, and the "
                "server's classify requests by status:", ""]
        out += table(["scenario", "give-ups", "abandoned at the end", "server statuses"], rows)
    base, shadow = result.runs.get(SHADOW_BASE), result.runs.get("shadow")
    if base and shadow:
        cost = shadow_cost(base, shadow)
        out += ["", f"A shadow candidate on every bot (`shadow`) against none (`{SHADOW_BASE}`), "
                "16 patient clients: the answered images/s, the server's time per trunk image "
                "over the window (trunk, heads: all bots' live heads and their candidates) and "
                "the candidate images it counted (`multihead_candidate_images_total`) against "
                "its trunk images:", ""]
        rows = [[name, run_.get("total_images_per_s"), trunk, heads,
                 run_.get("candidate_images"), run_.get("trunk_images")]
                for name, run_, trunk, heads in (
                    (SHADOW_BASE, base, cost["trunk_ms"][0], cost["heads_ms"][0]),
                    ("shadow", shadow, cost["trunk_ms"][1], cost["heads_ms"][1]))]
        out += table(["scenario", "answered images/s", "server trunk ms/image",
                      "server heads ms/image", "candidate images", "trunk images"], rows)
        out += ["", f"With shadows ÷ without: clients' images/s {_ratio(cost['client_ratio'])}; "
                f"server time per image, the trunk as it ran with the shadows "
                f"{_ratio(cost['server_ratio'])} (the target's)."]
    out += [""]
    return "\n".join(out)


def targets(result: CancellationResult, results: Results) -> list[Target]:
    on, off = num(result.patient_goodput("cancel")), num(result.patient_goodput("no-cancel"))
    cancel = result.runs.get("cancel") or {}
    given_up = num(cancel.get("gave_up"))
    # No give-up at all: the disconnects were not exercised (NaN: FAIL).
    uncounted = ratio(uncounted_give_ups(cancel), given_up) if given_up else math.nan
    base, shadow = result.runs.get(SHADOW_BASE) or {}, result.runs.get("shadow") or {}
    cost = shadow_cost(base, shadow)
    return [
        Target.of("cancel_patient_goodput", "patient clients' images/s beside clients giving "
                  f"up, without cancellation <= {PATIENT_GOODPUT_WITHOUT} x with it",
                  ("cancellation",), ratio(off, on), PATIENT_GOODPUT_WITHOUT, "<=", "x",
                  note("{:.2f} without vs {:.2f} images/s with", off, on)
                  + note("; {:.0f} giving up after {:.0f} ms: {:.1f} × the trunk's rows",
                         result.impatient, 1000 * num(result.timeout_s), result.overload)),
        Target.of("cancel_499", "with cancellation, share of the clients' give-ups the "
                  "server did not count as 499", ("cancellation",), uncounted,
                  UNCOUNTED_GIVE_UPS, "<=", "",
                  note("{:.0f} give-ups, {:.0f} × 499", given_up,
                       num((cancel.get("server_statuses") or {}).get("499", 0)))),
        Target.of("shadow_cost", "16-client throughput with a shadow candidate on every bot "
                  "÷ without (server time per trunk image, trunk as it ran with the shadows)",
                  ("cancellation",), cost["server_ratio"], SHADOW_RATIO, ">=", "x",
                  note("heads {:.2f} vs {:.2f} ms/image, trunk {:.0f} ms/image; clients' "
                       "images/s {:.2f} vs {:.2f} ({:.3f})", cost["heads_ms"][1],
                       cost["heads_ms"][0], cost["trunk_ms"][1],
                       shadow.get("total_images_per_s"), base.get("total_images_per_s"),
                       cost["client_ratio"])),
        Target.of("shadow_scored", "the shadow candidates scored every row: candidate images "
                  "÷ trunk images over the shadow window", ("cancellation",), cost["scored"],
                  SHADOW_SCORED, ">=", "x",
                  note("{:.0f} candidate images, {:.0f} trunk images",
                       shadow.get("candidate_images"), shadow.get("trunk_images"))),
    ]


SECTION = Section("cancellation", CancellationResult, run, render, targets)
