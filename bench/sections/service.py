"""Section `service`: a real `multihead serve` process on loopback, B bots (Zipf popularity),
real 640x480 JPEG uploads, closed-loop concurrency 1/4/16/32 and a Poisson open loop; then the
same load against a second server with `--batch-policy per_group`.

Its throughput and latency are compared with the raw trunk of the SAME runtime x precision the
server runs (as its /readyz reports it), at the server's max batch size and at batch 1: taken
from the trunk section's table when it measured that runtime, else measured here, in this
process, once the servers are stopped.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from bench.context import Context, say
from bench.markdown import fmt, load_label, table
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.stats import num, ratio

POLICY_NAMES = {"mixed": "mixed (cross-bot)", "per_group": "per-bot"}

# Target: the request path costs at most 15 % of the raw trunk's throughput at full batches.
THROUGHPUT_SHARE = 0.85
# Target: at 1 client, the request path adds at most this to one batch-1 forward.
P50_OVER_FORWARD_MS = 25.0


@dataclass
class ServiceResult(Result):
    bots: int | None = None
    classes: int | None = None
    zipf_s: float | None = None
    image: str = ""
    # policy -> {"server": {ready_s, rss_bytes, pid, runtime, rss_bytes_end}, "points": [...]}
    policies: dict[str, dict] = field(default_factory=dict)
    poisson_rate_per_s: float | None = None
    # The raw trunk of the servers' runtime x precision: {name, batch_size, images_per_s,
    # batch1_forward_ms, source}.
    raw_trunk: dict | None = None

    def point(self, policy: str, concurrency: int) -> Mapping:
        """The closed-loop point of `policy` at `concurrency` clients ({} when not measured)."""
        for p in (self.policies.get(policy) or {}).get("points", []):
            if p.get("mode") == "closed" and p.get("concurrency") == concurrency:
                return p
        return {}


Measure = Callable[[str, tuple[int, ...]], list[dict]]


def raw_trunk(name: str, batch_size: int, trunk, measure: Measure) -> dict:
    """The raw trunk `name` ("<runtime>-<precision>") at `batch_size` and at batch 1: from the
    trunk section's result `trunk` when its table has both sizes for that runtime, else
    `measure(name, (1, batch_size))` -> batch table."""
    table_ = ((trunk.runtimes if trunk is not None else {}).get(name) or {}).get("batches", [])
    by_size = {b["batch_size"]: b for b in table_}
    source = "trunk section"
    if 1 not in by_size or batch_size not in by_size:
        by_size = {b["batch_size"]: b for b in measure(name, (1, batch_size))}
        source = "measured in the service section"
    return {"name": name, "batch_size": batch_size,
            "images_per_s": by_size[batch_size]["images_per_s"],
            "batch1_forward_ms": by_size[1]["median_s"] * 1000, "source": source}


def _measure_in_process(context: Context) -> Measure:
    def measure(name: str, sizes: tuple[int, ...]) -> list[dict]:
        from bench.sections.trunk import measure_runtime, preprocessed

        runtime, precision = name.split("-", 1)
        say(f"raw trunk on {name} for the service's comparison ...")
        return measure_runtime(context, runtime, precision, preprocessed(context, max(sizes)),
                               sizes)[0]

    return measure


async def warm_up(context: Context, url: str, bots: Sequence[str]) -> None:
    """One concurrent burst (not measured): connections, thread pools, batch shapes."""
    from bench.load import Workload, closed_loop

    workload = Workload(context.jpegs, bots, context.plan.zipf_s, seed=context.plan.seed + 99)
    await closed_loop(url, workload, concurrency=min(16, context.plan.max_batch_size),
                      requests=0)


def _poisson_rate(context: Context, result: ServiceResult, data: dict) -> float:
    """The open-loop rate: given, or 70 % of the mixed policy's 16-client (else best closed)
    throughput, so that both policies face the same arrivals."""
    if context.plan.poisson_rate:
        return context.plan.poisson_rate
    if result.poisson_rate_per_s:
        return result.poisson_rate_per_s
    closed = [p for p in data["points"] if p.get("mode") == "closed"
              and not math.isnan(p.get("throughput_images_per_s", math.nan))]
    c16 = [p for p in closed if p["concurrency"] == 16]
    basis = (c16 or sorted(closed, key=lambda p: -p["throughput_images_per_s"]) or [None])[0]
    if basis is not None:
        rate = 0.7 * basis["throughput_images_per_s"]
    else:
        trunk = context.results.get("trunk")
        rate = 0.7 * (getattr(trunk, "best_images_per_s", None) or 5.0)
    result.poisson_rate_per_s = round(max(rate, 0.5), 2)
    return result.poisson_rate_per_s


async def measure_points(context: Context, url: str, bots: Sequence[str], policy: str,
                         data: dict, result: ServiceResult) -> None:
    """The closed-loop points and the open loop of one server, appended to `data["points"]`
    with the server's own batch and timing histograms over each point."""
    from bench.load import Workload, closed_loop, open_loop, scrape_metrics

    plan = context.plan
    loads: list[tuple[str, int]] = [("closed", c) for c in plan.concurrency]
    loads.append(("open", 0))
    for index, (mode, level) in enumerate(loads):
        workload = Workload(context.jpegs, bots, plan.zipf_s, seed=plan.seed + index)
        before, before_counts = await scrape_metrics(url)
        if mode == "closed":
            n = plan.closed_requests(level)
            with context.bar(n + level, f"{policy} {level} client(s)") as bar:
                point = await closed_loop(url, workload, level, n, bar.update)
        else:
            rate = _poisson_rate(context, result, data)
            with context.bar(plan.poisson_requests, f"{policy} Poisson {rate:.1f}/s") as bar:
                point = await open_loop(url, workload, rate, plan.poisson_requests,
                                        seed=plan.seed, progress=bar.update)
        after, after_counts = await scrape_metrics(url)
        hits = "multihead_feature_cache_hits_total"
        size = after["multihead_batch_size"].minus(before.get("multihead_batch_size"))
        groups = after["multihead_batch_bots"].minus(before.get("multihead_batch_bots"))

        def server_mean_ms(name: str, after=after, before=before) -> float:
            if name not in after:
                return math.nan
            return 1000.0 * after[name].minus(before.get(name)).mean

        point.update(
            policy=policy,
            batches=size.count,
            mean_batch_size=size.mean,
            mean_batch_bots=groups.mean,
            batch_size_distribution=size.distribution(),
            batch_bots_distribution=groups.distribution(),
            # Must stay 0: every request's image has to go through the trunk.
            feature_cache_hits=after_counts.get(hits, 0) - before_counts.get(hits, 0),
            # Where the time goes, from the server's own histograms (means).
            server_ms={
                "request": server_mean_ms(
                    "multihead_request_seconds{route=classify}"),
                "decode": server_mean_ms("multihead_decode_seconds"),
                "queue_wait": server_mean_ms("multihead_queue_wait_seconds"),
                "trunk_per_batch": server_mean_ms("multihead_trunk_seconds"),
                "heads_per_batch": server_mean_ms("multihead_heads_seconds"),
            },
        )
        data["points"].append(point)
        say(f"{policy} {load_label(point)}: {point['throughput_images_per_s']:.2f} images/s, "
            f"p50 {point['p50_ms']:.0f} ms, p99 {point['p99_ms']:.0f} ms, mean batch "
            f"{point['mean_batch_size']:.2f} ({point['mean_batch_bots']:.2f} bots), "
            f"errors {point['errors']}")


def compare_with_raw_trunk(result: ServiceResult, raw: dict) -> None:
    """Records the raw trunk and every load point's throughput as a share of it."""
    result.raw_trunk = raw
    for data in result.policies.values():
        for point in data.get("points", []):
            point["ratio_to_trunk"] = ratio(point.get("throughput_images_per_s"),
                                            raw["images_per_s"])


def run(context: Context) -> ServiceResult:
    from service.core.settings import BATCH_POLICIES

    plan = context.plan
    store, bots = context.service_store()
    result = ServiceResult(bots=plan.bots, classes=plan.classes, zipf_s=plan.zipf_s,
                           image=context.image_summary())
    runtime = None
    # Mixed first: the open-loop rate both policies face is taken from its throughput.
    for policy in sorted(BATCH_POLICIES, key=lambda p: p != "mixed"):
        server = context.start(context.server(f"service-{policy}", store, **{
            "batch-policy": policy, "feature-cache-size": 0}))
        try:
            runtime = runtime or server.runtime()
            data = {"server": {"ready_s": server.ready_s, "rss_bytes": server.rss_bytes(),
                               "pid": server.pid, "runtime": server.runtime()}, "points": []}
            result.policies[policy] = data
            asyncio.run(warm_up(context, server.url, bots))
            try:
                asyncio.run(measure_points(context, server.url, bots, policy, data, result))
            except Exception as exc:  # noqa: BLE001 - the other policy is still worth measuring
                context.record_error(f"service-{policy}", exc)
            data["server"]["rss_bytes_end"] = server.rss_bytes()
        finally:
            server.stop()
    # The servers are stopped: a raw trunk measured now has the machine to itself.
    try:
        compare_with_raw_trunk(result, raw_trunk(runtime, plan.max_batch_size,
                                                 context.results.get("trunk"),
                                                 _measure_in_process(context)))
    except Exception as exc:  # noqa: BLE001 - keep the load points; the targets say "not measured"
        context.record_error("service-raw-trunk", exc)
    return result


def render(service: ServiceResult, results: Results) -> str:
    raw = service.raw_trunk or {}
    out = [f"## Service over HTTP ({service.bots} bots, Zipf s={fmt(service.zipf_s)}, "
           f"{service.image}, feature cache off)", ""]
    rows = []
    for policy, data in service.policies.items():
        for p in data.get("points", []):
            rows.append([POLICY_NAMES.get(policy, policy), load_label(p), p.get("requests"),
                         p.get("throughput_images_per_s"), p.get("ratio_to_trunk"),
                         p.get("p50_ms"), p.get("p95_ms"), p.get("p99_ms"),
                         p.get("mean_batch_size"), p.get("mean_batch_bots"), p.get("errors")])
    out += table(["policy", "load", "requests", "images/s", "× raw trunk", "p50 ms", "p95 ms",
                  "p99 ms", "mean batch", "bots/batch", "errors"], rows)
    if raw:
        out += ["", f"The servers run the {raw.get('name')} trunk; × raw trunk: images/s over "
                    f"that raw trunk's {fmt(raw.get('images_per_s'))} images/s at batch "
                    f"{raw.get('batch_size')} (batch-1 forward "
                    f"{fmt(raw.get('batch1_forward_ms'))} ms; {raw.get('source')})."]
    parts = [("request", "request (server)"), ("decode", "decode per image"),
             ("queue_wait", "queue wait per image"), ("trunk_per_batch", "trunk per batch"),
             ("heads_per_batch", "heads per batch")]
    rows = []
    for policy, data in service.policies.items():
        for p in data.get("points", []):
            server_ms = p.get("server_ms") or {}
            if server_ms:
                rows.append([POLICY_NAMES.get(policy, policy), load_label(p), p.get("p50_ms"),
                             p.get("mean_ms")] + [server_ms.get(k) for k, _ in parts])
    if rows:
        out += ["", "Where the time goes: client-side latency against the server's own "
                "histograms (means over the load point, ms):", ""]
        out += table(["policy", "load", "client p50", "client mean"]
                     + [label for _, label in parts], rows)
    dist_rows, keys = [], []
    for policy in service.policies:
        dist = service.point(policy, 16).get("batch_size_distribution")
        if dist is not None:
            keys = keys or [k for k in dist if k != "all"]
            dist_rows.append([POLICY_NAMES.get(policy, policy)] + [dist.get(k, 0) for k in keys])
    if dist_rows:
        out += ["", "Batches by size at 16 clients (from the server's "
                "`multihead_batch_size` histogram):", ""]
        out += table(["policy"] + [f"{k} rows" for k in keys], dist_rows)
    starts = [f"{POLICY_NAMES.get(k, k)} {fmt(v.get('server', {}).get('ready_s'))} s"
              for k, v in service.policies.items()]
    out += ["", "Server start to ready: " + ", ".join(starts) + " (the servers of a run "
            "share one saved trunk graph, so only the first builds it; cold starts are "
            "measured on their own below).", ""]
    return "\n".join(out)


def targets(service: ServiceResult, results: Results) -> list[Target]:
    raw = service.raw_trunk or {}
    name, batch = raw.get("name", "?"), raw.get("batch_size", 16)
    raw_rate, forward_ms = num(raw.get("images_per_s")), num(raw.get("batch1_forward_ms"))
    c16, c1 = service.point("mixed", 16), service.point("mixed", 1)
    mixed_batch = num(c16.get("mean_batch_size"))
    pg_batch = num(service.point("per_group", 16).get("mean_batch_size"))
    return [
        Target.of("service_throughput_c16",
                  f"service images/s at 16 clients >= {THROUGHPUT_SHARE:.2f} x its raw trunk "
                  f"at batch {batch}", ("service",), c16.get("throughput_images_per_s"),
                  THROUGHPUT_SHARE * raw_rate, ">=", "images/s",
                  note(f"raw {name} trunk {{:.2f}} images/s", raw_rate)),
        Target.of("service_p50_c1",
                  f"service p50 at 1 client <= its raw batch-1 forward + "
                  f"{P50_OVER_FORWARD_MS:.0f} ms", ("service",), c1.get("p50_ms"),
                  forward_ms + P50_OVER_FORWARD_MS, "<=", "ms",
                  note(f"raw {name} batch-1 forward {{:.1f}} ms", forward_ms)),
        Target.of("batch_mixing", "mean batch at 16 clients, 100 Zipf bots >= 3 x per-bot "
                  "policy's", ("service",), ratio(mixed_batch, pg_batch), 3.0, ">=", "x",
                  note("mixed {:.2f} vs per-bot {:.2f} rows/batch", mixed_batch, pg_batch)),
    ]


SECTION = Section("service", ServiceResult, run, render, targets)
