"""Section `scale`: 10..10,000 registered heads: registration time, server RSS per resident
head, first request to a cold bot vs a warm one."""
from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.bots import bot_id, head_weight_bytes, register_bots
from bench.context import Context, say
from bench.markdown import fmt, kb, table
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.stats import num, ratio, summarize

MIB = 1024 * 1024


@dataclass
class ScaleResult(Result):
    classes: int | None = None
    weight_bytes_per_bot: int | None = None
    # {bots, register: latency summary, touched, rss_bytes, rss_growth_per_bot_bytes,
    # rss_growth_ratio, resident_heads, resident_head_bytes} per level
    levels: list[dict] = field(default_factory=list)
    registrations: int | None = None
    registration_p50_ms: float | None = None
    registration_p99_ms: float | None = None
    touched: int | None = None
    rss_base_bytes: int | None = None
    rss_end_bytes: int | None = None
    rss_growth_per_bot_bytes: float | None = None
    rss_growth_ratio: float | None = None
    cold: dict = field(default_factory=dict)
    warm: dict = field(default_factory=dict)
    latency_method: str = ""
    heads_memory_mb: int | None = None
    method: str = ""


def register_levels(context: Context, store_dir: Path) -> ScaleResult:
    """Registers bots level by level into a new store; times each `HeadStore.register`."""
    from store import HeadStore

    plan = context.plan
    levels = sorted(set(plan.scale_levels))
    result = ScaleResult(classes=plan.classes, weight_bytes_per_bot=head_weight_bytes(
        plan.classes))
    # Not timed: the first registration of a process imports TensorFlow (to write the head's
    # checkpoint) and sets up its eager context, which no later registration pays again.
    register_bots(Path(store_dir).with_name(Path(store_dir).name + "-warmup"), 2,
                  plan.classes, plan.seed)
    all_times: list[float] = []
    store = HeadStore(store_dir)
    try:
        with context.bar(levels[-1], "register") as bar:
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
                result.levels.append({"bots": level, "register": summarize(times)})
    finally:
        store.close()
    reg = summarize(all_times)
    result.registrations = len(all_times)
    result.registration_p50_ms, result.registration_p99_ms = reg["p50_ms"], reg["p99_ms"]
    say(f"registration p50 {reg['p50_ms']:.1f} ms, p99 {reg['p99_ms']:.1f} ms over "
        f"{len(all_times)} heads")
    return result


async def touch_levels(context: Context, url: str, read_rss: Callable[[], int],
                       result: ScaleResult) -> None:
    """Loads the registered bots into the server level by level, through HTTP, with ONE
    image whose features are cached after the first request: what each request costs, and
    what the server's RSS (`read_rss()`) grows by, is the head alone. Fills `result`."""
    from bench.load import concurrent, scrape_metrics, sequential

    plan = context.plan
    weight_bytes = result.weight_bytes_per_bot
    touch_max = min(result.levels[-1]["bots"], plan.scale_touch_max)
    anchor = context.jpegs[0]
    rng = np.random.default_rng(plan.seed)
    await sequential(url, [(f"/classify/{bot_id(0)}", anchor)] * 20)  # trunk once, then cache
    rss0 = rss_prev = read_rss()
    touched = 1
    cold, warm = [], []
    for entry in result.levels:
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
        with context.bar(len(new) + n_cold, f"touch {target} bots") as bar:
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
    result.touched, result.rss_base_bytes, result.rss_end_bytes = touched, rss0, rss_prev
    result.rss_growth_per_bot_bytes = overall
    result.rss_growth_ratio = overall / weight_bytes
    result.cold, result.warm = summarize(cold), summarize(warm)
    result.latency_method = ("both through HTTP with cached features: the difference is "
                             "loading the head from the store.")
    say(f"scale: RSS growth {overall / 1e3:.0f} kB per bot ({overall / weight_bytes:.2f} x "
        f"weights); cold p50 {result.cold['p50_ms']:.1f} ms vs warm "
        f"{result.warm['p50_ms']:.1f} ms")


def run(context: Context) -> ScaleResult:
    plan = context.plan
    store_dir = context.tmp / "scale-store"
    result = register_levels(context, store_dir)
    context.share_graph_cache(store_dir)
    # One server over the largest store; its heads budget holds every bot we touch.
    touch_max = min(result.levels[-1]["bots"], plan.scale_touch_max)
    head_nbytes = result.weight_bytes_per_bot + plan.classes * 60  # + label strings
    budget_mb = int(math.ceil(touch_max * head_nbytes * 1.25 / MIB)) + 64
    server = context.start(context.server("scale", store_dir, **{
        "heads-memory-mb": budget_mb, "feature-cache-size": 16}))
    try:
        asyncio.run(touch_levels(context, server.url, server.rss_bytes, result))
    finally:
        server.stop()
    result.heads_memory_mb = budget_mb
    result.method = (
        f"server process VmRSS before and after touching each bot once through HTTP (one "
        f"image whose trunk features are cached, so only heads load); {result.touched} "
        f"of {result.levels[-1]['bots']} registered bots touched, heads budget "
        f"{budget_mb} MiB so all stay resident.")
    return result


def render(scale: ScaleResult, results: Results) -> str:
    out = [f"## Bot scale (heads of {scale.classes} classes, "
           f"{kb(scale.weight_bytes_per_bot)} of weights each)", ""]
    rows = []
    for lv in scale.levels:
        rows.append([lv["bots"], lv["register"]["p50_ms"], lv["register"]["p99_ms"],
                     lv.get("touched"), kb(lv.get("rss_growth_per_bot_bytes")),
                     lv.get("rss_growth_ratio"), lv.get("resident_heads")])
    out += table(["registered bots", "register p50 ms", "register p99 ms",
                  "touched via server", "RSS growth per bot", "× weight bytes",
                  "resident heads"], rows)
    cold, warm = scale.cold, scale.warm
    out += ["", f"RSS: {scale.method} Overall "
            f"{kb(scale.rss_growth_per_bot_bytes)} per bot = "
            f"{fmt(scale.rss_growth_ratio)} × weight bytes. "
            f"Registration p50 over all {scale.registrations} registrations: "
            f"{fmt(scale.registration_p50_ms)} ms (p99 {fmt(scale.registration_p99_ms)} ms).",
            f"First request to a cold bot (head not resident): p50 {fmt(cold.get('p50_ms'))}"
            f" ms, p95 {fmt(cold.get('p95_ms'))} ms (n={cold.get('n')}); warm bot: p50 "
            f"{fmt(warm.get('p50_ms'))} ms, p95 {fmt(warm.get('p95_ms'))} ms "
            f"(n={warm.get('n')}); {scale.latency_method}", ""]
    return "\n".join(out)


def targets(scale: ScaleResult, results: Results) -> list[Target]:
    weight_bytes = num(scale.weight_bytes_per_bot)
    growth = num(scale.rss_growth_per_bot_bytes)
    warm = num(scale.warm.get("p50_ms"))
    return [
        Target.of("rss_per_bot", "server RSS growth per bot <= 1.5 x its weight bytes",
                  ("scale",), ratio(growth, weight_bytes), 1.5, "<=", "x",
                  note("{:.0f} kB per bot vs {:.0f} kB of weights", growth / 1e3,
                       weight_bytes / 1e3)),
        Target.of("registration_p50", "registration p50 <= 20 ms", ("scale",),
                  scale.registration_p50_ms, 20.0, "<=", "ms"),
        Target.of("cold_bot", "cold-bot first request <= warm + 20 ms", ("scale",),
                  scale.cold.get("p50_ms"), warm + 20.0, "<=", "ms",
                  note("warm p50 {:.1f} ms", warm)),
    ]


SECTION = Section("scale", ScaleResult, run, render, targets)
