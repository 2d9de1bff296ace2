"""Section `service`: a real `multihead serve` process on loopback, B bots (Zipf popularity),
real 640x480 JPEG uploads, closed-loop concurrency 1/4/16/32 and a Poisson open loop; then the
same load against a second server with `--batch-policy per_group`. Both run the serving choice:
`serve`'s defaults (runtime and precision auto), with the run's INT8 trunk where `serve` looks
for it (`bench.int8`), so the choice is int8 when that trunk passes its fidelity bounds. Then a
third server on TF fp32 (`--runtime tf --precision fp32`, cross-bot batching, the closed loops
only), unless TF fp32 is the serving choice.

Each choice's throughput and latency are compared with the raw trunk of the SAME runtime x
precision that server runs (as its /readyz reports it), at batch 1, 2, 4, ... up to the
server's max batch size: taken from the trunk section's table when it measured that runtime
at those sizes, else measured here, in this process, once the servers are stopped.

Whether the server keeps up with its trunk (issue 31, item 2): over every load point the
server process's CPU time and the bench process's own (the load client), per image served,
give the machine's bound (cores / CPU per image); the server's trunk time per batch is set
against the raw trunk's at the same batch size, and its CPU per image against the raw trunk's
(`bench.sections.service_cpu` has the arithmetic).
"""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from bench.context import Context, say
from bench.markdown import fmt, load_label, table
from bench.result import Result
from bench.sections.base import SKIP, Results, Section, Target, note
from bench.sections.service_cpu import against_raw, load_figures, needed_sizes
from bench.stats import cpu_seconds, num, ratio, usable_cores

POLICY_NAMES = {"mixed": "mixed (cross-bot)", "per_group": "per-bot"}
TF_FP32 = "tf-fp32"

# Targets of each serving choice at 16 clients (issue 31, item 2):
# the trunk's time per batch inside the server <= this x its time alone at the same batch size;
TRUNK_IN_SERVER_MAX = 1.15
# the server's CPU per served image less the raw trunk's <= this, in ms of one core;
REQUEST_PATH_CPU_MS = 6.0
# served images/s >= this x the machine's bound (cores / server and client CPU per image).
BOUND_SHARE = 0.9
# Target: at 1 client, the request path adds at most this to one batch-1 forward.
P50_OVER_FORWARD_MS = 10.0
TARGET_CLIENTS = 16


def closed_point(points: Sequence[Mapping], concurrency: int) -> Mapping:
    """The closed-loop point at `concurrency` clients among `points` ({} when not measured)."""
    for p in points:
        if p.get("mode") == "closed" and p.get("concurrency") == concurrency:
            return p
    return {}


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
    # batch1_forward_ms, source, sizes: [{batch_size, ms_per_batch, images_per_s,
    # cpu_ms_per_image}] at `needed_sizes(batch_size)`}.
    raw_trunk: dict | None = None
    # The same bots on a TF fp32 server (mixed policy, closed loops): {"server", "points",
    # "raw_trunk"} like a policy's entry plus its own raw trunk; {"same_as_serving_choice":
    # True} when the serving choice is TF fp32; {} when not measured.
    tf_fp32: dict = field(default_factory=dict)
    # The serving choice with API keys (`--auth keys`, every request with a key) at 16 clients
    # right after the mixed policy's points without keys: {"server", "point"}; {} when not run.
    auth: dict = field(default_factory=dict)

    def point(self, policy: str, concurrency: int) -> Mapping:
        """The closed-loop point of `policy` at `concurrency` clients ({} when not measured)."""
        return closed_point((self.policies.get(policy) or {}).get("points", []), concurrency)


Measure = Callable[[str, tuple[int, ...]], list[dict]]


def raw_trunk(name: str, batch_size: int, trunk, measure: Measure) -> dict:
    """The raw trunk `name` ("<runtime>-<precision>") at batch 1, 2, 4, ... up to
    `batch_size` (`needed_sizes`), with its CPU time per image at each: from the trunk
    section's result `trunk` when its table has every one of them for that runtime, else
    `measure(name, sizes)` -> batch table."""
    sizes = needed_sizes(batch_size)
    table_ = ((trunk.runtimes if trunk is not None else {}).get(name) or {}).get("batches", [])
    by_size = {b["batch_size"]: b for b in table_}
    source = "trunk section"
    if any(s not in by_size or by_size[s].get("cpu_ms_per_image") is None for s in sizes):
        by_size = {b["batch_size"]: b for b in measure(name, sizes)}
        source = "measured in the service section"
    return {"name": name, "batch_size": batch_size,
            "images_per_s": by_size[batch_size]["images_per_s"],
            "batch1_forward_ms": by_size[1]["median_s"] * 1000, "source": source,
            "sizes": [{"batch_size": s, "ms_per_batch": by_size[s]["median_s"] * 1000,
                       "images_per_s": by_size[s]["images_per_s"],
                       "cpu_ms_per_image": by_size[s].get("cpu_ms_per_image")} for s in sizes]}


def _measure_in_process(context: Context) -> Measure:
    def measure(name: str, sizes: tuple[int, ...]) -> list[dict]:
        from bench.sections.trunk import measure_runtime, preprocessed

        runtime, precision = name.split("-", 1)
        say(f"raw trunk on {name} for the service's comparison ...")
        return measure_runtime(context, runtime, precision, preprocessed(context, max(sizes)),
                               sizes)[0]

    return measure


async def warm_up(context: Context, url: str, bots: Sequence[str],
                  headers: dict[str, str] | None = None) -> None:
    """One concurrent burst (not measured): connections, thread pools, batch shapes."""
    from bench.load import Workload, closed_loop

    workload = Workload(context.jpegs, bots, context.plan.zipf_s, seed=context.plan.seed + 99)
    await closed_loop(url, workload, concurrency=min(16, context.plan.max_batch_size),
                      requests=0, headers=headers)


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
                         data: dict, result: ServiceResult, *, open_loop_too: bool = True,
                         label: str | None = None, pid: int | None = None) -> None:
    """The closed-loop points (`plan.concurrency`) and the open loop (unless not
    `open_loop_too`) of one server, appended to `data["points"]` with the server's own batch
    and timing histograms over each point, and the CPU time per image served of the server
    (process `pid`; not measured without) and of this process, the load's client
    (`service_cpu.load_figures`). `label` names the server in the progress lines (default:
    the policy)."""
    from bench.load import Workload, closed_loop, open_loop, scrape_metrics

    plan = context.plan
    label = label or policy
    loads: list[tuple[str, int]] = [("closed", c) for c in plan.concurrency]
    if open_loop_too:
        loads.append(("open", 0))
    for index, (mode, level) in enumerate(loads):
        workload = Workload(context.jpegs, bots, plan.zipf_s, seed=plan.seed + index)
        before, before_counts = await scrape_metrics(url)
        # CPU over the load only (not the scrapes): the server's, all threads, and ours.
        server_cpu = cpu_seconds(pid) if pid is not None else math.nan
        client_cpu = time.process_time()
        if mode == "closed":
            n = plan.closed_requests(level)
            with context.bar(n + level, f"{label} {level} client(s)") as bar:
                point = await closed_loop(url, workload, level, n, bar.update)
        else:
            rate = _poisson_rate(context, result, data)
            with context.bar(plan.poisson_requests, f"{label} Poisson {rate:.1f}/s") as bar:
                point = await open_loop(url, workload, rate, plan.poisson_requests,
                                        seed=plan.seed, progress=bar.update)
        client_cpu = time.process_time() - client_cpu
        server_cpu = (cpu_seconds(pid) if pid is not None else math.nan) - server_cpu
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
            # Whether the server keeps up with its trunk (`service_cpu`): the images its
            # trunk ran (cache off: every one served) and the CPU they cost.
            mean_batch=size.mean,
            trunk_ms_per_batch_in_server=server_mean_ms("multihead_trunk_seconds"),
            **load_figures(server_cpu, client_cpu, size.sum, usable_cores()),
        )
        data["points"].append(point)
        say(f"{label} {load_label(point)}: {point['throughput_images_per_s']:.2f} images/s, "
            f"p50 {point['p50_ms']:.0f} ms, p99 {point['p99_ms']:.0f} ms, mean batch "
            f"{point['mean_batch_size']:.2f} ({point['mean_batch_bots']:.2f} bots), "
            f"CPU per image: server {point['server_cpu_ms_per_image']:.1f} ms, client "
            f"{point['client_cpu_ms_per_image']:.1f} ms (bound "
            f"{point['machine_bound_images_per_s']:.1f} images/s), errors {point['errors']}")


def add_ratios(points: Sequence[dict], raw: dict) -> None:
    """Every load point's throughput as a share of the raw trunk `raw` at its largest batch
    (`ratio_to_trunk`), and its trunk time and CPU against the raw trunk's at the point's
    mean batch (`service_cpu.against_raw`)."""
    for point in points:
        point["ratio_to_trunk"] = ratio(point.get("throughput_images_per_s"),
                                        raw["images_per_s"])
        point.update(against_raw(point, raw))


def compare_with_raw_trunk(result: ServiceResult, raw: dict) -> None:
    """Records the serving choice's raw trunk and every load point of its servers as a share
    of it."""
    result.raw_trunk = raw
    for data in result.policies.values():
        add_ratios(data.get("points", []), raw)


def compare_tf_fp32_with_raw_trunk(result: ServiceResult, raw: dict) -> None:
    """Records the TF fp32 server's raw trunk (TF fp32) and its load points as shares of it."""
    result.tf_fp32["raw_trunk"] = raw
    add_ratios(result.tf_fp32.get("points", []), raw)


def _server_facts(server) -> dict:
    return {"ready_s": server.ready_s, "rss_bytes": server.rss_bytes(), "pid": server.pid,
            "runtime": server.runtime()}


def run(context: Context) -> ServiceResult:
    from bench.int8 import ensure_int8
    from service.core.settings import BATCH_POLICIES

    plan = context.plan
    store, bots = context.service_store()
    result = ServiceResult(bots=plan.bots, classes=plan.classes, zipf_s=plan.zipf_s,
                           image=context.image_summary())
    ensure_int8(context)  # where `serve` finds it: the serving choice is int8 when it passes
    runtime = None
    # Mixed first: the open-loop rate both policies face is taken from its throughput.
    for policy in sorted(BATCH_POLICIES, key=lambda p: p != "mixed"):
        server = context.start(context.server(f"service-{policy}", store, **{
            "batch-policy": policy, "feature-cache-size": 0}))
        try:
            runtime = runtime or server.runtime()
            data = {"server": _server_facts(server), "points": []}
            result.policies[policy] = data
            asyncio.run(warm_up(context, server.url, bots))
            try:
                asyncio.run(measure_points(context, server.url, bots, policy, data, result,
                                           pid=server.pid))
            except Exception as exc:  # noqa: BLE001 - the other policy is still worth measuring
                context.record_error(f"service-{policy}", exc)
            data["server"]["rss_bytes_end"] = server.rss_bytes()
        finally:
            server.stop()
    if result.policies.get("mixed", {}).get("points"):
        _run_with_keys(context, store, bots, result)
    if runtime == TF_FP32:
        result.tf_fp32 = {"same_as_serving_choice": True}
    elif runtime is not None:
        _run_tf_fp32(context, store, bots, result)
    # The servers are stopped: a raw trunk measured now has the machine to itself.
    trunk, measure = context.results.get("trunk"), _measure_in_process(context)
    try:
        compare_with_raw_trunk(result, raw_trunk(runtime, plan.max_batch_size, trunk, measure))
    except Exception as exc:  # noqa: BLE001 - keep the load points; the targets say "not measured"
        context.record_error("service-raw-trunk", exc)
    if result.tf_fp32.get("points"):
        try:
            compare_tf_fp32_with_raw_trunk(
                result, raw_trunk(TF_FP32, plan.max_batch_size, trunk, measure))
        except Exception as exc:  # noqa: BLE001 - as above
            context.record_error("service-tf-fp32-raw-trunk", exc)
    return result


AUTH_CONCURRENCY = 16
AUTH_COST_MAX = 0.02  # the share of the 16-client throughput checking keys may cost
AUTH_ROUNDS, AUTH_CALLS = 10, 2_000  # key checks timed: rounds of calls, keys and none alternating


def _run_with_keys(context: Context, store, bots: Sequence[str], result: ServiceResult) -> None:
    """The mixed policy's 16-client closed loop again on a server with `--auth keys`, every
    request carrying an API key of the bots' tenant: what checking keys costs."""
    from bench.load import Workload, closed_loop
    from store import HeadStore

    with HeadStore(store) as heads:
        _, token = heads.add_key("default", "infer")
    headers = {"Authorization": f"Bearer {token}"}
    server = context.start(context.server("service-keys", store, **{
        "batch-policy": "mixed", "feature-cache-size": 0, "auth": "keys"}))
    try:
        result.auth = {"server": _server_facts(server)}
        asyncio.run(warm_up(context, server.url, bots, headers))
        plan = context.plan
        workload = Workload(context.jpegs, bots, plan.zipf_s, seed=plan.seed)
        n = plan.closed_requests(AUTH_CONCURRENCY)
        try:
            with context.bar(n + AUTH_CONCURRENCY, "keys 16 client(s)") as bar:
                point = asyncio.run(closed_loop(server.url, workload, AUTH_CONCURRENCY, n,
                                                bar.update, headers=headers))
            result.auth["point"] = point
            say(f"with API keys {load_label(point)}: "
                f"{point['throughput_images_per_s']:.2f} images/s, errors {point['errors']}")
        except Exception as exc:  # noqa: BLE001 - the other points stand
            context.record_error("service-keys", exc)
    finally:
        server.stop()
    try:
        result.auth["key_check_s"] = key_check_seconds(store, token)
        say(f"checking an API key: {result.auth['key_check_s'] * 1e6:.1f} us per request")
    except Exception as exc:  # noqa: BLE001 - the other points stand
        context.record_error("service-key-check", exc)


def key_check_seconds(store, token: str) -> float:
    """Seconds per request that checking an API key adds to the request path: the serving
    code's `Service.caller` (where every transport reads a call's credential) on the run's
    store, with `--auth keys` and the key, minus with `--auth none` and no header; the median
    of AUTH_ROUNDS rounds of AUTH_CALLS calls each, the two alternating.

    NOTE: timed here, not end to end: the two 16-client loads (with and without keys) differ
    by this machine's run-to-run spread (+-10 % on 2 cores, about 6 batches a load), far more
    than a key check can cost; the loads' images/s stay in the report."""
    from service.core.auth import INFER
    from service.core.service import Service
    from service.core.settings import Settings
    from store import HeadStore

    def per_call(service, authorization) -> float:
        start = time.perf_counter()
        for _ in range(AUTH_CALLS):
            service.caller(authorization, INFER)
        return (time.perf_counter() - start) / AUTH_CALLS

    with HeadStore(store) as heads:
        services = {mode: Service(Settings(store=str(store), auth=mode, warmup=False),
                                  store=heads) for mode in ("keys", "none")}
        try:
            rounds = [per_call(services["keys"], f"Bearer {token}")
                      - per_call(services["none"], None) for _ in range(AUTH_ROUNDS)]
        finally:
            for service in services.values():
                asyncio.run(service.close())
    return max(0.0, statistics.median(rounds))


def auth_cost(service: ServiceResult) -> float:
    """The share of the 16-client images/s that checking keys costs at most: the seconds a
    key check adds to a request (`key_check_seconds`, one image per request) times the images
    per second of the 16-client point without keys (as if every check ran alone on the one
    event loop), nan when either is missing."""
    check_s = num(service.auth.get("key_check_s"))
    without = num(service.point("mixed", AUTH_CONCURRENCY).get("throughput_images_per_s"))
    return check_s * without if without > 0 else math.nan  # NaN stays NaN


def _run_tf_fp32(context: Context, store, bots: Sequence[str], result: ServiceResult) -> None:
    """The same bots and closed loops on a TF fp32 server (mixed policy, no open loop)."""
    server = context.start(context.server("service-tf-fp32", store, **{
        "batch-policy": "mixed", "feature-cache-size": 0, "runtime": "tf",
        "precision": "fp32"}))
    try:
        result.tf_fp32 = {"server": _server_facts(server), "points": []}
        asyncio.run(warm_up(context, server.url, bots))
        try:
            asyncio.run(measure_points(context, server.url, bots, "mixed", result.tf_fp32,
                                       result, open_loop_too=False, label=TF_FP32,
                                       pid=server.pid))
        except Exception as exc:  # noqa: BLE001 - the serving choice's points stand
            context.record_error("service-tf-fp32", exc)
        result.tf_fp32["server"]["rss_bytes_end"] = server.rss_bytes()
    finally:
        server.stop()


def _runs(service: ServiceResult) -> list[tuple[str, str, dict]]:
    """(server's runtime-precision, policy, data) of every server of the section, the serving
    choice's first."""
    runs = [((data.get("server") or {}).get("runtime", "?"), policy, data)
            for policy, data in service.policies.items()]
    if service.tf_fp32.get("points") is not None:
        runs.append((TF_FP32, "mixed", service.tf_fp32))
    return runs


def _choices(service: ServiceResult) -> list[tuple[str, dict, dict]]:
    """(label, points, raw trunk) of each serving choice measured: `serve`'s defaults, then TF
    fp32."""
    raw = service.raw_trunk or {}
    out = [(f"serve's defaults ({raw.get('name', '?')})",
            (service.policies.get("mixed") or {}).get("points", []), raw)]
    if service.tf_fp32.get("points") is not None:
        out.append((f"--runtime tf --precision fp32 ({TF_FP32})", service.tf_fp32["points"],
                    service.tf_fp32.get("raw_trunk") or {}))
    return out


def render(service: ServiceResult, results: Results) -> str:
    raw = service.raw_trunk or {}
    out = [f"## Service over HTTP ({service.bots} bots, Zipf s={fmt(service.zipf_s)}, "
           f"{service.image}, feature cache off)", ""]
    rows = []
    for server, policy, data in _runs(service):
        for p in data.get("points", []):
            rows.append([server, POLICY_NAMES.get(policy, policy), load_label(p),
                         p.get("requests"), p.get("throughput_images_per_s"),
                         p.get("ratio_to_trunk"), p.get("p50_ms"), p.get("p95_ms"),
                         p.get("p99_ms"), p.get("mean_batch_size"), p.get("mean_batch_bots"),
                         p.get("errors")])
    out += table(["server", "policy", "load", "requests", "images/s", "× raw trunk", "p50 ms",
                  "p95 ms", "p99 ms", "mean batch", "bots/batch", "errors"], rows)
    if raw:
        out += ["", "× raw trunk: images/s over the raw trunk of the runtime × precision that "
                    "server runs, at its max batch size."]
    rows = []
    for label, points, choice_raw in _choices(service):
        c16, c1 = closed_point(points, 16), closed_point(points, 1)
        rows.append([label, choice_raw.get("images_per_s"), c16.get("throughput_images_per_s"),
                     c16.get("ratio_to_trunk"), choice_raw.get("batch1_forward_ms"),
                     c1.get("p50_ms"), choice_raw.get("source")])
    if service.policies:
        out += ["", "Each serving choice against its own raw trunk (mixed policy; target: "
                f"p50 at 1 client ≤ raw batch-1 forward + {P50_OVER_FORWARD_MS:.0f} ms):", ""]
        out += table(["serving choice", f"raw images/s at batch {raw.get('batch_size', 16)}",
                      "16 clients images/s", "× raw", "raw batch-1 forward ms",
                      "1 client p50 ms", "raw trunk from"], rows)
        out += keeps_up_text(service)
    if service.tf_fp32.get("same_as_serving_choice"):
        out += ["", "The serving choice is TF fp32: no second server."]
    parts = [("request", "request (server)"), ("decode", "decode per image"),
             ("queue_wait", "queue wait per image"), ("trunk_per_batch", "trunk per batch"),
             ("heads_per_batch", "heads per batch")]
    rows = []
    for server, policy, data in _runs(service):
        for p in data.get("points", []):
            server_ms = p.get("server_ms") or {}
            if server_ms:
                rows.append([server, POLICY_NAMES.get(policy, policy), load_label(p),
                             p.get("p50_ms"), p.get("mean_ms")]
                            + [server_ms.get(k) for k, _ in parts])
    if rows:
        out += ["", "Where the time goes: client-side latency against the server's own "
                "histograms (means over the load point, ms):", ""]
        out += table(["server", "policy", "load", "client p50", "client mean"]
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
    starts = [f"{server} {POLICY_NAMES.get(policy, policy)} "
              f"{fmt((data.get('server') or {}).get('ready_s'))} s"
              for server, policy, data in _runs(service)]
    out += ["", "Server start to ready: " + ", ".join(starts) + " (the servers of a run "
            "share one saved trunk graph, so only the first builds it; cold starts are "
            "measured on their own below).", ""]
    return "\n".join(out)


def keeps_up_text(service: ServiceResult) -> list[str]:
    """Markdown lines: per serving choice, its closed-loop points against the machine's bound
    and its raw trunk at the same batch size (`service_cpu`)."""
    out = ["", "Does the server keep up with its trunk? Per serving choice (mixed policy), "
           "each closed loop: images/s served against the machine's bound (cores ÷ the "
           "server's and the client's CPU per image; the client is this process, on the "
           "same cores), the trunk's ms per batch inside the server (its `/metrics`) against "
           "the raw trunk's alone at the same mean batch (linear between the measured "
           "sizes), and the CPU per image split: the raw trunk's, the request path's (the "
           "server's less the trunk's), the client's. Targets at "
           f"{TARGET_CLIENTS} clients: served ≥ {BOUND_SHARE:.2f} × bound, trunk in server "
           f"≤ {TRUNK_IN_SERVER_MAX:.2f} × alone, request path ≤ {REQUEST_PATH_CPU_MS:.0f} ms."]
    for label, points, raw in _choices(service):
        rows = []
        for p in points:
            if p.get("mode") != "closed":
                continue
            fig = against_raw(p, raw)
            rows.append([load_label(p), p.get("throughput_images_per_s"),
                         p.get("machine_bound_images_per_s"), fig["bound_ratio"],
                         p.get("mean_batch", p.get("mean_batch_size")),
                         p.get("trunk_ms_per_batch_in_server"),
                         fig["trunk_ms_alone_at_mean_batch"], fig["trunk_in_server_ratio"],
                         p.get("server_cpu_ms_per_image"), fig["raw_trunk_cpu_ms_per_image"],
                         fig["request_path_cpu_ms_per_image"],
                         p.get("client_cpu_ms_per_image")])
        if rows:
            out += ["", f"{label}, {(points[0] or {}).get('cores', '?')} cores:", ""]
            out += table(["load", "served images/s", "bound images/s", "× bound",
                          "mean batch", "trunk ms/batch in server", "alone", "× alone",
                          "server CPU ms/image", "trunk CPU", "request path CPU",
                          "client CPU"], rows)
    return out


def choice_targets(key: str, who: str, points: Sequence[Mapping], raw: Mapping,
                   skip: str = "") -> list[Target]:
    """The targets of one serving choice against its own raw trunk `raw` (`key` prefixes their
    keys; SKIP with `skip` as the note): at 16 clients, the trunk's time per batch in the
    server against alone at the same batch, the request path's CPU per image, images/s
    against the machine's bound; at 1 client, p50 against one batch-1 forward."""
    name = raw.get("name", "?")
    forward_ms = num(raw.get("batch1_forward_ms"))
    c16, c1 = closed_point(points, TARGET_CLIENTS), closed_point(points, 1)
    fig = against_raw(c16, raw) if c16 else {}
    batch = num(c16.get("mean_batch", c16.get("mean_batch_size")))
    at = f"{TARGET_CLIENTS} clients"
    out = [
        Target.of(f"{key}_trunk_in_server_c16",
                  f"{who} trunk time per batch in the server at {at} <= "
                  f"{TRUNK_IN_SERVER_MAX:.2f} x the raw {name} trunk's alone at the same "
                  f"batch size", ("service",), fig.get("trunk_in_server_ratio"),
                  TRUNK_IN_SERVER_MAX, "<=", "x",
                  note("{:.0f} vs {:.0f} ms per batch of {:.2f}",
                       c16.get("trunk_ms_per_batch_in_server"),
                       fig.get("trunk_ms_alone_at_mean_batch"), batch)),
        Target.of(f"{key}_request_path_cpu_c16",
                  f"{who} server CPU per served image at {at} less the raw {name} trunk's "
                  f"at the same batch size <= {REQUEST_PATH_CPU_MS:.0f} ms",
                  ("service",), fig.get("request_path_cpu_ms_per_image"),
                  REQUEST_PATH_CPU_MS, "<=", "ms",
                  note("server {:.1f} - trunk {:.1f} ms of CPU per image",
                       c16.get("server_cpu_ms_per_image"),
                       fig.get("raw_trunk_cpu_ms_per_image"))),
        Target.of(f"{key}_p50_c1",
                  f"{who} p50 at 1 client <= its raw batch-1 forward + "
                  f"{P50_OVER_FORWARD_MS:.0f} ms", ("service",), c1.get("p50_ms"),
                  forward_ms + P50_OVER_FORWARD_MS, "<=", "ms",
                  note(f"raw {name} batch-1 forward {{:.1f}} ms", forward_ms)),
        Target.of(f"{key}_bound_c16",
                  f"{who} images/s at {at} >= {BOUND_SHARE:.2f} x the machine's bound "
                  "(cores / server and client CPU per image)", ("service",),
                  fig.get("bound_ratio"), BOUND_SHARE, ">=", "x",
                  note("{:.2f} of {:.2f} images/s ({:.0f} cores / {:.1f} + {:.1f} ms of CPU "
                       "per image)", c16.get("throughput_images_per_s"),
                       c16.get("machine_bound_images_per_s"), c16.get("cores"),
                       c16.get("server_cpu_ms_per_image"),
                       c16.get("client_cpu_ms_per_image"))),
    ]
    return [replace(t, status=SKIP, note=skip) for t in out] if skip else out


def targets(service: ServiceResult, results: Results) -> list[Target]:
    mixed_batch = num(service.point("mixed", 16).get("mean_batch_size"))
    pg_batch = num(service.point("per_group", 16).get("mean_batch_size"))
    tf = service.tf_fp32 or {}
    return [
        *choice_targets("service", "service (serve's defaults)",
                        (service.policies.get("mixed") or {}).get("points", []),
                        service.raw_trunk or {}),
        *choice_targets("service_tf_fp32", "service on TF fp32", tf.get("points", []),
                        tf.get("raw_trunk") or {},
                        "the serving choice is TF fp32 (the targets above)"
                        if tf.get("same_as_serving_choice") else ""),
        Target.of("auth_cost", f"checking API keys costs <= {AUTH_COST_MAX:.0%} of the "
                  "16-client images/s (a key check's time x images/s without keys)",
                  ("service",), auth_cost(service), AUTH_COST_MAX, "<=", "",
                  note("{:.1f} us per request; 16 clients with keys end to end {:.2f} images/s",
                       num(service.auth.get("key_check_s")) * 1e6,
                       num((service.auth.get("point") or {}).get("throughput_images_per_s")))),
        Target.of("batch_mixing", "mean batch at 16 clients, 100 Zipf bots >= 3 x per-bot "
                  "policy's", ("service",), ratio(mixed_batch, pg_batch), 3.0, ">=", "x",
                  note("mixed {:.2f} vs per-bot {:.2f} rows/batch", mixed_batch, pg_batch)),
    ]


SECTION = Section("service", ServiceResult, run, render, targets)
