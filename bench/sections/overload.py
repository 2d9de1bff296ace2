"""Section `overload`: N concurrent uploads of a 640x480 JPEG followed by 10 MB of trailing
bytes to one `multihead serve` (default settings: 256 MiB of request bytes in flight): server
RSS at start, peak and after; how many were answered and how many refused (503 + Retry-After)
before their body was read, and whether any answer was wrong.

"start" is the server's RSS after a warm-up burst of distinct images (full trunk batches have
run, so the trunk's working memory is part of it). RSS is the server process's own VmRSS,
sampled every 20 ms by a thread of this process, plus VmHWM after its reset through
/proc/<pid>/clear_refs where the kernel allows it.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from bench.context import Context
from bench.markdown import mb, table
from bench.memory import RssSampler, reset_peak, settle_rss, vm_hwm
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.stats import num, ratio

MIB = 1024 * 1024
TRAILING_BYTES = 10 * 1000 * 1000
INFLIGHT_BUDGET_BYTES = 256 * MIB  # the server's default max_inflight_bytes


@dataclass
class OverloadResult(Result):
    uploads: int | None = None
    upload_bytes: int | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    wrong_answers: int | None = None
    refused_without_retry_after: int | None = None
    elapsed_s: float | None = None
    rss_start_bytes: int | None = None
    rss_peak_bytes: int | None = None
    rss_after_bytes: int | None = None
    budget_bytes: int | None = None
    peak_over_start_bytes: int | None = None
    peak_limit_bytes: int | None = None
    after_over_start: float | None = None


async def overload(url: str, pid: int, jpegs: list[bytes], uploads: int,
                   bot: str) -> OverloadResult:
    """`uploads` concurrent oversized uploads to `bot` on the server at `url` (process `pid`)."""
    from bench.load import client_session

    jpeg = jpegs[0]
    body = jpeg + b"\0" * TRAILING_BYTES  # one buffer shared by every upload of the client
    statuses: dict[str, int] = {}
    wrong = 0
    retry_after_missing = 0
    async with client_session(limit=0) as session:
        async def classify(image: bytes) -> list:
            async with session.post(f"{url}/classify/{bot}", data=image,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                return (await resp.json())["results"][0]["predictions"]

        # Warm-up: distinct images at once, so full trunk batches have run and the trunk's
        # working memory at max_batch_size is part of "start" (it is steady state, not load).
        reference = (await asyncio.gather(*(classify(j) for j in jpegs)))[0]
        await asyncio.sleep(1.0)
        rss_start = await settle_rss(pid, 1.0)
        hwm_reset = reset_peak(pid)

        async def one() -> None:
            nonlocal wrong, retry_after_missing
            async with session.post(f"{url}/classify/{bot}", data=body,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                payload = await resp.read()
                statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1
                if resp.status == 200:
                    got = json.loads(payload)["results"][0]["predictions"]
                    wrong += [p["label"] for p in got] != [p["label"] for p in reference]
                elif resp.status == 503 and "Retry-After" not in resp.headers:
                    retry_after_missing += 1

        t0 = time.monotonic()
        with RssSampler(pid) as sampler:
            await asyncio.gather(*(one() for _ in range(uploads)), return_exceptions=False)
            elapsed = time.monotonic() - t0
            rss_after = await settle_rss(pid, 3.0)
    peak = max(sampler.peak, vm_hwm(pid) if hwm_reset else 0)
    return OverloadResult(
        uploads=uploads, upload_bytes=len(body), statuses=statuses, wrong_answers=wrong,
        refused_without_retry_after=retry_after_missing, elapsed_s=elapsed,
        rss_start_bytes=rss_start, rss_peak_bytes=peak, rss_after_bytes=rss_after,
        budget_bytes=INFLIGHT_BUDGET_BYTES, peak_over_start_bytes=peak - rss_start,
        peak_limit_bytes=int(INFLIGHT_BUDGET_BYTES * 1.25),
        after_over_start=(rss_after - rss_start) / rss_start if rss_start else None)


def run(context: Context) -> OverloadResult:
    store, ids = context.bot_store("overload", 4)
    server = context.start(context.server("overload", store))
    try:
        return asyncio.run(overload(server.url, server.pid, context.jpegs[:32],
                                    context.plan.overload_uploads, ids[0]))
    finally:
        server.stop()


def render(result: OverloadResult, results: Results) -> str:
    out = [f"## Overload: {result.uploads} concurrent uploads of "
           f"{num(result.upload_bytes) / 1e6:.1f} MB to one server", ""]
    out += table(["RSS start", "RSS peak", "RSS after", "in-flight budget", "answers",
                  "wrong", "elapsed s"],
                 [[mb(result.rss_start_bytes), mb(result.rss_peak_bytes),
                   mb(result.rss_after_bytes), mb(result.budget_bytes),
                   ", ".join(f"{k}: {v}" for k, v in sorted(result.statuses.items())),
                   result.wrong_answers, result.elapsed_s]])
    out += [""]
    return "\n".join(out)


def targets(result: OverloadResult, results: Results) -> list[Target]:
    start, budget = num(result.rss_start_bytes), num(result.budget_bytes)
    return [
        Target.of("overload_peak",
                  "RSS peak under N x 10 MB uploads <= start + 1.25 x in-flight budget",
                  ("overload",), result.rss_peak_bytes, start + 1.25 * budget, "<=", "bytes",
                  note("start {:.0f} MB, budget {:.0f} MB", start / 1e6, budget / 1e6)),
        Target.of("overload_after", "RSS after the uploads <= 1.10 x start", ("overload",),
                  ratio(num(result.rss_after_bytes), start), 1.10, "<=", "x"),
        Target.of("overload_wrong", "wrong answers under overload == 0", ("overload",),
                  result.wrong_answers, 0, "<=", ""),
    ]


SECTION = Section("overload", OverloadResult, run, render, targets)
