"""The numbers of the fairness section (`bench.sections.fairness`), from its load's `Call`s and
the server's /metrics (read by `bench.prometheus`): per tenant over a window (`call_stats`,
`batch_rates`), a flood's summary (`flood_summary`), the quota's (`quota_summary`), and the raw
trunk's batch to compare with (`raw_batch`). Pure functions of what was recorded: tested on
constructed calls (tests/bench/test_fairness.py).

The quota's measured rate: the images accepted between the first and the last refusal of the
run, divided by the time between them, corrected by the bucket's level at both refusals as
their Retry-After implies it (a refusal means the bucket held less than a request's images,
`need`; Retry-After = ceil((need - level) / R), at least 1, pins the level within R images). So
the estimate is off by at most min(need, R) images over the window, where "accepted images /
window" could be off by a whole request plus a second of the rate; that plain count is shown
too.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from bench.markdown import fmt
from bench.prometheus import by_labels, histograms
from bench.sections.fairness_load import LIMITED, QUIET, Call
from bench.stats import num, summarize


def call_stats(calls: Sequence[Call], begin: float, end: float) -> dict:
    """Requests SENT in [begin, end): count, statuses and the latency of the answered ones
    (ms); images/s of those ANSWERED (200) in (begin, end] (`answered_images` / its length)."""
    sent = [c for c in calls if begin <= c.start < end]
    ok = [c for c in sent if c.status == 200]
    done = sum(c.images for c in calls if c.status == 200 and begin < c.end <= end)
    span = end - begin
    latency = summarize([c.end - c.start for c in ok])
    return {"requests": len(sent), "answered": len(ok), "answered_images": done,
            "images_per_s": done / span if span > 0 else math.nan,
            **{k: v for k, v in latency.items() if k != "n"},
            "statuses": dict(sorted(Counter(c.label for c in sent).items()))}


def batch_rates(calls: Sequence[Call], begin: float, end: float,
                gap_s: float) -> tuple[dict[str, float], float | None]:
    """({tenant: images/s}, seconds measured) from the answers (200) in (begin, end], counted
    from the first trunk batch's answers to the last one's: a batch's answers come together,
    and "answered in the window / window" would be off by up to a whole batch (16 images in
    a 30 s window on 2 cores: 13 %). Answers less than `gap_s` apart are one batch's (half a
    batch's run: the worker runs one at a time); the images of the batches after the first,
    over the time from the first batch to the last. ({}, None) with fewer than two batches."""
    answers = sorted((c.end, c.tenant, c.images) for c in calls
                     if c.status == 200 and begin < c.end <= end)
    if len(answers) < 2:
        return {}, None
    gaps = [b[0] - a[0] for a, b in zip(answers, answers[1:])]
    firsts = [i + 1 for i, g in enumerate(gaps) if g > gap_s]  # where each later batch begins
    if not firsts:
        return {}, None
    span = answers[firsts[-1]][0] - answers[0][0]
    rates: dict[str, float] = {}
    for _, tenant, images in answers[firsts[0]:]:
        rates[tenant] = rates.get(tenant, 0.0) + images / span
    return rates, span


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
            if v - before.get(k, 0.0)}


def flood_summary(data: Mapping, clients: Mapping[str, int]) -> dict:
    """A flood's numbers: per tenant (images/s by `batch_rates`, half the server's mean trunk
    time per batch telling batches apart), the quiet tenants pooled, the total, and the
    server's own over the window (batches, trunk and heads per batch, trunk images per
    tenant)."""
    begin, end = data["window"]
    calls = data["calls"]
    tenants = {t: {"clients": n, **call_stats([c for c in calls if c.tenant == t], begin, end)}
               for t, n in clients.items()}
    quiet = call_stats([c for c in calls if c.tenant in QUIET], begin, end)
    out: dict = {"window_s": end - begin, "tenants": tenants, "quiet": quiet}
    before, after = data.get("before") or "", data.get("after") or ""
    if after:
        hb, ha = histograms(before), histograms(after)

        def delta(name: str):
            return ha[name].minus(hb.get(name)) if name in ha else None

        size = delta("multihead_batch_size")
        trunk, heads = delta("multihead_trunk_seconds"), delta("multihead_heads_seconds")
        out.update(batches=size.count if size else None,
                   mean_batch_size=size.mean if size else None,
                   server_trunk_ms=1000 * trunk.mean if trunk else None,
                   server_heads_ms=1000 * heads.mean if heads else None,
                   served=_delta(by_labels(after, "multihead_tenant_images_total"),
                                 by_labels(before, "multihead_tenant_images_total")),
                   refused=_delta(by_labels(after, "multihead_tenant_refusals_total"),
                                  by_labels(before, "multihead_tenant_refusals_total")))
    trunk_ms = num(out.get("server_trunk_ms"))
    rates, span = ({}, None) if math.isnan(trunk_ms) else batch_rates(calls, begin, end,
                                                                       trunk_ms / 2000)
    if span:
        for tenant, stats in tenants.items():
            stats["images_per_s"] = rates.get(tenant, 0.0)
        quiet["images_per_s"] = sum(rates.get(t, 0.0) for t in QUIET)
    # Without two batches told apart: answered in the window / the window.
    out.update(measured_s=span or end - begin,
               total_images_per_s=sum(s["images_per_s"] for s in tenants.values()))
    return out


def bucket_level(retry_after_s: float, rate: float, need: int) -> float:
    """The bucket's level at a refusal of a request needing `need` tokens (its images, at most
    the burst: the level is never below 0 then), answered with `retry_after_s` = max(1,
    ceil((need - level) / rate)): the middle of the levels in [0, need) that give it."""
    low = max(0.0, need - rate * retry_after_s)
    high = min(float(need), need - rate * (retry_after_s - 1))
    return (low + high) / 2 if high > low else low


def _proper(c: Call) -> bool:
    """A refusal as a quota's should be: 429 rate_limited with Retry-After."""
    return c.status == 429 and c.code == "rate_limited" and c.retry_after_s is not None


def quota_summary(calls: Sequence[Call], first_429: float | None, rate: float, burst: int,
                  images_per_request: int, window_s: float) -> dict:
    """The limited tenant's numbers: its refusals over the whole run (any not a proper one,
    any honoured retry refused again); the images it had accepted in the `window_s` from its
    first 429 (the plain count); and its accepted rate from that 429 to its last refusal (the
    run stops at the first one after the window), corrected by the bucket's level at both (see
    the module doc)."""
    mine = [c for c in calls if c.tenant == LIMITED]
    refusals = [c for c in mine if c.status != 200]
    out: dict = {
        "rate": rate, "burst": burst, "images_per_request": images_per_request,
        "window_s": window_s, "requests": len(mine), "refusals": len(refusals),
        "refusals_improper": sum(1 for c in refusals if not _proper(c)),
        "retries": sum(1 for c in mine if c.retry),
        "retries_refused": sum(1 for c in mine if c.retry and c.status != 200),
        "statuses": dict(sorted(Counter(c.label for c in mine).items())),
        "retry_after_s": dict(sorted(Counter(
            fmt(c.retry_after_s) for c in refusals if c.retry_after_s is not None).items())),
    }
    if first_429 is None:
        return out
    accepted = sum(c.images for c in mine
                   if c.status == 200 and first_429 <= c.start < first_429 + window_s)
    out.update(accepted_images=accepted, plain_images_per_s=accepted / window_s)
    bounds = [c for c in mine if _proper(c) and c.start >= first_429]
    if len(bounds) >= 2 and bounds[-1].start > bounds[0].start:
        first, last = bounds[0], bounds[-1]
        need = min(images_per_request, burst)
        between = sum(c.images for c in mine
                      if c.status == 200 and first.start < c.start < last.start)
        level0 = bucket_level(first.retry_after_s, rate, need)
        level1 = bucket_level(last.retry_after_s, rate, need)
        span = last.start - first.start
        out.update(measured_span_s=span, measured_images=between,
                   accepted_images_per_s=(between + level1 - level0) / span)
    return out


# -- the raw trunk ------------------------------------------------------------------------------


def raw_batch(name: str, batch_size: int, trunk, service, measure) -> dict:
    """The raw trunk `name` ("<runtime>-<precision>") at `batch_size`: from the trunk section's
    table, else the service section's raw trunk (same name and size), else
    `measure(name, batch_size) -> {median_s, images_per_s}`."""
    entry = ((getattr(trunk, "runtimes", None) or {}).get(name) or {})
    by_size = {b.get("batch_size"): b for b in entry.get("batches") or []}
    raw = getattr(service, "raw_trunk", None) or {}
    if batch_size in by_size:
        b, source = by_size[batch_size], "trunk section"
        batch_s, rate = b["median_s"], b["images_per_s"]
    elif raw.get("name") == name and raw.get("batch_size") == batch_size:
        rate, source = raw["images_per_s"], "service section"
        batch_s = batch_size / rate
    else:
        b, source = measure(name, batch_size), "measured in the fairness section"
        batch_s, rate = b["median_s"], b["images_per_s"]
    return {"name": name, "batch_size": batch_size, "batch_s": batch_s, "images_per_s": rate,
            "source": source}
