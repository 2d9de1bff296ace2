"""Section `baselines`: the naive designs on the same machine and images: rebuild the graph and
restore the checkpoint per request; K full models (one whole Inception-V4 per bot) in one
process, requests routed to their bot's model."""
from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from bench.bots import random_head
from bench.context import Context, say
from bench.markdown import fmt, kb, mb, table
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.sections.service import ServiceResult
from bench.stats import num, ratio, rss_bytes, summarize


@dataclass
class BaselinesResult(Result):
    rebuild: dict | None = None  # {latency, throughput_images_per_s, build_s_median, ...}
    full_models: dict | None = None  # see `full_models_worker`


def rebuild_per_request(context: Context, reps: int) -> dict:
    """Per request: build the graph, restore the checkpoint, classify one image, close."""
    from backbone import Trunk, preprocess

    rng = np.random.default_rng(context.plan.seed)
    weights, biases, _ = random_head(rng, context.plan.classes)
    latencies, builds, restores = [], [], []
    with context.bar(reps, "rebuild per request") as bar:
        for i in range(reps):
            t0 = time.perf_counter()
            trunk = Trunk.from_checkpoint(context.prefix, warmup_batch_sizes=())
            try:
                image = preprocess(context.jpegs[(i + 7) % len(context.jpegs)])[None]
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
    say(f"rebuild per request: p50 {latency['p50_ms']:.0f} ms")
    return {"latency": latency, "throughput_images_per_s": 1000.0 / latency["mean_ms"],
            "build_s_median": float(np.median(builds)),
            "restore_s_median": float(np.median(restores))}


def full_models(context: Context, k: int) -> dict:
    """K full models, measured in a fresh child process so that memory freed by earlier
    sections (which the allocator keeps and reuses) cannot hide what each model costs."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    plan = context.plan
    say(f"building {k} full models in a fresh process ...")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        result = pool.submit(full_models_worker, context.prefix, context.jpegs, k,
                             plan.full_models_requests, plan.full_models_concurrency,
                             plan.zipf_s, plan.seed,
                             str(context.tmp / "graph-cache-models")).result()
    say(f"{k} full models: {result['throughput_images_per_s']:.2f} images/s, RSS "
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
    re-import the first one's saved graph instead of rebuilding it: the same graphs, sessions
    and weights in memory, only faster to set up.
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


def run(context: Context) -> BaselinesResult:
    result = BaselinesResult(rebuild=rebuild_per_request(context, context.plan.rebuild_reps))
    try:
        result.full_models = full_models(context, context.plan.full_models)
    except Exception as exc:  # noqa: BLE001 - the rebuild baseline is measured: keep it
        context.record_error("baselines", exc)
    return result


def _service_points(results: Results) -> tuple[dict, dict]:
    """(1-client, 16-client) points of the service's mixed policy ({} when not measured)."""
    service = results.get("service")
    if not isinstance(service, ServiceResult):
        return {}, {}
    return dict(service.point("mixed", 1)), dict(service.point("mixed", 16))


def render(base: BaselinesResult, results: Results) -> str:
    out = ["## Baselines: the naive designs on the same machine and images", ""]
    rows = []
    c1, c16 = _service_points(results)
    if c1 or c16:
        per_bot = getattr(results.get("scale"), "rss_growth_per_bot_bytes", None)
        rows.append(["shared trunk service (this project)", c1.get("p50_ms"),
                     c16.get("throughput_images_per_s"),
                     kb(per_bot) if per_bot is not None else "one head (see Bot scale)",
                     "p50 at 1 client; images/s at 16 clients; RSS per resident head"])
    rb = base.rebuild
    if rb:
        rows.append(["rebuild graph + restore per request", rb["latency"]["p50_ms"],
                     rb.get("throughput_images_per_s"), "—",
                     f"{rb['latency']['n']} requests; build {fmt(rb.get('build_s_median'))}"
                     f" s, restore {fmt(rb.get('restore_s_median'))} s each"])
    fm = base.full_models
    if fm:
        rows.append([f"K={fm.get('k')} full models, routed per bot",
                     fm["latency"]["p50_ms"], fm.get("throughput_images_per_s"),
                     mb(fm.get("rss_per_model_bytes_mean")),
                     f"{fm.get('requests')} requests, {fm.get('concurrency')} clients, "
                     f"batch 1 per model; RSS {mb(fm.get('rss_total_bytes'))} for "
                     f"{fm.get('k')} models"])
    out += table(["design", "p50 ms", "images/s", "RSS per bot", "notes"], rows)
    out += [""]
    return "\n".join(out)


def targets(base: BaselinesResult, results: Results) -> list[Target]:
    rebuild_ms = num(((base.rebuild or {}).get("latency") or {}).get("p50_ms"))
    c1, _ = _service_points(results)
    return [Target.of("rebuild_vs_service",
                      "rebuild-per-request latency >= 20 x service p50 at 1 client",
                      ("baselines", "service"), ratio(rebuild_ms, num(c1.get("p50_ms"))), 20.0,
                      ">=", "x", note("rebuild p50 {:.0f} ms", rebuild_ms))]


SECTION = Section("baselines", BaselinesResult, run, render, targets)
