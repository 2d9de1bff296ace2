"""Section `fanout`: one image scored by 1 bot vs by 10 bots in one `POST /classify?bots=...`,
on a server of the service section's kind (mixed batching, feature cache off), the two kinds of
request alternating so that drift in the machine's load hits both alike."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.context import Context, say
from bench.markdown import fmt, table
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.stats import num, ratio, summarize


@dataclass
class FanoutResult(Result):
    n_bots: int | None = None
    single: dict = field(default_factory=dict)  # latency summary of 1-bot requests
    fanout: dict = field(default_factory=dict)  # latency summary of n_bots-bot requests
    ratio_p50: float | None = None


async def measure(context: Context, url: str, bots: Sequence[str]) -> FanoutResult:
    """Single-bot and fan-out requests in turn, one at a time, each with a distinct image."""
    from bench.load import sequential

    plan = context.plan
    n_bots = min(plan.fanout_bots, len(bots))
    fan = ",".join(bots[:n_bots])
    requests, kinds = [], []
    image = 0
    for _ in range(plan.fanout_requests):
        for kind, path in (("single", f"/classify/{bots[0]}"),
                           ("fanout", f"/classify?bots={fan}")):
            requests.append((path, context.jpegs[image % len(context.jpegs)]))
            kinds.append(kind)
            image += 1
    with context.bar(len(requests), "fan-out") as bar:
        records = await sequential(url, requests, bar.update)
    bad = [r.status for r in records if r.status != 200]
    if bad:
        raise RuntimeError(f"fan-out requests failed with statuses {sorted(set(bad))}")
    single = summarize([r.latency_s for r, k in zip(records, kinds) if k == "single"])
    fanout = summarize([r.latency_s for r, k in zip(records, kinds) if k == "fanout"])
    say(f"fan-out: 1 bot p50 {single['p50_ms']:.0f} ms, {n_bots} bots p50 "
        f"{fanout['p50_ms']:.0f} ms")
    return FanoutResult(n_bots=n_bots, single=single, fanout=fanout,
                        ratio_p50=ratio(fanout["p50_ms"], single["p50_ms"]))


def run(context: Context) -> FanoutResult:
    from bench.sections.service import warm_up

    store, bots = context.service_store()
    server = context.start(context.server("fanout", store, **{"batch-policy": "mixed",
                                                               "feature-cache-size": 0}))
    try:
        asyncio.run(warm_up(context, server.url, bots))
        return asyncio.run(measure(context, server.url, bots))
    finally:
        server.stop()


def render(fan: FanoutResult, results: Results) -> str:
    out = ["## Fan-out (one distinct image per request, trunk included)", ""]
    out += table(["bots per request", "requests", "p50 ms", "p95 ms", "mean ms"],
                 [[1, fan.single.get("n"), fan.single.get("p50_ms"), fan.single.get("p95_ms"),
                   fan.single.get("mean_ms")],
                  [fan.n_bots, fan.fanout.get("n"), fan.fanout.get("p50_ms"),
                   fan.fanout.get("p95_ms"), fan.fanout.get("mean_ms")]])
    out += ["", f"Ratio {fmt(fan.ratio_p50)} (p50).", ""]
    return "\n".join(out)


def targets(fan: FanoutResult, results: Results) -> list[Target]:
    single = num(fan.single.get("p50_ms"))
    return [Target.of("fanout", "10-bot fan-out <= 1.2 x single-bot latency (p50)", ("fanout",),
                      ratio(num(fan.fanout.get("p50_ms")), single), 1.2, "<=", "x",
                      note("single-bot p50 {:.1f} ms", single))]


SECTION = Section("fanout", FanoutResult, run, render, targets)
