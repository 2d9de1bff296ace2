"""The load and the numbers of the deadlines section (`bench.sections.deadlines`): a bursty
open-loop trace of two tenants with deadlines of their own (`trace_load`), and what it gave
(`trace_summary`, pure: tested on constructed calls in tests/bench/test_deadlines.py).

The trace: arrivals of a Poisson process with bursts (`bench.stats.bursty_arrivals`), each one
request of one image, drawn for the interactive tenant with probability `share` and for the
batch tenant otherwise (seeded). Every request is sent at its scheduled time whatever the
server is doing (open loop), and its latency counts from that time.

Nothing here imports TensorFlow or the service; aiohttp is imported by the function that posts.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from bench.sections.fairness_load import Call, ImagePool, post_images
from bench.stats import summarize

DEADLINE_HEADER = "X-Multihead-Deadline-Ms"
UNMEETABLE = "deadline_unmeetable"  # the code of a request refused at admission


def trace(arrivals: np.ndarray, tenants: Sequence[str], share: float,
          seed: int = 0) -> list[tuple[float, str]]:
    """(time, tenant) of every arrival: `tenants[0]` with probability `share`, else
    `tenants[1]`."""
    rng = np.random.default_rng(seed + 1)
    first = rng.random(len(arrivals)) < share
    return [(float(t), tenants[0] if f else tenants[1]) for t, f in zip(arrivals, first)]


async def trace_load(url: str, jpegs: Sequence[bytes], bots: Mapping[str, str],
                     schedule: Sequence[tuple[float, str]], deadlines_ms: Mapping[str, float],
                     *, send_deadlines: bool, timeout_s: float = 60.0) -> dict:
    """Sends `schedule` ((seconds from now, tenant), sorted) to the server at `url`, each
    request one image to `bots[tenant]`, with the header `X-Multihead-Deadline-Ms` of its
    tenant's deadline when `send_deadlines`; waits for every answer (a client gives up after
    `timeout_s`). Returns {"calls": [Call] (start: the scheduled time), "begin", "end": the
    trace's span (perf_counter), "late_rows": {tenant: trunk rows that ended after their
    deadline, by the server's multihead_tenant_rows_late_total over the trace},
    "expired_rows": {tenant: trunk rows whose deadline had passed when the trunk started,
    by its multihead_tenant_rows_run_expired_total}}."""
    from bench.load import client_session
    from bench.prometheus import by_labels

    pool = ImagePool(jpegs)
    calls: list[Call] = []
    async with client_session(limit=0) as session:
        before = await _metrics(session, url)

        async def one(at: float, tenant: str, image: bytes) -> None:
            headers = ({DEADLINE_HEADER: f"{deadlines_ms[tenant]:g}"} if send_deadlines
                       else None)
            status, code, retry_after = await post_images(
                session, f"{url}/classify/{bots[tenant]}", [image], timeout_s=timeout_s,
                headers=headers)
            calls.append(Call(tenant, at, time.perf_counter(), status, code, retry_after))

        t0 = time.perf_counter() + 0.05
        tasks = []
        for at, tenant in schedule:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(t0 + at, tenant, pool.take(1)[0])))
        await asyncio.gather(*tasks)
        after = await _metrics(session, url)
    end = t0 + (schedule[-1][0] if schedule else 0.0)

    def grown(name: str) -> dict[str, float]:
        was = by_labels(before, name)
        return {t: n - was.get(t, 0.0) for t, n in by_labels(after, name).items()
                if n - was.get(t, 0.0)}

    return {"calls": calls, "begin": t0, "end": end,
            "late_rows": grown("multihead_tenant_rows_late_total"),
            "expired_rows": grown("multihead_tenant_rows_run_expired_total")}


async def _metrics(session, url: str) -> str:
    async with session.get(f"{url}/metrics") as response:
        return await response.text() if response.status == 200 else ""


def tenant_summary(calls: Sequence[Call], deadline_ms: float, span_s: float) -> dict:
    """One tenant's requests of a trace: sent; refused at admission (504
    deadline_unmeetable); admitted (the rest); answered (200); within its deadline (200 no
    later than `deadline_ms` after its scheduled time); late (200 after it: the trunk's work
    for a row past its deadline, the feature cache being off); the share of the admitted
    answered in time; goodput (answers in time per second of `span_s`); latency of the 200s;
    the statuses."""
    limit = deadline_ms / 1000.0
    ok = [c for c in calls if c.status == 200]
    within = sum(1 for c in ok if c.end - c.start <= limit)
    refused = sum(1 for c in calls if c.status == 504 and c.code == UNMEETABLE)
    admitted = len(calls) - refused
    latency = summarize([c.end - c.start for c in ok])
    return {"deadline_ms": deadline_ms, "sent": len(calls), "refused_at_admission": refused,
            "admitted": admitted, "answered": len(ok), "within": within,
            "late": len(ok) - within,
            "met_of_admitted": within / admitted if admitted else float("nan"),
            "goodput_per_s": within / span_s if span_s > 0 else float("nan"),
            **{k: v for k, v in latency.items() if k != "n"},
            "statuses": dict(sorted(Counter(c.label for c in calls).items()))}


def trace_summary(calls: Sequence[Call], deadlines_ms: Mapping[str, float],
                  span_s: float, late_rows: Mapping[str, float] | None = None,
                  expired_rows: Mapping[str, float] | None = None) -> dict:
    """Per tenant (`tenant_summary`) and in all: goodput (answers within their tenant's
    deadline per second of `span_s`), late answers as the clients saw them, and the server's
    trunk rows that ended after their deadline (`late_rows`) and that it ran past their
    deadline (`expired_rows`: the deadline had passed when the trunk started); the server
    knows only the deadlines sent."""
    tenants = {t: tenant_summary([c for c in calls if c.tenant == t], ms, span_s)
               for t, ms in deadlines_ms.items()}
    return {"span_s": span_s, "tenants": tenants,
            "goodput_per_s": sum(s["goodput_per_s"] for s in tenants.values()),
            "late": sum(s["late"] for s in tenants.values()),
            "late_rows": dict(late_rows or {}),
            "trunk_rows_late": sum((late_rows or {}).values()),
            "trunk_rows_expired": sum((expired_rows or {}).values()),
            "sent": sum(s["sent"] for s in tenants.values())}
