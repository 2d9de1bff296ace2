"""The benchmark run: the shared-trunk design against the naive ones, measured in ONE run.

Sections (`--sections`, all by default; they run in this order):

    trunk      raw trunk images/s at batch 1..16 in this process; float32 matmul GFLOP/s
               through TensorFlow -> the machine's ceiling in images/s; trunk efficiency
    service    a real `multihead serve` process on loopback, B bots (Zipf popularity), real
               640x480 JPEG uploads, closed-loop concurrency 1/4/16/32 and a Poisson open loop;
               then the same load against a second server with `--batch-policy per_group`
    fanout     one image scored by 1 bot vs by 10 bots in one `POST /classify?bots=...`
    grpc       one server with --grpc-port: REST /classify vs KServe v2 ModelInfer vs TF Serving
               Predict, latency at 1 client and images/s at 16 (in `bench.grpc_load`)
    scale      10..10,000 registered heads: registration time, server RSS per resident head,
               first request to a cold bot vs a warm one
    coldstart  `multihead serve` process start to /readyz 200 (with and without a saved graph,
               when the backbone offers one)
    baselines  rebuild graph + restore per request; K full models (one Trunk per bot)
    overload   N concurrent 10 MB uploads: server RSS start/peak/after, refused vs answered
    soak       minutes of mixed valid and hostile traffic: server RSS must stay flat
               (both in `bench.hardening`)

Writes `<output>/bench.json`, `bench.md` (the tables, dated, with the machine) and `bench.png`
(latency vs throughput of the service load points, mixed vs per-bot batching), plus one log per
server process. `--check` prints every target of issue 6 with its measured value and exits 1
when one is missed. The flags and the command are in `bench.cli` (`multihead bench ...` or
`python -m bench ...`); this module is the run itself.

Everything is real: the real Inception-V4 trunk (a seeded random checkpoint in the official
layout unless `--trunk-checkpoint` is given; random weights cost exactly what the real ones do),
real server processes, real HTTP, real JPEG decoding. Nothing heavy is imported at module
level (`backbone` without TensorFlow, numpy): `multihead --help` imports this module.
"""
from __future__ import annotations

import asyncio
import gc
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from backbone import FEATURE_DIM
from bench.report import write_reports
from bench.stats import machine_facts, ratio, rss_bytes, summarize

# Cost of one 299x299 image through Inception-V4 up to PreLogitsFlatten (the trunk), in FLOPs
# (1 multiply-add = 2 FLOPs): `flops_per_image.to_PreLogitsFlatten` of the shared contract
# (/work/shared/inception_v4_contract.json, TF profiler float_operation count on the official
# graph; = 12,274,991,520 multiply-adds, 99.8 % of it Conv2D). A copy, because the benchmark
# is installed without the tests' data; tests/bench checks it against the contract file.
FLOPS_PER_IMAGE = 24_549_983_040

SECTIONS = ("trunk", "service", "fanout", "grpc", "scale", "coldstart", "baselines",
            "overload", "soak", "replicas")
MIB = 1024 * 1024


# -- the plan of a run --------------------------------------------------------------------------

@dataclass
class Plan:
    """How much of everything a run measures (`--quick` shrinks the counts, never the kinds)."""

    quick: bool = False
    sections: tuple[str, ...] = SECTIONS
    bots: int = 100
    classes: int = 100
    zipf_s: float = 1.0
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    closed_min_requests: int = 40  # measured requests per closed-loop point: at least this,
    closed_requests_per_client: int = 10  # and this many per client
    poisson_rate: float | None = None  # None: 70 % of the mixed policy's 16-client throughput
    poisson_requests: int = 150
    trunk_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    trunk_runs: int = 7
    matmul_n: int = 2048
    matmul_runs: int = 7
    scale_levels: tuple[int, ...] = (10, 100, 1000, 10000)
    scale_touch_max: int = 2000
    cold_samples: int = 50
    fanout_bots: int = 10
    fanout_requests: int = 20
    rebuild_reps: int = 3
    full_models: int = 4
    full_models_requests: int = 64
    full_models_concurrency: int = 16
    images: int = 64
    overload_uploads: int = 300
    soak_s: float = 300.0
    soak_clients: int = 8
    seed: int = 0
    max_batch_size: int = 16
    max_wait_ms: float | None = None  # None: the server's default
    progress: bool = True

    @classmethod
    def quick_plan(cls, **overrides) -> Plan:
        values = dict(quick=True, concurrency=(1, 16), closed_min_requests=16,
                      closed_requests_per_client=4, poisson_requests=24, trunk_runs=5,
                      matmul_runs=5, scale_levels=(10, 100, 1000), cold_samples=20,
                      fanout_requests=8, rebuild_reps=2, full_models_requests=24, images=48,
                      overload_uploads=100, soak_s=60.0)
        values.update(overrides)
        return cls(**values)

    def closed_requests(self, concurrency: int) -> int:
        """Measured requests of a closed-loop point (after `concurrency` warm-up requests)."""
        return max(self.closed_min_requests, self.closed_requests_per_client * concurrency)


# -- small helpers ------------------------------------------------------------------------------

def _say(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[bench] {message}", file=sys.stderr)


class _Bar:
    """A tqdm bar (stderr) that is a no-op when progress is off."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            # disable=None: bars only on a terminal (a log file would get every redraw).
            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False,
                             dynamic_ncols=True, disable=None)
        self._lock = threading.Lock()

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tf_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("tensorflow")
    except metadata.PackageNotFoundError:
        return None


def random_head(rng: np.random.Generator, classes: int) -> tuple[np.ndarray, np.ndarray, list]:
    weights = (rng.standard_normal((FEATURE_DIM, classes), dtype=np.float32)
               * np.float32(1 / np.sqrt(FEATURE_DIM)))  # [1536, n]
    biases = (rng.standard_normal(classes, dtype=np.float32) * np.float32(0.1))  # [n]
    return weights, biases, [f"class-{i:03d}" for i in range(classes)]


def _bf16_cpu() -> bool:
    from backbone.device import detect_device

    return detect_device("cpu").bf16


def _rates(batches: list[dict]) -> dict:
    """Best images/s and the rates at batch 1 and 8 of one runtime's batch table."""
    by_size = {b["batch_size"]: b["images_per_s"] for b in batches}
    best = max(batches, key=lambda b: b["images_per_s"])
    return {"best_images_per_s": best["images_per_s"], "images_per_s_b1": by_size.get(1),
            "images_per_s_b8": by_size.get(8)}


def bot_id(i: int) -> str:
    return f"bot-{i:05d}"


def register_bots(store_dir: Path, count: int, classes: int, seed: int, start: int = 0,
                  store=None, on_each: Callable[[float], None] | None = None) -> list[str]:
    """Registers bots `bot_id(start..count-1)` with random heads; returns their ids."""
    from heads import HeadStore

    own = store is None
    store = store or HeadStore(store_dir)
    rng = np.random.default_rng(seed + start)
    ids = []
    try:
        for i in range(start, count):
            weights, biases, labels = random_head(rng, classes)
            t0 = time.perf_counter()
            store.register(bot_id(i), weights, biases, labels, source="bench")
            if on_each is not None:
                on_each(time.perf_counter() - t0)
            ids.append(bot_id(i))
    finally:
        if own:
            store.close()
    return ids


def measure_matmul(n: int, runs: int) -> dict:
    """float32 [n, n] @ [n, n] through TensorFlow (one tf.function call per run)."""
    import tensorflow as tf

    a = tf.random.stateless_normal([n, n], seed=[1, 2], dtype=tf.float32)
    b = tf.random.stateless_normal([n, n], seed=[3, 4], dtype=tf.float32)

    @tf.function
    def matmul(x, y):
        # The sum keeps the result on the device side and costs n^2 adds (0.05 % of 2 n^3).
        return tf.reduce_sum(tf.linalg.matmul(x, y))

    for _ in range(2):
        matmul(a, b).numpy()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        matmul(a, b).numpy()
        times.append(time.perf_counter() - t0)
    flops = 2.0 * n ** 3
    gflops = [flops / t / 1e9 for t in times]
    return {"n": n, "runs": runs, "times_s": times, "gflops_best": max(gflops),
            "gflops_median": float(np.median(gflops))}


# -- the run --------------------------------------------------------------------------------

class Bench:
    """One benchmark run: owns the temp dir, the trunk checkpoint, the images and the results."""

    def __init__(self, plan: Plan, out_dir: str | os.PathLike, *,
                 trunk_checkpoint: str | None = None, command: str = "multihead bench") -> None:
        self.plan = plan
        self.out_dir = Path(out_dir)
        self.trunk_checkpoint = trunk_checkpoint
        self.command = command
        self.results: dict = {"meta": {}, "errors": {}}
        self.tmp: Path | None = None
        self.prefix: str = ""
        self.jpegs: list[bytes] = []
        self.server_starts: list[dict] = []

    # -- orchestration ----------------------------------------------------------------------

    def run(self) -> dict:
        """Runs the selected sections in order; a failing section is recorded and the run goes
        on. Returns the results dict (also written to `<out_dir>/bench.json` as it fills)."""
        from bench.load import make_jpegs, stop_all_servers

        started = time.monotonic()
        plan = self.plan
        self.out_dir.mkdir(parents=True, exist_ok=True)
        meta = self.results["meta"]
        meta.update(
            date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            command=self.command, quick=plan.quick,
            sections=[s for s in SECTIONS if s in plan.sections],
            machine=machine_facts(tf_version()),
            plan={k: v for k, v in plan.__dict__.items() if k != "progress"},
        )
        self.tmp = Path(tempfile.mkdtemp(prefix="multihead-bench-"))
        try:
            self.jpegs = make_jpegs(plan.images)
            meta["image_bytes_mean"] = float(np.mean([len(j) for j in self.jpegs]))
            self._prepare_trunk_checkpoint()
            steps: list[tuple[str, Callable[[], None]]] = [("trunk", self.section_trunk)]
            if "service" in plan.sections or "fanout" in plan.sections:
                steps.append(("service+fanout", self.section_service_and_fanout))
            steps += [("grpc", self.section_grpc),
                      ("scale", self.section_scale), ("coldstart", self.section_coldstart),
                      ("baselines", self.section_baselines), ("overload", self.section_overload),
                      ("soak", self.section_soak), ("replicas", self.section_replicas)]
            for name, step in steps:
                if name != "service+fanout" and name not in plan.sections:
                    continue
                _say(f"section {name} ...")
                t0 = time.monotonic()
                try:
                    step()
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # noqa: BLE001 - record, and measure the rest
                    self._record_error(name, exc)
                finally:
                    stop_all_servers()
                    gc.collect()
                _say(f"section {name} done in {time.monotonic() - t0:.0f} s")
                meta["duration_s"] = time.monotonic() - started
                write_reports(self.out_dir, self.results, None)  # partial results so far
        finally:
            stop_all_servers()
            shutil.rmtree(self.tmp, ignore_errors=True)
        meta["duration_s"] = time.monotonic() - started
        meta["server_starts"] = self.server_starts
        return self.results

    def _record_error(self, name: str, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        self.results["errors"][name] = message[:2000]
        (self.out_dir / f"error-{name.replace('+', '-')}.txt").write_text(
            "".join(traceback.format_exception(exc)), "utf-8")
        _say(f"section {name} FAILED: {message[:300]}")

    def _prepare_trunk_checkpoint(self) -> None:
        meta = self.results["meta"]
        if self.trunk_checkpoint:
            from backbone.checkpoint import resolve_prefix

            self.prefix = resolve_prefix(self.trunk_checkpoint)
            meta["trunk_kind"] = f"given checkpoint {self.prefix}"
            return
        from backbone.checkpoint import DEMO_CHECKPOINT, write_random_checkpoint

        _say("writing a seeded random trunk checkpoint (official layout) ...")
        self.prefix = write_random_checkpoint(str(self.tmp / "trunk" / DEMO_CHECKPOINT),
                                              seed=self.plan.seed)
        meta["trunk_kind"] = (f"seeded random weights (seed {self.plan.seed}) in the official "
                              "layout; the same graph and cost as the official checkpoint")

    def share_graph_cache(self, store: Path) -> None:
        """Points `<store>/trunk/graph_cache` (where `multihead serve` keeps its saved graph) at
        one directory shared by the load servers of this run, so that only the first of them
        builds the graph. Cold starts are measured in the coldstart section, on a fresh store."""
        link = Path(store) / "trunk" / "graph_cache"
        if link.exists() or link.is_symlink():
            return
        shared = self.tmp / "graph-cache-shared"
        shared.mkdir(parents=True, exist_ok=True)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared, target_is_directory=True)

    def _server(self, name: str, store: Path, **options):
        from bench.load import ServerProcess

        opts = {"max-batch-size": self.plan.max_batch_size}
        if self.plan.max_wait_ms is not None:
            opts["max-wait-ms"] = self.plan.max_wait_ms
        log_level = options.pop("log_level", "WARNING")
        opts.update(options)
        return ServerProcess(name, str(store), self.prefix, str(self.out_dir), opts,
                             log_level=log_level)

    def _start(self, server) -> None:
        _say(f"starting server '{server.name}' ...")
        server.start()
        self.server_starts.append({"name": server.name, "healthz_s": server.healthz_s,
                                   "ready_s": server.ready_s})
        _say(f"server '{server.name}' ready in {server.ready_s:.1f} s (pid {server.pid}, "
             f"port {server.port})")

    # -- 1. raw trunk ---------------------------------------------------------------------

    def section_trunk(self) -> None:
        from backbone import Trunk, preprocess

        plan = self.plan
        trunk = Trunk.from_checkpoint(self.prefix, warmup_batch_sizes=())
        batches = []
        try:
            sizes = plan.trunk_batch_sizes
            images = np.stack([preprocess(self.jpegs[i % len(self.jpegs)])
                               for i in range(max(sizes))])  # [16, 299, 299, 3]
            trunk.features(images[:1])  # first run ever: graph-wide initialisation
            rss_loaded = rss_bytes()
            matmul_before = measure_matmul(plan.matmul_n, plan.matmul_runs)
            times: dict[int, list[float]] = {size: [] for size in sizes}
            with _Bar(plan.progress, (plan.trunk_runs + 1) * len(sizes), "trunk") as bar:
                # One batch size at a time (warm-up, then the timed runs back to back): the
                # number wanted is the steady rate at each size.
                for size in sizes:
                    trunk.features(images[:size])  # the first run at a shape sets up its kernels
                    bar.update()
                    for _ in range(plan.trunk_runs):
                        t0 = time.perf_counter()
                        trunk.features(images[:size])
                        times[size].append(time.perf_counter() - t0)
                        bar.update()
            timings = trunk.timings
            reference = trunk.features(images[:8])  # [8, 1536]: what other runtimes must match
        finally:
            trunk.close()
        runtimes = self._other_runtimes(images, sizes, reference)
        for size in sizes:
            median = float(np.median(times[size]))
            batches.append({"batch_size": size, "runs": plan.trunk_runs, "median_s": median,
                            "images_per_s": size / median, "times_s": times[size]})
        matmul_after = measure_matmul(plan.matmul_n, plan.matmul_runs)
        # The ceiling is a peak: the better of the two measurements (before and after the trunk).
        matmul = max(matmul_before, matmul_after, key=lambda m: m["gflops_best"])
        matmul["gflops_best_before_after"] = [matmul_before["gflops_best"],
                                              matmul_after["gflops_best"]]
        best = max(batches, key=lambda b: b["images_per_s"])
        ceiling = matmul["gflops_best"] * 1e9 / FLOPS_PER_IMAGE
        batch1 = next((b for b in batches if b["batch_size"] == 1), None)
        self.results["trunk"] = {
            "batches": batches,
            "best_images_per_s": best["images_per_s"],
            "best_batch_size": best["batch_size"],
            "batch1_forward_ms": batch1["median_s"] * 1000 if batch1 else None,
            "matmul": matmul,
            "flops_per_image": FLOPS_PER_IMAGE,
            "ceiling_images_per_s": ceiling,
            "efficiency_pct": 100.0 * best["images_per_s"] / ceiling,
            "build_s": timings.build_s,
            "restore_s": timings.restore_s,
            "rss_after_load_bytes": rss_loaded,  # the whole bench process (TF runtime included)
            "note": "efficiency = best trunk images/s / (best matmul FLOP/s / FLOPs per image)",
            "bf16_cpu": _bf16_cpu(),
            "runtimes": {"tf-fp32": {"batches": batches, "min_cosine": 1.0,
                                     **_rates(batches)}, **runtimes},
        }
        _say(f"trunk best {best['images_per_s']:.2f} images/s at batch {best['batch_size']}; "
             f"matmul {matmul['gflops_best']:.0f} GFLOP/s -> ceiling {ceiling:.2f} images/s")

    def _other_runtimes(self, images: np.ndarray, sizes, reference: np.ndarray) -> dict:
        """images/s at each batch size and min cosine vs TF fp32 for every other runtime x
        precision this machine can run (bf16 needs avx512_bf16/AMX; openvino its package)."""
        from backbone import Trunk
        from backbone.precision import openvino_available

        combos = [("tf", "bf16")] if _bf16_cpu() else []
        if openvino_available():
            combos += [("openvino", "fp32")] + ([("openvino", "bf16")] if _bf16_cpu() else [])
        out = {}
        for runtime, precision in combos:
            name = f"{runtime}-{precision}"
            _say(f"trunk on {name} ...")
            try:
                trunk = Trunk.from_checkpoint(self.prefix, warmup_batch_sizes=(1,),
                                              runtime=runtime, precision=precision,
                                              graph_cache_dir=self.tmp / "runtime-cache")
            except Exception as exc:  # noqa: BLE001 - record, and measure the others
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            try:
                features = trunk.features(images[:8])
                batches = []
                for size in sizes:
                    trunk.features(images[:size])
                    times = []
                    for _ in range(self.plan.trunk_runs):
                        t0 = time.perf_counter()
                        trunk.features(images[:size])
                        times.append(time.perf_counter() - t0)
                    median = float(np.median(times))
                    batches.append({"batch_size": size, "runs": len(times), "median_s": median,
                                    "images_per_s": size / median, "times_s": times})
            finally:
                trunk.close()
            cosine = np.sum(features * reference, axis=1) / (
                np.linalg.norm(features, axis=1) * np.linalg.norm(reference, axis=1))
            out[name] = {"batches": batches, "min_cosine": float(cosine.min()),
                         "max_abs_diff": float(np.abs(features - reference).max()),
                         **_rates(batches)}
        return out

    # -- 2. service (and 6. fan-out on the same server) -------------------------------------

    def section_service_and_fanout(self) -> None:
        plan = self.plan
        store = self.tmp / "service-store"
        bots = register_bots(store, plan.bots, plan.classes, plan.seed)
        self.share_graph_cache(store)
        want_service = "service" in plan.sections
        service = {"bots": plan.bots, "classes": plan.classes, "zipf_s": plan.zipf_s,
                   "image": f"640×480 JPEG (~{self.results['meta']['image_bytes_mean'] / 1e3:.0f}"
                            f" kB, {len(self.jpegs)} distinct)",
                   "policies": {}}
        if want_service:
            self.results["service"] = service
        from service.core.settings import BATCH_POLICIES

        # Mixed first: the open-loop rate both policies face is taken from its throughput.
        policies = (sorted(BATCH_POLICIES, key=lambda p: p != "mixed") if want_service
                    else ["mixed"])
        for policy in policies:
            server = self._server(f"service-{policy}", store, **{
                "batch-policy": policy, "feature-cache-size": 0})
            self._start(server)
            try:
                data = {"server": {"ready_s": server.ready_s, "rss_bytes": server.rss_bytes(),
                                   "pid": server.pid}, "points": []}
                asyncio.run(self._warm_up(server.url, bots))
                if want_service:
                    service["policies"][policy] = data
                    try:
                        asyncio.run(self._service_points(server.url, bots, policy, data))
                    except Exception as exc:  # noqa: BLE001
                        self._record_error(f"service-{policy}", exc)
                if policy == "mixed" and "fanout" in plan.sections:
                    try:
                        asyncio.run(self._fanout(server.url, bots))
                    except Exception as exc:  # noqa: BLE001
                        self._record_error("fanout", exc)
                data["server"]["rss_bytes_end"] = server.rss_bytes()
            finally:
                server.stop()
            write_reports(self.out_dir, self.results, None)

    async def _warm_up(self, url: str, bots: Sequence[str]) -> None:
        """One concurrent burst (not measured): connections, thread pools, batch shapes."""
        from bench.load import Workload, closed_loop

        workload = Workload(self.jpegs, bots, self.plan.zipf_s, seed=self.plan.seed + 99)
        await closed_loop(url, workload, concurrency=min(16, self.plan.max_batch_size),
                          requests=0)

    async def _service_points(self, url: str, bots: Sequence[str], policy: str,
                              data: dict) -> None:
        from bench.load import Workload, closed_loop, open_loop, scrape_metrics

        plan = self.plan
        trunk_best = (self.results.get("trunk") or {}).get("best_images_per_s")
        loads: list[tuple[str, int | float]] = [("closed", c) for c in plan.concurrency]
        loads.append(("open", 0))
        for index, (mode, level) in enumerate(loads):
            workload = Workload(self.jpegs, bots, plan.zipf_s, seed=plan.seed + index)
            before, before_counts = await scrape_metrics(url)
            if mode == "closed":
                n = plan.closed_requests(int(level))
                with _Bar(plan.progress, n + int(level), f"{policy} {level} client(s)") as bar:
                    point = await closed_loop(url, workload, int(level), n, bar.update)
            else:
                rate = self._poisson_rate(data)
                with _Bar(plan.progress, plan.poisson_requests,
                          f"{policy} Poisson {rate:.1f}/s") as bar:
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
                ratio_to_trunk=ratio(point["throughput_images_per_s"], trunk_best),
                # Must stay 0: every request's image has to go through the trunk.
                feature_cache_hits=after_counts.get(hits, 0) - before_counts.get(hits, 0),
                # Where the time goes, from the server's own histograms (means).
                server_ms={
                    "request": server_mean_ms(
                        "multihead_request_seconds{route=/classify/{bot_id}}"),
                    "decode": server_mean_ms("multihead_decode_seconds"),
                    "queue_wait": server_mean_ms("multihead_queue_wait_seconds"),
                    "trunk_per_batch": server_mean_ms("multihead_trunk_seconds"),
                    "heads_per_batch": server_mean_ms("multihead_heads_seconds"),
                },
            )
            data["points"].append(point)
            _say(f"{policy} {_label(point)}: {point['throughput_images_per_s']:.2f} images/s, "
                 f"p50 {point['p50_ms']:.0f} ms, p99 {point['p99_ms']:.0f} ms, mean batch "
                 f"{point['mean_batch_size']:.2f} ({point['mean_batch_bots']:.2f} bots), "
                 f"errors {point['errors']}")

    def _poisson_rate(self, data: dict) -> float:
        """The open-loop rate: given, or 70 % of the mixed policy's 16-client (else best closed)
        throughput, so that both policies face the same arrivals."""
        if self.plan.poisson_rate:
            return self.plan.poisson_rate
        service = self.results.get("service", {})
        chosen = service.get("poisson_rate_per_s")
        if chosen:
            return chosen
        closed = [p for p in data["points"] if p.get("mode") == "closed"
                  and not math.isnan(p.get("throughput_images_per_s", math.nan))]
        c16 = [p for p in closed if p["concurrency"] == 16]
        basis = (c16 or sorted(closed, key=lambda p: -p["throughput_images_per_s"]) or [None])[0]
        if basis is not None:
            rate = 0.7 * basis["throughput_images_per_s"]
        else:
            rate = 0.7 * ((self.results.get("trunk") or {}).get("best_images_per_s") or 5.0)
        rate = round(max(rate, 0.5), 2)
        service["poisson_rate_per_s"] = rate
        return rate

    async def _fanout(self, url: str, bots: Sequence[str]) -> None:
        from bench.load import sequential

        plan = self.plan
        n_bots = min(plan.fanout_bots, len(bots))
        fan = ",".join(bots[:n_bots])
        requests, kinds = [], []
        image = 0
        for _ in range(plan.fanout_requests):
            # Alternate (single, fan-out) so that drift in the machine's load hits both alike;
            # each request carries a distinct image (the feature cache is off anyway).
            for kind, path in (("single", f"/classify/{bots[0]}"),
                               ("fanout", f"/classify?bots={fan}")):
                requests.append((path, self.jpegs[image % len(self.jpegs)]))
                kinds.append(kind)
                image += 1
        with _Bar(plan.progress, len(requests), "fan-out") as bar:
            records = await sequential(url, requests, bar.update)
        bad = [r.status for r in records if r.status != 200]
        if bad:
            raise RuntimeError(f"fan-out requests failed with statuses {sorted(set(bad))}")
        single = summarize([r.latency_s for r, k in zip(records, kinds) if k == "single"])
        fanout = summarize([r.latency_s for r, k in zip(records, kinds) if k == "fanout"])
        self.results["fanout"] = {"n_bots": n_bots, "single": single, "fanout": fanout,
                                  "ratio_p50": ratio(fanout["p50_ms"], single["p50_ms"])}
        _say(f"fan-out: 1 bot p50 {single['p50_ms']:.0f} ms, {n_bots} bots p50 "
             f"{fanout['p50_ms']:.0f} ms")

    # -- 4. bot scale ---------------------------------------------------------------------

    def section_scale(self) -> None:
        plan = self.plan
        store_dir = self.tmp / "scale-store"
        result = self.results["scale"] = self.register_levels(store_dir)
        self.share_graph_cache(store_dir)
        # One server over the largest store; its heads budget holds every bot we touch.
        touch_max = min(result["levels"][-1]["bots"], plan.scale_touch_max)
        head_nbytes = result["weight_bytes_per_bot"] + plan.classes * 60  # + label strings
        budget_mb = int(math.ceil(touch_max * head_nbytes * 1.25 / MIB)) + 64
        server = self._server("scale", store_dir, **{"heads-memory-mb": budget_mb,
                                                     "feature-cache-size": 16})
        self._start(server)
        try:
            asyncio.run(self.touch_levels(server.url, server.rss_bytes, result))
        finally:
            server.stop()
        result["heads_memory_mb"] = budget_mb
        result["method"] = (
            f"server process VmRSS before and after touching each bot once through HTTP (one "
            f"image whose trunk features are cached, so only heads load); {result['touched']} "
            f"of {result['levels'][-1]['bots']} registered bots touched, heads budget "
            f"{budget_mb} MiB so all stay resident.")

    def register_levels(self, store_dir: Path) -> dict:
        """Registers bots level by level into a new store; times each `HeadStore.register`."""
        from heads import HeadStore

        plan = self.plan
        levels = sorted(set(plan.scale_levels))
        weight_bytes = FEATURE_DIM * plan.classes * 4 + plan.classes * 4
        result: dict = {"classes": plan.classes, "weight_bytes_per_bot": weight_bytes,
                        "levels": []}
        # Not timed: the first registration of a process imports TensorFlow (to write the head's
        # checkpoint) and sets up its eager context, which no later registration pays again.
        register_bots(Path(store_dir).with_name(Path(store_dir).name + "-warmup"), 2,
                      plan.classes, plan.seed)
        all_times: list[float] = []
        store = HeadStore(store_dir)
        try:
            with _Bar(plan.progress, levels[-1], "register") as bar:
                registered = 0
                for level in levels:
                    times: list[float] = []

                    def on_each(dt: float, times: list[float] = times) -> None:
                        times.append(dt)
                        bar.update()

                    register_bots(store_dir, level, plan.classes, plan.seed, start=registered,
                                  store=store, on_each=on_each)
                    registered = level
                    all_times += times
                    result["levels"].append({"bots": level, "register": summarize(times)})
        finally:
            store.close()
        reg = summarize(all_times)
        result.update(registrations=len(all_times), registration_p50_ms=reg["p50_ms"],
                      registration_p99_ms=reg["p99_ms"])
        _say(f"registration p50 {reg['p50_ms']:.1f} ms, p99 {reg['p99_ms']:.1f} ms over "
             f"{len(all_times)} heads")
        return result

    async def touch_levels(self, url: str, read_rss: Callable[[], int], result: dict) -> None:
        """Loads the registered bots into the server level by level, through HTTP, with ONE
        image whose features are cached after the first request: what each request costs, and
        what the server's RSS (`read_rss()`) grows by, is the head alone. Fills `result`."""
        from bench.load import concurrent, scrape_metrics, sequential

        plan = self.plan
        weight_bytes = result["weight_bytes_per_bot"]
        touch_max = min(result["levels"][-1]["bots"], plan.scale_touch_max)
        anchor = self.jpegs[0]
        rng = np.random.default_rng(plan.seed)
        await sequential(url, [(f"/classify/{bot_id(0)}", anchor)] * 20)  # trunk once, then cache
        rss0 = rss_prev = read_rss()
        touched = 1
        cold, warm = [], []
        for entry in result["levels"]:
            target = min(entry["bots"], touch_max)
            new = [bot_id(i) for i in range(touched, target)]
            if not new:
                entry.update(touched=touched)
                continue
            # Cold samples interleaved with warm ones (a random bot already resident), one
            # request at a time, so that both see the same machine.
            n_cold = min(plan.cold_samples, len(new))
            pairs, kinds = [], []
            for b in new[:n_cold]:
                pairs.append((f"/classify/{b}", anchor))
                kinds.append("cold")
                pairs.append((f"/classify/{bot_id(int(rng.integers(0, touched)))}", anchor))
                kinds.append("warm")
            with _Bar(plan.progress, len(new) + n_cold, f"touch {target} bots") as bar:
                records = await sequential(url, pairs, bar.update)
                rest = [(f"/classify/{b}", anchor) for b in new[n_cold:]]
                records += await concurrent(url, rest, 8, bar.update)
            bad = sorted({r.status for r in records if r.status != 200})
            if bad:
                raise RuntimeError(f"touch requests failed with statuses {bad}")
            cold += [r.latency_s for r, k in zip(records, kinds) if k == "cold"]
            warm += [r.latency_s for r, k in zip(records, kinds) if k == "warm"]
            await asyncio.sleep(0.2)
            rss = read_rss()
            _, gauges = await scrape_metrics(url)
            growth = (rss - rss_prev) / len(new)
            entry.update(touched=target, rss_bytes=rss, rss_growth_per_bot_bytes=growth,
                         rss_growth_ratio=growth / weight_bytes,
                         resident_heads=gauges.get("multihead_resident_heads"),
                         resident_head_bytes=gauges.get("multihead_resident_head_bytes"))
            touched, rss_prev = target, rss
        overall = (rss_prev - rss0) / max(touched - 1, 1)
        result.update(
            touched=touched, rss_base_bytes=rss0, rss_end_bytes=rss_prev,
            rss_growth_per_bot_bytes=overall, rss_growth_ratio=overall / weight_bytes,
            cold=summarize(cold), warm=summarize(warm),
            latency_method=("both through HTTP with cached features: the difference is loading "
                            "the head from the store."))
        _say(f"scale: RSS growth {overall / 1e3:.0f} kB per bot ({overall / weight_bytes:.2f} x "
             f"weights); cold p50 {result['cold']['p50_ms']:.1f} ms vs warm "
             f"{result['warm']['p50_ms']:.1f} ms")

    # -- 5. cold start --------------------------------------------------------------------

    def section_coldstart(self) -> None:
        plan = self.plan
        store = self.tmp / "coldstart-store"
        store.mkdir(parents=True, exist_ok=True)

        def cache_options(enabled: bool) -> dict:
            # `multihead serve --graph-cache`: the graph is kept in <store>/trunk/graph_cache.
            return {"graph-cache": enabled}

        result: dict = {"starts": []}
        self.results["coldstart"] = result

        def start(label: str, notes: str = "", **options) -> dict:
            # INFO: the server log then shows its start-up steps, for whoever reads it.
            server = self._server(f"coldstart-{len(result['starts'])}", store, log_level="INFO",
                                  **options)
            self._start(server)
            server.stop()
            entry = {"label": label, "healthz_s": server.healthz_s, "ready_s": server.ready_s,
                     **coldstart_timings(server.server_timings())}
            if "build_s" in entry:
                notes = (notes + "; " if notes else "") + (
                    f"graph {entry['build_s']:.1f} s, restore {entry['restore_s']:.1f} s")
            entry["notes"] = notes
            result["starts"].append(entry)
            return entry

        if not plan.quick:  # quick: the first start below builds the graph from code too
            start("plain start, no saved graph", "graph built from code, warm-up on",
                  **cache_options(False))
        start("first start with the graph cache (graph built from code, then saved)",
              "warm-up on", **cache_options(True))
        restart = start("restart with the saved graph", "default flags, warm-up on",
                        **cache_options(True))
        start("restart with the saved graph, --no-warmup (reference)", "ready before warm-up",
              warmup=False, **cache_options(True))
        result["restart_with_saved_graph_s"] = restart["ready_s"]
        result["target_note"] = (
            f"default flags, warm-up on; graph {restart.get('build_s', math.nan):.1f} s, restore "
            f"{restart.get('restore_s', math.nan):.1f} s; with --no-warmup ready in "
            f"{result['starts'][-1]['ready_s']:.1f} s")
        result["note"] = (
            "Saved graph: `--graph-cache` (the default). The target is the default restart "
            "(warm-up on: the server runs the trunk once before /readyz says ready: at batch 1 "
            "on a CPU, at every power-of-two batch size up to the max on a GPU). Times run from "
            "spawning the process, Python and TensorFlow imports included.")

    # -- 3. baselines ---------------------------------------------------------------------

    def section_replicas(self) -> None:
        from bench import replicas

        self.results["replicas"] = replicas.run(self, register_bots)

    def section_grpc(self) -> None:
        from bench import grpc_load
        from bench.load import free_port

        why_not = grpc_load.grpc_available()
        if why_not:
            self.results["grpc"] = {"skipped": why_not}
            return
        plan = self.plan
        store = self.tmp / "grpc-store"
        bots = register_bots(store, plan.bots, plan.classes, plan.seed)
        self.share_graph_cache(store)
        server = self._server("grpc", store, **{"feature-cache-size": 0,
                                                 "grpc-port": free_port()})
        self._start(server)
        try:
            self.results["grpc"] = grpc_load.run(
                server, self.jpegs, bots, zipf_s=plan.zipf_s, seed=plan.seed,
                requests_c1=plan.closed_requests(1), concurrency=16,
                requests_cn=plan.closed_requests(16))
        finally:
            server.stop()

    def _hardening_server(self, name: str, bots: int):
        store = self.tmp / f"{name}-store"
        ids = register_bots(store, bots, self.plan.classes, self.plan.seed)
        self.share_graph_cache(store)
        server = self._server(name, store)
        self._start(server)
        return server, ids

    def section_overload(self) -> None:
        from bench import hardening

        plan = self.plan
        server, ids = self._hardening_server("overload", 4)
        try:
            result = asyncio.run(hardening.overload(server.url, server.pid, self.jpegs[:32],
                                                    plan.overload_uploads, ids[0]))
        finally:
            server.stop()
        self.results["overload"] = result

    def section_soak(self) -> None:
        from bench import hardening

        plan = self.plan
        server, ids = self._hardening_server("soak", 20)
        try:
            result = asyncio.run(hardening.soak(server.url, server.pid, self.jpegs, ids,
                                                plan.soak_s, plan.soak_clients, plan.seed))
        finally:
            server.stop()
        self.results["soak"] = result

    def section_baselines(self) -> None:
        plan = self.plan
        result: dict = {}
        self.results["baselines"] = result
        result["rebuild"] = self._rebuild_per_request(plan.rebuild_reps)
        write_reports(self.out_dir, self.results, None)
        result["full_models"] = self._full_models(plan.full_models)

    def _rebuild_per_request(self, reps: int) -> dict:
        """Per request: build the graph, restore the checkpoint, classify one image, close."""
        from backbone import Trunk, preprocess

        rng = np.random.default_rng(self.plan.seed)
        weights, biases, _ = random_head(rng, self.plan.classes)
        latencies, builds, restores = [], [], []
        with _Bar(self.plan.progress, reps, "rebuild per request") as bar:
            for i in range(reps):
                t0 = time.perf_counter()
                trunk = Trunk.from_checkpoint(self.prefix, warmup_batch_sizes=())
                try:
                    image = preprocess(self.jpegs[(i + 7) % len(self.jpegs)])[None]
                    logits = trunk.features(image) @ weights + biases  # [1, n]
                    int(np.argmax(logits))
                finally:
                    trunk.close()
                latencies.append(time.perf_counter() - t0)
                builds.append(trunk.timings.build_s)
                restores.append(trunk.timings.restore_s)
                del trunk
                gc.collect()
                bar.update()
        latency = summarize(latencies)
        _say(f"rebuild per request: p50 {latency['p50_ms']:.0f} ms")
        return {"latency": latency, "throughput_images_per_s": 1000.0 / latency["mean_ms"],
                "build_s_median": float(np.median(builds)),
                "restore_s_median": float(np.median(restores))}

    def _full_models(self, k: int) -> dict:
        """K full models, measured in a fresh child process so that memory freed by earlier
        sections (which the allocator keeps and reuses) cannot hide what each model costs."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        plan = self.plan
        _say(f"building {k} full models in a fresh process ...")
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            result = pool.submit(full_models_worker, self.prefix, self.jpegs, k,
                                 plan.full_models_requests, plan.full_models_concurrency,
                                 plan.zipf_s, plan.seed,
                                 str(self.tmp / "graph-cache-models")).result()
        _say(f"{k} full models: {result['throughput_images_per_s']:.2f} images/s, RSS "
             f"{result['rss_per_model_bytes_mean'] / 1e6:.0f} MB per model")
        return result


def full_models_worker(prefix: str, jpegs: Sequence[bytes], k: int, requests: int,
                       concurrency: int, zipf_s: float, seed: int,
                       graph_cache_dir: str | None = None) -> dict:
    """The one-model-per-bot design: K complete Inception-V4 models (graph + session + own
    Logits) in ONE process, requests routed to their bot's model, one image per run, no
    cross-bot batching. Returns throughput, latency and VmRSS growth per model.

    Run it in a fresh process: TensorFlow's runtime is initialised first (not counted), then
    VmRSS is read before and after each model is built. With `graph_cache_dir` models 2..K
    re-import the first one's saved graph instead of rebuilding
    it: the same graphs, sessions and weights in memory, only faster to set up.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from backbone import Trunk, preprocess
    from bench.stats import ZipfSampler

    float(tf.reduce_sum(tf.ones([4, 4])))  # the runtime's own start-up memory, not a model's
    options = {"graph_cache_dir": graph_cache_dir} if graph_cache_dir else {}
    models, rss_per_model = [], []
    try:
        for _ in range(k):
            gc.collect()
            before = rss_bytes()
            models.append(Trunk.from_checkpoint(prefix, with_logits=True,
                                                warmup_batch_sizes=(1,), **options))
            gc.collect()
            rss_per_model.append(rss_bytes() - before)
        sampler = ZipfSampler(k, zipf_s, seed)
        order = [int(sampler.sample()) for _ in range(requests)]

        def request(i: int, bot: int) -> float:
            t0 = time.perf_counter()
            image = preprocess(jpegs[i % len(jpegs)])[None]  # [1, 299, 299, 3]
            _, logits = models[bot].features_and_logits(image)  # [1, 1001]
            np.argsort(-logits[0])[:5]
            return time.perf_counter() - t0

        for bot in range(k):  # one warm request per model, not measured
            request(bot, bot)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            latencies = list(pool.map(lambda args: request(*args), enumerate(order)))
        wall = time.perf_counter() - t0
    finally:
        for model in models:
            model.close()
    return {"k": k, "rss_per_model_bytes": rss_per_model,
            "rss_per_model_bytes_mean": float(np.mean(rss_per_model)),
            "rss_total_bytes": int(sum(rss_per_model)), "requests": len(order),
            "concurrency": concurrency, "throughput_images_per_s": len(order) / wall,
            "latency": summarize(latencies),
            "method": "fresh process; VmRSS before/after building each model (graph, session, "
                      "restored weights, one warm-up run)"
                      + ("; models 2..K re-imported model 1's saved graph" if options else "")}


def coldstart_timings(server_timings: dict[str, float]) -> dict[str, float]:
    """What a cold start records of the server's own /readyz timings: `build_s`, `restore_s`
    and `server_ready_s` (the server's seconds from its start to ready), when it reported them."""
    out = {key: server_timings[key] for key in ("build_s", "restore_s") if key in server_timings}
    if "ready_s" in server_timings:
        out["server_ready_s"] = server_timings["ready_s"]
    return out


def _label(point: dict) -> str:
    if point.get("mode") == "open":
        return f"Poisson {point.get('rate_per_s')}/s"
    clients = point.get("concurrency")
    return f"{clients} client{'' if clients == 1 else 's'}"
