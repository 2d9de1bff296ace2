"""Section `soak`: minutes of mixed traffic (valid uploads over several bots, malformed bodies,
OIP v2 and TF Serving requests, oversized bodies) from a few clients to one `multihead serve`;
the server's RSS (VmRSS) is sampled every second throughout: it must stay flat."""
from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from dataclasses import dataclass, field

from bench.context import Context
from bench.markdown import mb, table
from bench.memory import RssSampler, settle_rss
from bench.result import Result
from bench.sections.base import Results, Section, Target
from bench.stats import num, ratio


@dataclass
class SoakResult(Result):
    duration_s: float | None = None
    clients: int | None = None
    requests: int | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    rss_start_bytes: int | None = None
    rss_end_bytes: int | None = None
    rss_max_bytes: int | None = None
    rss_first_half_mean_bytes: float | None = None
    rss_second_half_mean_bytes: float | None = None
    rss_series: list = field(default_factory=list)  # [(seconds, bytes)]


def soak_request(rng: random.Random, jpegs: list[bytes], bots: list[str]):
    """(method, path, headers, body) of one soak request: mostly valid, some hostile."""
    jpeg = rng.choice(jpegs)
    bot = rng.choice(bots)
    kind = rng.randrange(10)
    if kind < 5:
        return "POST", f"/classify/{bot}?top_k=3", {"Content-Type": "image/jpeg"}, jpeg
    if kind == 5:
        body = json.dumps({"inputs": [{"name": "image_bytes", "datatype": "BYTES",
                                       "shape": [1],
                                       "data": [base64.b64encode(jpeg).decode()]}]}).encode()
        return "POST", f"/v2/models/{bot}/infer", {"Content-Type": "application/json"}, body
    if kind == 6:
        body = json.dumps({"instances": [{"b64": base64.b64encode(jpeg).decode()}]}).encode()
        return "POST", f"/v1/models/{bot}:predict", {"Content-Type": "application/json"}, body
    if kind == 7:  # broken multipart
        return ("POST", f"/classify/{bot}", {"Content-Type": "multipart/form-data; boundary=x"},
                b"--x\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\n" + jpeg[:500])
    if kind == 8:  # deep JSON
        return ("POST", f"/v2/models/{bot}/infer", {"Content-Type": "application/json"},
                b'{"inputs": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    return ("POST", f"/classify/{bot}", {"Content-Type": "image/jpeg"},  # corrupt image
            jpeg[:len(jpeg) // 3])


async def soak(url: str, pid: int, jpegs: list[bytes], bots: list[str], duration_s: float,
               clients: int, seed: int) -> SoakResult:
    """`clients` clients sending `soak_request`s for `duration_s` to the server at `url`."""
    from bench.load import client_session

    rng = random.Random(seed)
    statuses: dict[str, int] = {}
    async with client_session(limit=0) as session:
        for jpeg in jpegs[:4]:  # warm the path before the first RSS sample
            async with session.post(f"{url}/classify/{bots[0]}", data=jpeg,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                await resp.read()
        rss_start = await settle_rss(pid, 1.0)
        end = time.monotonic() + duration_s

        async def client() -> None:
            while time.monotonic() < end:
                method, path, headers, body = soak_request(rng, jpegs, bots)
                async with session.request(method, f"{url}{path}", data=body,
                                           headers=headers) as resp:
                    await resp.read()
                    statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1

        with RssSampler(pid, period_s=1.0) as sampler:
            await asyncio.gather(*(client() for _ in range(clients)))
        rss_end = await settle_rss(pid, 2.0)
    series = sampler.series
    tail = [r for t, r in series if t >= duration_s / 2] or [rss_end]
    head = [r for t, r in series if t < duration_s / 2] or [rss_start]
    return SoakResult(
        duration_s=duration_s, clients=clients, requests=sum(statuses.values()),
        statuses=statuses, rss_start_bytes=rss_start, rss_end_bytes=rss_end,
        rss_max_bytes=max(r for _, r in series) if series else rss_end,
        rss_first_half_mean_bytes=sum(head) / len(head),
        rss_second_half_mean_bytes=sum(tail) / len(tail),
        rss_series=[(round(t, 1), r) for t, r in series])


def run(context: Context) -> SoakResult:
    plan = context.plan
    store, ids = context.bot_store("soak", 20)
    server = context.start(context.server("soak", store))
    try:
        return asyncio.run(soak(server.url, server.pid, context.jpegs, ids, plan.soak_s,
                                plan.soak_clients, plan.seed))
    finally:
        server.stop()


def render(result: SoakResult, results: Results) -> str:
    out = [f"## Soak: {num(result.duration_s):.0f} s of mixed valid and hostile traffic, "
           f"{result.clients} clients", ""]
    out += table(["requests", "statuses", "RSS start", "RSS 1st half mean",
                  "RSS 2nd half mean", "RSS max", "RSS end"],
                 [[result.requests,
                   ", ".join(f"{k}: {v}" for k, v in sorted(result.statuses.items())),
                   mb(result.rss_start_bytes), mb(result.rss_first_half_mean_bytes),
                   mb(result.rss_second_half_mean_bytes), mb(result.rss_max_bytes),
                   mb(result.rss_end_bytes)]])
    out += [""]
    return "\n".join(out)


def targets(result: SoakResult, results: Results) -> list[Target]:
    return [Target.of("soak_flat", "soak: RSS mean of the 2nd half <= 1.10 x the 1st half's",
                      ("soak",), ratio(num(result.rss_second_half_mean_bytes),
                                       num(result.rss_first_half_mean_bytes)), 1.10, "<=", "x")]


SECTION = Section("soak", SoakResult, run, render, targets)
