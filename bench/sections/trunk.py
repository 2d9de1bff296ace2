"""Section `trunk`: the raw trunk in this process.

images/s at batch 1..16 on TF fp32, then on every other runtime x precision this machine can
run, as the runner registry declares them (`combinations`: bf16 needs avx512_bf16/AMX; OpenVINO
its package; int8 a runtime that runs the INT8 trunk and the run's INT8 trunk, calibrated by
`multihead quantize` on generated images, `bench.int8`) with the min cosine of its features
against TF fp32; float32 matmul GFLOP/s through TensorFlow -> the machine's ceiling in images/s,
and the trunk's efficiency against it.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bench.context import Context, say
from bench.markdown import fmt, table
from bench.result import Result
from bench.sections.base import SKIP, Results, Section, Target, note
from bench.stats import ratio, rss_bytes

# Cost of one 299x299 image through Inception-V4 up to PreLogitsFlatten (the trunk), in FLOPs
# (1 multiply-add = 2 FLOPs): the TF profiler's float_operation count on the official graph
# (= 12,274,991,520 multiply-adds, 99.8 % of it Conv2D). A copy of the figure in
# tests/data/inception_v4_contract.json, because the benchmark is installed without the tests'
# data; tests/bench checks that the two agree.
FLOPS_PER_IMAGE = 24_549_983_040

# Targets of issue 20: the INT8 trunk against the float ones of the same runtime at batch 8.
INT8_OVER_FP32 = 1.5  # any x86 CPU
INT8_OVER_BF16 = 1.4  # where the CPU has bf16
NO_BF16 = "this CPU has no avx512_bf16/amx_bf16"
# What every other runtime x precision is compared with: the one definition of the net.
REFERENCE = ("tf", "fp32")


@dataclass
class TrunkResult(Result):
    batches: list[dict] = field(default_factory=list)  # TF fp32, one entry per batch size
    best_images_per_s: float | None = None
    best_batch_size: int | None = None
    batch1_forward_ms: float | None = None
    matmul: dict = field(default_factory=dict)
    flops_per_image: int = FLOPS_PER_IMAGE
    ceiling_images_per_s: float | None = None
    efficiency_pct: float | None = None
    build_s: float | None = None
    restore_s: float | None = None
    rss_after_load_bytes: int | None = None  # the whole bench process (TF runtime included)
    note: str = "efficiency = best trunk images/s / (best matmul FLOP/s / FLOPs per image)"
    bf16_cpu: bool | None = None  # None: not known (the section did not run)
    # "<runtime>-<precision>" -> {batches, min_cosine, best_images_per_s, images_per_s_b1,
    # images_per_s_b8} (or {error}); "tf-fp32" first.
    runtimes: dict[str, dict] = field(default_factory=dict)
    # The run's INT8 trunk (`bench.int8.ensure_int8`): {artifact, key, passed, reused,
    # quantize_s, samples, held_out, calibration, fidelity, float_precision}, or {skipped} /
    # {error}; {} when the section did not run.
    int8: dict = field(default_factory=dict)


def bf16_cpu() -> bool:
    from backbone.device import detect_device

    return detect_device("cpu").bf16


def rates(batches: list[dict]) -> dict:
    """Best images/s and the rates at batch 1 and 8 of one runtime's batch table."""
    by_size = {b["batch_size"]: b["images_per_s"] for b in batches}
    best = max(batches, key=lambda b: b["images_per_s"])
    return {"best_images_per_s": best["images_per_s"], "images_per_s_b1": by_size.get(1),
            "images_per_s_b8": by_size.get(8)}


def time_batches(trunk, images: np.ndarray, sizes: Sequence[int], runs: int,
                 progress=None) -> list[dict]:
    """The steady rate of `trunk` at each batch size: one size at a time, one untimed run (the
    first run at a shape sets up its kernels), then `runs` timed runs back to back. With the
    CPU time this process spent over the timed runs (every thread: the trunk's own), per
    image: `cpu_ms_per_image`, what the service section's request path is measured against."""
    batches = []
    for size in sizes:
        trunk.features(images[:size])
        if progress is not None:
            progress(1)
        times = []
        cpu = 0.0
        for _ in range(runs):
            c0, t0 = time.process_time(), time.perf_counter()
            trunk.features(images[:size])
            times.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            if progress is not None:
                progress(1)
        median = float(np.median(times))
        batches.append({"batch_size": size, "runs": runs, "median_s": median,
                        "images_per_s": size / median, "times_s": times,
                        "cpu_ms_per_image": 1000.0 * cpu / (runs * size)})
    return batches


def preprocessed(context: Context, count: int) -> np.ndarray:
    """`count` of the run's JPEGs, decoded and preprocessed: [count, 299, 299, 3]."""
    from backbone import preprocess

    return np.stack([preprocess(context.jpegs[i % len(context.jpegs)]) for i in range(count)])


def measure_runtime(context: Context, runtime: str, precision: str, images: np.ndarray,
                    sizes: Sequence[int]) -> tuple[list[dict], np.ndarray]:
    """(batch table, features of the first 8 images) of the run's trunk on `runtime` x
    `precision`, built in this process (its graph cached in the run's temp dir; int8: the INT8
    trunk where `serve` finds it, next to the checkpoint, `bench.int8`)."""
    from backbone import Trunk
    from backbone.checkpoint import cache_dir_of

    trunk = Trunk.from_checkpoint(context.prefix, warmup_batch_sizes=(1,), runtime=runtime,
                                  precision=precision,
                                  graph_cache_dir=context.tmp / "runtime-cache",
                                  int8_dir=cache_dir_of(context.prefix))
    try:
        features = trunk.features(images[:8])  # [8, 1536]
        return time_batches(trunk, images, sizes, context.plan.trunk_runs), features
    finally:
        trunk.close()


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


def combinations(int8: dict) -> list[tuple[str, str]]:
    """Every runtime x precision this machine runs besides TF fp32 (the reference), as the
    runner registry declares them (`backbone.precision.combinations`): the installed runtimes
    that run on the trunk's device, each precision whose needs are met here (int8 when the run
    has an INT8 trunk, `int8`)."""
    from backbone.device import detect_device
    from backbone.precision import INT8_FAILING, INT8_NONE, INT8_PASSING
    from backbone.precision import combinations as runnable
    from backbone.runners.registry import available

    state = (INT8_PASSING if int8.get("passed") else INT8_FAILING if int8.get("artifact")
             else INT8_NONE)
    return [combo for combo in runnable(device=detect_device(), available=available(), int8=state)
            if combo != REFERENCE]


def measure_runtimes(context: Context, images: np.ndarray, sizes: Sequence[int],
                     reference: np.ndarray, combos: Sequence[tuple[str, str]]) -> dict:
    """"<runtime>-<precision>" -> its batch table and the min cosine of its features against
    TF fp32's (`reference`), for each of `combos` (or {error}: the others are measured)."""
    out = {}
    for runtime, precision in combos:
        name = f"{runtime}-{precision}"
        say(f"trunk on {name} ...")
        try:
            batches, features = measure_runtime(context, runtime, precision, images, sizes)
        except Exception as exc:  # noqa: BLE001 - record, and measure the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        cosine = np.sum(features * reference, axis=1) / (
            np.linalg.norm(features, axis=1) * np.linalg.norm(reference, axis=1))
        out[name] = {"batches": batches, "min_cosine": float(cosine.min()),
                     "max_abs_diff": float(np.abs(features - reference).max()),
                     **rates(batches)}
    return out


def run(context: Context) -> TrunkResult:
    from backbone import Trunk

    plan = context.plan
    sizes = plan.trunk_batch_sizes
    images = preprocessed(context, max(sizes))  # [16, 299, 299, 3]
    runtime, precision = REFERENCE
    trunk = Trunk.from_checkpoint(context.prefix, warmup_batch_sizes=(), runtime=runtime,
                                  precision=precision)
    try:
        trunk.features(images[:1])  # first run ever: graph-wide initialisation
        rss_loaded = rss_bytes()
        matmul_before = measure_matmul(plan.matmul_n, plan.matmul_runs)
        with context.bar((plan.trunk_runs + 1) * len(sizes), "trunk") as bar:
            batches = time_batches(trunk, images, sizes, plan.trunk_runs, bar.update)
        timings = trunk.timings
        reference = trunk.features(images[:8])  # [8, 1536]: what other runtimes must match
    finally:
        trunk.close()
    from bench.int8 import ensure_int8

    int8 = ensure_int8(context)  # a child process: the TF trunk above is closed
    runtimes = measure_runtimes(context, images, sizes, reference, combinations(int8))
    matmul_after = measure_matmul(plan.matmul_n, plan.matmul_runs)
    # The ceiling is a peak: the better of the two measurements (before and after the trunk).
    matmul = max(matmul_before, matmul_after, key=lambda m: m["gflops_best"])
    matmul["gflops_best_before_after"] = [matmul_before["gflops_best"],
                                          matmul_after["gflops_best"]]
    best = max(batches, key=lambda b: b["images_per_s"])
    ceiling = matmul["gflops_best"] * 1e9 / FLOPS_PER_IMAGE
    batch1 = next((b for b in batches if b["batch_size"] == 1), None)
    say(f"trunk best {best['images_per_s']:.2f} images/s at batch {best['batch_size']}; "
        f"matmul {matmul['gflops_best']:.0f} GFLOP/s -> ceiling {ceiling:.2f} images/s")
    return TrunkResult(
        batches=batches, best_images_per_s=best["images_per_s"],
        best_batch_size=best["batch_size"],
        batch1_forward_ms=batch1["median_s"] * 1000 if batch1 else None,
        matmul=matmul, ceiling_images_per_s=ceiling,
        efficiency_pct=100.0 * best["images_per_s"] / ceiling, build_s=timings.build_s,
        restore_s=timings.restore_s, rss_after_load_bytes=rss_loaded, bf16_cpu=bf16_cpu(),
        runtimes={"-".join(REFERENCE): {"batches": batches, "min_cosine": 1.0,
                                        **rates(batches)},
                  **runtimes},
        int8=dict(int8))


def render(trunk: TrunkResult, results: Results) -> str:
    out = ["## Raw trunk (in process, preprocessed 640×480 JPEGs)", ""]
    rows = [[b["batch_size"], b["images_per_s"], b["median_s"] * 1000,
             b.get("cpu_ms_per_image"), b["runs"]] for b in trunk.batches]
    out += table(["batch", "images/s", "ms per batch (median)", "CPU ms per image",
                  "timed runs"], rows)
    mm = trunk.matmul
    out += ["", f"Float32 matmul through TensorFlow ({mm.get('n')}×{mm.get('n')}, best of "
            f"{mm.get('runs')}): {fmt(mm.get('gflops_best'))} GFLOP/s (median "
            f"{fmt(mm.get('gflops_median'))}). Inception-V4 costs "
            f"{fmt((trunk.flops_per_image or 0) / 1e9)} GFLOP per image (contract), so "
            f"the ceiling is {fmt(trunk.ceiling_images_per_s)} images/s; the best "
            f"trunk rate {fmt(trunk.best_images_per_s)} images/s (batch "
            f"{trunk.best_batch_size}) is {fmt(trunk.efficiency_pct)} % of it. "
            f"Graph build {fmt(trunk.build_s)} s, restore "
            f"{fmt(trunk.restore_s)} s. RSS of the benchmark process once the trunk "
            f"is loaded and has run once: "
            f"{fmt((trunk.rss_after_load_bytes or 0) / 1e6)} MB (TensorFlow runtime "
            f"included).", ""]
    if len(trunk.runtimes) > 1 or not trunk.bf16_cpu:
        sizes = [b["batch_size"] for b in trunk.batches]
        out += [f"By runtime and precision (images/s; min cosine of the features against "
                f"TF fp32; this CPU {'has' if trunk.bf16_cpu else 'has no'} "
                f"avx512_bf16/amx_bf16, so bf16 "
                f"{'runs' if trunk.bf16_cpu else 'is refused and not measured'}):", ""]
        rows = []
        for name, r in trunk.runtimes.items():
            by_size = {b["batch_size"]: b["images_per_s"] for b in r.get("batches", [])}
            cosine = r.get("min_cosine")
            rows.append([name, *[by_size.get(size) for size in sizes],
                         None if cosine is None else f"{cosine:.6f}", r.get("error", "")])
        out += table(["runtime-precision", *[f"batch {s}" for s in sizes], "min cosine",
                      "error"], rows)
        out += [""]
    if trunk.int8:
        out += [int8_text(trunk.int8), ""]
    return "\n".join(out)


def lowest_agreement(fidelity: dict) -> tuple[str | None, float | None]:
    """(head, agreement) of the head whose top-1 class agrees least often ((None, None): no
    head was compared)."""
    agreement = fidelity.get("agreement") or {}
    if not agreement:
        return None, None
    name = min(agreement, key=lambda k: (agreement[k], k))
    return name, agreement[name]


def int8_text(int8: dict) -> str:
    """The INT8 trunk of the run in words: how it was made and its fidelity report."""
    if int8.get("skipped"):
        return f"No INT8 trunk: {int8['skipped']}."
    if int8.get("error"):
        return f"No INT8 trunk: its calibration failed ({int8['error']})."
    fid = int8.get("fidelity") or {}
    calibration = int8.get("calibration") or {}
    head, lowest = lowest_agreement(fid)
    overall = fid.get("overall_agreement")
    agreement = ("no registered head to compare" if head is None else
                 f"top-1 agreement of the {len(fid.get('agreement') or {})} bots trained on "
                 f"generated images: lowest {fmt(100 * lowest)} % ({head}; bound >= "
                 f"{fmt(100 * (fid.get('min_agreement_bound') or 0))} %), all answers "
                 f"{fmt(100 * overall) if overall is not None else '-'} % (bound >= "
                 f"{fmt(100 * (fid.get('overall_agreement_bound') or 0))} %)")
    made = (f"reused from the output's {int8.get('artifact')} ({calibration.get('date')})"
            if int8.get("reused") else f"calibrated in {fmt(int8.get('quantize_s'))} s")
    verdict = ("within the bounds: `serve` picks it by default" if int8.get("passed") else
               "below a bound: kept marked failing, so `serve`'s auto does not pick it "
               "(`--precision int8` would)")
    return (f"INT8 trunk (openvino-int8 above): `multihead quantize --force` on "
            f"{calibration.get('images')} generated labelled images (the demo's kinds, not "
            f"the uploads), {made}; float layers in {int8.get('float_precision')}. Fidelity on "
            f"{fid.get('images')} held-out images: mean cosine vs OpenVINO fp32 "
            f"{fid.get('mean_cosine', float('nan')):.6f} (bound >= "
            f"{fid.get('mean_cosine_bound')}; min {fid.get('min_cosine', float('nan')):.6f}, "
            f"not gated), {agreement}; {verdict}.{random_heads_text(int8.get('random_heads'))}")


def random_heads_text(random: dict | None) -> str:
    """The service store's random bots on the same held-out images: information, not gated."""
    if not random or not random.get("bots"):
        return ""
    name, lowest = random["lowest"]
    return (f" The run's {random['bots']} random bots on the same images (information, not a "
            f"target: random heads on a random trunk sit on near ties): lowest "
            f"{fmt(100 * lowest)} % ({name}), mean {fmt(100 * random['mean'])} %, "
            f"{random['below_bound']} below the bound.")


def targets(trunk: TrunkResult, results: Results) -> list[Target]:
    """Trunk speed by runtime and precision (SKIP on a CPU without bf16), then the INT8
    trunk's."""
    runtimes: dict[str, Any] = trunk.runtimes or {}
    fp32 = runtimes.get("tf-fp32") or {}
    no_bf16 = NO_BF16 if trunk.bf16_cpu is False else ""
    needs = ("trunk",)
    out = []
    for size in (1, 8):
        key = f"images_per_s_b{size}"
        # NOTE: float precisions only: int8 has targets of its own (`int8_targets`), and
        # counting it here would let int8 pass what bf16 must.
        best = max((float(r[key]) for name, r in runtimes.items()
                    if r.get(key) and not name.endswith("-int8")), default=None)
        out.append(Target.of(
            f"best_trunk_b{size}",
            f"best float runtime x precision >= 1.8 x TF fp32 at batch {size}",
            needs, ratio(best, fp32.get(key)), 1.8, ">=", "x", no_bf16))
    out.append(Target.of(
        "tf_bf16_b8", "TF bf16 >= 1.5 x TF fp32 at batch 8", needs,
        ratio((runtimes.get("tf-bf16") or {}).get("images_per_s_b8"),
              fp32.get("images_per_s_b8")), 1.5, ">=", "x", no_bf16))
    out = [replace(t, status=SKIP) for t in out] if trunk.bf16_cpu is False else out
    return out + int8_targets(trunk)


def int8_targets(trunk: TrunkResult) -> list[Target]:
    """The INT8 trunk against OpenVINO fp32 (any x86 CPU) and bf16 (where the CPU has it) at
    batch 8, and its gate within the bounds of `multihead quantize`: the mean cosine, the
    lowest of the bots trained on generated images (`bench.int8`) and all their answers. SKIP
    (saying why) where the run could not make an INT8 trunk or the CPU has no bf16."""
    from backbone.gate import MIN_HEAD_AGREEMENT, MIN_MEAN_COSINE, MIN_OVERALL_AGREEMENT

    runtimes: dict[str, Any] = trunk.runtimes or {}
    int8 = trunk.int8 or {}
    rate = (runtimes.get("openvino-int8") or {}).get("images_per_s_b8")
    fid = int8.get("fidelity") or {}
    head, lowest = lowest_agreement(fid)
    needs = ("trunk",)
    cannot = int8.get("skipped", "")

    def skip_if(target: Target, why: str) -> Target:
        return replace(target, status=SKIP, note=why) if why else target

    fp32 = (runtimes.get("openvino-fp32") or {}).get("images_per_s_b8")
    bf16 = (runtimes.get("openvino-bf16") or {}).get("images_per_s_b8")
    return [
        skip_if(Target.of(
            "int8_vs_fp32_b8", f"OpenVINO int8 >= {INT8_OVER_FP32} x OpenVINO fp32 at batch 8",
            needs, ratio(rate, fp32), INT8_OVER_FP32, ">=", "x",
            note("{:.1f} vs {:.1f} images/s", rate, fp32)), cannot),
        skip_if(Target.of(
            "int8_vs_bf16_b8", f"OpenVINO int8 >= {INT8_OVER_BF16} x OpenVINO bf16 at batch 8",
            needs, ratio(rate, bf16), INT8_OVER_BF16, ">=", "x",
            note("{:.1f} vs {:.1f} images/s", rate, bf16)),
            cannot or (f"{NO_BF16}: no OpenVINO bf16 to compare with"
                       if trunk.bf16_cpu is False else "")),
        skip_if(Target.of(
            "int8_mean_cosine", "INT8 trunk's mean cosine vs fp32 on held-out images", needs,
            fid.get("mean_cosine"), MIN_MEAN_COSINE, ">=", "",
            note("{:.6f} on {:.0f} held-out images (min {:.6f}, not gated)",
                 fid.get("mean_cosine"), fid.get("images"), fid.get("min_cosine"))), cannot),
        skip_if(Target.of(
            "int8_top1_agreement", "INT8 trunk's top-1 agreement with fp32, lowest bot "
            "trained on generated images", needs, lowest, MIN_HEAD_AGREEMENT, ">=", "",
            f"{head}, {len(fid.get('agreement') or {})} bots" if head else ""), cannot),
        skip_if(Target.of(
            "int8_all_answers", "INT8 trunk's top-1 agreement with fp32 over all those bots' "
            "answers", needs, fid.get("overall_agreement"), MIN_OVERALL_AGREEMENT, ">=", ""),
            cannot),
    ]


SECTION = Section("trunk", TrunkResult, run, render, targets)
