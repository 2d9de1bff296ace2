"""Section `fairness`: tenants sharing one server (`service.core.fair`, `service.core.quota`).

Five tenants each own one bot of a store of their own: `noisy`, `quiet-1..3` and `limited`.
Every server runs `serve`'s defaults (runtime and precision auto; /readyz says which) with the
feature cache off (every image goes through the trunk) and a request deadline of 300 s (so that
no request of either scheduler is dropped: a dropped one would hide its latency).

- flood, twice: `--scheduler fair`, then `--scheduler fifo` (two servers one after the other,
  the same store and images). The noisy tenant runs `plan.fairness_noisy_clients` closed-loop
  clients, each quiet tenant one, every request one image (the run's JPEGs in turn). After
  `plan.fairness_warmup_s` (and a first burst of one full batch), the window of
  `plan.fairness_s` seconds: latencies of the requests SENT inside it (the clients keep the
  load on until each of them is answered), images/s ANSWERED inside it from the first trunk
  batch's answers to the last one's (`batch_rates`); the server's own batch sizes, trunk time
  per batch and per-tenant served images over it.
- quota: a third server (fair), the limited tenant at a rate R of trunk images per second
  (min(8, the fair flood's images/s / 4)) and a burst of 16, ONE closed-loop client that
  honours Retry-After (on a 429 it sleeps exactly that many seconds, then sends the same
  request again), beside the three quiet tenants at one client each. The client opens with one
  request of 16 images (the burst: its first 429 comes at once instead of after the bucket
  drains at the client's pace minus R), then sends 4 images per request. The window starts at
  its first 429 (the initial burst is not counted) and lasts `plan.quota_s` seconds, and the
  run until the client's first 429 after it.
- the raw trunk's time for one full batch (`plan.fairness_batch_size`, 8: the servers' batch
  size here, see `bench.plan`) on the runtime x precision the
  servers ran: from the trunk section's table (or the service section's raw trunk) when this
  run measured it, else measured here, in this process, once the servers are stopped.

The quota's measured rate: the images accepted between the first and the last refusal of the
run, divided by the time between them, corrected by the bucket's level at both refusals as
their Retry-After implies it (a refusal means the bucket held less than a request's images,
`need`; Retry-After = ceil((need - level) / R), at least 1, pins the level within R images). So
the estimate is off by at most min(need, R) images over the window, where "accepted images /
window" could be off by a whole request plus a second of the rate; that plain count is shown
too.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.context import Context, say
from bench.markdown import fmt, table
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.stats import num, ratio, summarize

NOISY = "noisy"
QUIET = ("quiet-1", "quiet-2", "quiet-3")
LIMITED = "limited"
TENANTS = (NOISY, *QUIET, LIMITED)
SCHEDULERS = ("fair", "fifo")

# Every server of the section: no feature cache (every request's images reach the trunk) and a
# deadline no request reaches (a 504 would drop a slow request's latency from the numbers).
SERVER_OPTIONS = {"feature-cache-size": 0, "request-timeout-s": 300}  # + the batch size

# The quota scenario: R = min(QUOTA_MAX_RATE, capacity / QUOTA_CAPACITY_SHARE) images/s, well
# below the pace of the limited client alone (4 images in a batch beside 3 quiet ones: about
# 0.4 of the capacity on 2 cores), so that the bucket, not the server, holds it back.
QUOTA_MAX_RATE = 8.0
QUOTA_CAPACITY_SHARE = 4.0
QUOTA_BURST = 16
QUOTA_IMAGES = 4  # images per request of the limited client
FIRST_REFUSAL_S = 120.0  # longest wait for the limited client's first 429

# Targets.
QUIET_P50_VS_FIFO = 0.5  # quiet tenants' p50, fair / fifo
QUIET_P50_VS_BATCH = 2.5  # quiet tenants' p50 with fair / the raw trunk's full batch
THROUGHPUT_VS_FIFO = 0.95  # total images/s, fair / fifo
RATE_TOLERANCE = 0.10  # |accepted rate / R - 1|


@dataclass
class FairnessResult(Result):
    image: str = ""
    noisy_clients: int | None = None
    quiet_clients: int | None = None  # per quiet tenant
    warmup_s: float | None = None
    duration_s: float | None = None
    # scheduler -> {"server": {runtime, ready_s, pid}, "window_s", "tenants": {tenant: stats},
    # "quiet": the quiet tenants' requests pooled, "measured_s" (the images/s' span, see
    # `batch_rates`), "total_images_per_s", "batches", "mean_batch_size", "server_trunk_ms",
    # "server_heads_ms", "served": {tenant: trunk images by the server's
    # multihead_tenant_images_total}, "refused": {"code tenant": n}}
    runs: dict[str, dict] = field(default_factory=dict)
    # The raw trunk of the servers' runtime x precision at their batch size: {name, batch_size,
    # batch_s, images_per_s, source}.
    raw_trunk: dict | None = None
    # The quota scenario (`quota_summary`), plus "server" and "quiet" (pooled stats).
    quota: dict = field(default_factory=dict)

    def quiet_p50_ms(self, scheduler: str) -> float | None:
        return ((self.runs.get(scheduler) or {}).get("quiet") or {}).get("p50_ms")

    def total_images_per_s(self, scheduler: str) -> float | None:
        return (self.runs.get(scheduler) or {}).get("total_images_per_s")


# -- load ---------------------------------------------------------------------------------------


@dataclass
class Call:
    """One request as a client saw it (perf_counter seconds)."""

    tenant: str
    start: float
    end: float
    status: int  # -1: no answer (a transport error)
    code: str = ""  # the error body's "code" (or the transport error's type)
    retry_after_s: float | None = None  # the Retry-After header, when sent
    images: int = 1
    retry: bool = False  # the same request again, after sleeping its Retry-After

    @property
    def label(self) -> str:
        """"200", "429 rate_limited", ... for the status counts."""
        return f"{self.status} {self.code}".strip()


class ImagePool:
    """The run's JPEGs in turn: consecutive requests, and the images of one request, carry
    distinct images (as far as the pool goes)."""

    def __init__(self, jpegs: Sequence[bytes]) -> None:
        if not jpegs:
            raise ValueError("an image pool needs at least one image")
        self.jpegs = list(jpegs)
        self._next = 0

    def take(self, n: int = 1) -> list[bytes]:
        out = [self.jpegs[(self._next + k) % len(self.jpegs)] for k in range(n)]
        self._next += n
        return out


def _seconds(header: str | None) -> float | None:
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


async def post_images(session, url: str, images: Sequence[bytes], *,
                      timeout_s: float | None = None) -> tuple[int, str, float | None]:
    """POSTs `images` to `url` (one: the raw body; more: multipart `image` parts); returns
    (status, error code, Retry-After seconds); status -1 and the error's type on a transport
    error. With `timeout_s`, the client gives up after that many seconds (status -1,
    "TimeoutError"): aiohttp then closes the request's connection, as a client that goes away
    does."""
    import aiohttp

    timeout = {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
    if len(images) == 1:
        data, headers = images[0], {"Content-Type": "image/jpeg"}
    else:
        data, headers = aiohttp.FormData(), None
        for i, image in enumerate(images):
            data.add_field("image", image, filename=f"{i}.jpg", content_type="image/jpeg")
    try:
        async with session.post(url, data=data, headers=headers, **timeout) as response:
            body = await response.read()
            status, retry_after = response.status, response.headers.get("Retry-After")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        return -1, type(exc).__name__, None
    code = ""
    if status != 200:
        try:
            code = str(json.loads(body).get("code", ""))
        except (ValueError, AttributeError):
            code = ""
    return status, code, _seconds(retry_after)


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    """Sleeps `seconds`, or less when `stop` is set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=max(0.0, seconds))
    except TimeoutError:
        pass


async def _metrics_text(session, url: str) -> str:
    async with session.get(f"{url}/metrics") as response:
        return await response.text() if response.status == 200 else ""


class InFlight:
    """When each client's request in flight was sent; `answered` is set at every answer."""

    def __init__(self) -> None:
        self.sent: dict[object, float] = {}
        self.answered = asyncio.Event()

    async def drained(self, before: float, deadline: float) -> None:
        """Returns once no request sent before `before` is in flight, or at `deadline`."""
        while any(s < before for s in self.sent.values()):
            self.answered.clear()
            try:
                await asyncio.wait_for(self.answered.wait(), deadline - time.perf_counter())
            except TimeoutError:
                return


async def _closed_client(session, url: str, tenant: str, bot: str, pool: ImagePool,
                         calls: list[Call], stop: asyncio.Event, in_flight: InFlight,
                         key: object, timeout_s: float | None = None) -> None:
    """One closed-loop client of one image per request until `stop`; it honours Retry-After
    and gives up on a request after `timeout_s` (if given), then sends the next one."""
    target = f"{url}/classify/{bot}"
    while not stop.is_set():
        start = time.perf_counter()
        in_flight.sent[key] = start
        status, code, retry_after = await post_images(session, target, pool.take(1),
                                                      timeout_s=timeout_s)
        del in_flight.sent[key]
        in_flight.answered.set()
        calls.append(Call(tenant, start, time.perf_counter(), status, code, retry_after))
        if status != 200 and retry_after is not None:
            await _sleep_unless(stop, retry_after)


async def flood(url: str, jpegs: Sequence[bytes], bots: Mapping[str, str],
                clients: Mapping[str, int], warmup_s: float, duration_s: float, *,
                drain_s: float = 300.0, timeouts: Mapping[str, float] | None = None) -> dict:
    """Closed-loop clients (`clients[tenant]` of them, on `bots[tenant]`, giving up on a
    request after `timeouts[tenant]` seconds where given) on the server at `url` for
    `warmup_s`, then a window of `duration_s`; the clients keep the load on until every
    request sent inside the window is answered (at most `drain_s` more), then the requests
    still in flight are abandoned. Returns {"window": (begin, end), "calls": [Call], "before":
    /metrics text at begin, "after": at end, "unfinished": the requests abandoned so}."""
    from bench.load import client_session

    pool = ImagePool(jpegs)
    calls: list[Call] = []
    in_flight = InFlight()
    stop = asyncio.Event()
    async with client_session(limit=0) as session:
        tasks = [asyncio.create_task(_closed_client(session, url, tenant, bots[tenant], pool,
                                                    calls, stop, in_flight, (tenant, i),
                                                    (timeouts or {}).get(tenant)))
                 for tenant, n in clients.items() for i in range(n)]
        unfinished = 0
        try:
            begin = time.perf_counter() + warmup_s
            end = begin + duration_s
            await asyncio.sleep(max(0.0, begin - time.perf_counter()))
            before = await _metrics_text(session, url)
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
            after = await _metrics_text(session, url)
            await in_flight.drained(end, end + drain_s)
        finally:
            stop.set()
            unfinished = len(in_flight.sent)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"window": (begin, end), "calls": calls, "before": before, "after": after,
            "unfinished": unfinished}


async def quota_load(url: str, jpegs: Sequence[bytes], limited_bot: str,
                     quiet_bots: Mapping[str, str], images_per_request: int, window_s: float, *,
                     opening_images: int | None = None,
                     first_refusal_s: float = FIRST_REFUSAL_S) -> dict:
    """The limited tenant's one client (`images_per_request` distinct images per request, the
    first one `opening_images` if given; on a refusal with Retry-After it sleeps exactly that
    long and sends the same request again, marked `retry`; without one, 1 s and the same
    request, not marked) beside one closed-loop client per quiet tenant, from the limited
    client's first 429 (RuntimeError when none comes within `first_refusal_s`: the quota did
    not bind) until its first 429 after `window_s` more (or `window_s` after that). Every
    client finishes the request it has in flight. Returns {"calls": [Call], "first_429": its
    send time}."""
    from bench.load import client_session

    pool = ImagePool(jpegs)
    calls: list[Call] = []
    stop, refused = asyncio.Event(), asyncio.Event()  # refused: set at each 429
    first: list[float] = []  # the send times of the limited client's 429s

    async with client_session(limit=0) as session:
        async def limited() -> None:
            target = f"{url}/classify/{limited_bot}"
            count = opening_images or images_per_request
            while not stop.is_set():
                images, retry, count = pool.take(count), False, images_per_request
                while not stop.is_set():
                    start = time.perf_counter()
                    status, code, retry_after = await post_images(session, target, images)
                    calls.append(Call(LIMITED, start, time.perf_counter(), status, code,
                                      retry_after, len(images), retry))
                    if status == 200:
                        break
                    if status == 429:
                        first.append(start)
                        refused.set()
                    await _sleep_unless(stop, 1.0 if retry_after is None else retry_after)
                    retry = retry_after is not None

        in_flight = InFlight()
        tasks = [asyncio.create_task(limited())]
        tasks += [asyncio.create_task(_closed_client(session, url, tenant, bot, pool, calls,
                                                     stop, in_flight, tenant))
                  for tenant, bot in quiet_bots.items()]
        try:
            try:
                await asyncio.wait_for(refused.wait(), timeout=first_refusal_s)
            except TimeoutError:
                raise RuntimeError(f"the limited tenant's client got no 429 in "
                                   f"{first_refusal_s:.0f} s: its quota did not bind") from None
            await asyncio.sleep(max(0.0, first[0] + window_s - time.perf_counter()))
            refused.clear()
            try:
                await asyncio.wait_for(refused.wait(), timeout=window_s)
            except TimeoutError:
                pass
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"calls": calls, "first_429": first[0] if first else None}


# -- numbers ------------------------------------------------------------------------------------


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


def labelled_samples(text: str, sample: str) -> dict[str, float]:
    """The values of the Prometheus sample `sample` (e.g. "multihead_tenant_images_total") by
    its labels' values joined with a space ("noisy", "noisy rate_limited")."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and s.labels:
                key = " ".join(v for _, v in sorted(s.labels.items()))
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
            if v - before.get(k, 0.0)}


def flood_summary(data: Mapping, clients: Mapping[str, int]) -> dict:
    """A flood's numbers: per tenant (images/s by `batch_rates`, half the server's mean trunk
    time per batch telling batches apart), the quiet tenants pooled, the total, and the
    server's own over the window (batches, trunk and heads per batch, trunk images per
    tenant)."""
    from bench.stats import parse_histograms

    begin, end = data["window"]
    calls = data["calls"]
    tenants = {t: {"clients": n, **call_stats([c for c in calls if c.tenant == t], begin, end)}
               for t, n in clients.items()}
    quiet = call_stats([c for c in calls if c.tenant in QUIET], begin, end)
    out: dict = {"window_s": end - begin, "tenants": tenants, "quiet": quiet}
    before, after = data.get("before") or "", data.get("after") or ""
    if after:
        hb, ha = parse_histograms(before), parse_histograms(after)

        def delta(name: str):
            return ha[name].minus(hb.get(name)) if name in ha else None

        size = delta("multihead_batch_size")
        trunk, heads = delta("multihead_trunk_seconds"), delta("multihead_heads_seconds")
        out.update(batches=size.count if size else None,
                   mean_batch_size=size.mean if size else None,
                   server_trunk_ms=1000 * trunk.mean if trunk else None,
                   server_heads_ms=1000 * heads.mean if heads else None,
                   served=_delta(labelled_samples(after, "multihead_tenant_images_total"),
                                 labelled_samples(before, "multihead_tenant_images_total")),
                   refused=_delta(labelled_samples(after, "multihead_tenant_refusals_total"),
                                  labelled_samples(before, "multihead_tenant_refusals_total")))
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


def _measure_in_process(context: Context):
    def measure(name: str, batch_size: int) -> dict:
        """`name` at `batch_size`, in this process, from the graph the servers saved next to
        the checkpoint (as `serve` does: no second build)."""
        from backbone import Trunk
        from backbone.checkpoint import cache_dir_of
        from bench.sections.trunk import preprocessed, time_batches

        runtime, precision = name.split("-", 1)
        say(f"raw trunk on {name} at batch {batch_size} for the fairness comparison ...")
        cache = cache_dir_of(context.prefix)
        trunk = Trunk.from_checkpoint(context.prefix, warmup_batch_sizes=(), runtime=runtime,
                                      precision=precision, graph_cache_dir=cache,
                                      int8_dir=cache)
        try:
            return time_batches(trunk, preprocessed(context, batch_size), (batch_size,),
                                context.plan.trunk_runs)[0]
        finally:
            trunk.close()

    return measure


# -- the section -------------------------------------------------------------------------------


def tenant_store(context: Context) -> tuple[Path, dict[str, str]]:
    """A new store with the five tenants, each owning one random bot `<tenant>-bot`; returns
    (store, {tenant: bot})."""
    import numpy as np

    from bench.bots import random_head
    from store import HeadStore

    store = context.tmp / "fairness-store"
    rng = np.random.default_rng(context.plan.seed + 22)
    bots = {}
    with HeadStore(store) as heads:
        for tenant in TENANTS:
            heads.add_tenant(tenant)
            weights, biases, labels = random_head(rng, context.plan.classes)
            bots[tenant] = f"{tenant}-bot"
            heads.register(bots[tenant], weights, biases, labels, source="bench",
                           tenant=tenant)
    context.share_graph_cache(store)
    return store, bots


def quota_rate(result: FairnessResult) -> tuple[float, float | None]:
    """(R, the capacity it was taken from): min(8, images/s / 4) of the fair flood (else the
    fifo one's); 0.5 image/s when neither was measured."""
    capacity = next((c for c in (result.total_images_per_s(s) for s in SCHEDULERS)
                     if c and not math.isnan(c)), None)
    if capacity is None:
        return 0.5, None
    return round(min(QUOTA_MAX_RATE, capacity / QUOTA_CAPACITY_SHARE), 2), capacity


def _facts(server) -> dict:
    return {"ready_s": server.ready_s, "pid": server.pid, "runtime": server.runtime()}


async def warm_up_batch(url: str, jpegs: Sequence[bytes], bot: str, n: int) -> None:
    """One full batch of distinct images at once (not measured): the trunk's batch shape."""
    from bench.load import client_session

    pool = ImagePool(jpegs)
    async with client_session(limit=0) as session:
        await asyncio.gather(*(post_images(session, f"{url}/classify/{bot}", pool.take(1))
                               for _ in range(n)))


def _run_flood(context: Context, store: Path, bots: dict[str, str], scheduler: str,
               result: FairnessResult) -> str | None:
    """One flood on a new server with `scheduler`; returns the server's runtime."""
    plan = context.plan
    clients = {NOISY: plan.fairness_noisy_clients, **dict.fromkeys(QUIET, 1)}
    server = context.start(context.server(f"fairness-{scheduler}", store, scheduler=scheduler,
                                          **{**SERVER_OPTIONS,
                                             "max-batch-size": plan.fairness_batch_size}))
    try:
        facts = _facts(server)
        asyncio.run(warm_up_batch(server.url, context.jpegs, bots[NOISY], plan.fairness_batch_size))
        say(f"fairness {scheduler}: {plan.fairness_noisy_clients} noisy clients + "
            f"{len(QUIET)} quiet ones, {plan.fairness_warmup_s:.0f} s warm-up + "
            f"{plan.fairness_s:.0f} s ...")
        data = asyncio.run(flood(server.url, context.jpegs, bots, clients,
                                 plan.fairness_warmup_s, plan.fairness_s))
        summary = flood_summary(data, clients)
        result.runs[scheduler] = {"server": facts, **summary}
        noisy = summary["tenants"][NOISY]
        say(f"fairness {scheduler}: {summary['total_images_per_s']:.2f} images/s, quiet p50 "
            f"{summary['quiet']['p50_ms']:.0f} ms, noisy p50 {noisy['p50_ms']:.0f} ms, mean "
            f"batch {num(summary.get('mean_batch_size')):.1f}")
        return facts["runtime"]
    finally:
        server.stop()


def _run_quota(context: Context, store: Path, bots: dict[str, str],
               result: FairnessResult) -> None:
    from store import HeadStore

    plan = context.plan
    rate, capacity = quota_rate(result)
    with HeadStore(store) as heads:
        heads.set_tenant_limits(LIMITED, rate=rate, burst=QUOTA_BURST)
    server = context.start(context.server("fairness-quota", store, scheduler="fair",
                                          **{**SERVER_OPTIONS,
                                             "max-batch-size": plan.fairness_batch_size}))
    try:
        facts = _facts(server)
        say(f"quota: tenant '{LIMITED}' at {rate:g} images/s (burst {QUOTA_BURST}), "
            f"{QUOTA_IMAGES} images per request, {plan.quota_s:.0f} s from its first 429 ...")
        data = asyncio.run(quota_load(server.url, context.jpegs, bots[LIMITED],
                                      {t: bots[t] for t in QUIET}, QUOTA_IMAGES, plan.quota_s,
                                      opening_images=QUOTA_BURST))
    finally:
        server.stop()
    summary = quota_summary(data["calls"], data["first_429"], rate, QUOTA_BURST, QUOTA_IMAGES,
                            plan.quota_s)
    first = data["first_429"]
    quiet = call_stats([c for c in data["calls"] if c.tenant in QUIET], first,
                       first + plan.quota_s)
    result.quota = {"server": facts, "capacity_images_per_s": capacity, **summary,
                    "quiet": quiet}
    say(f"quota: {num(summary.get('accepted_images_per_s')):.2f} images/s accepted at a rate "
        f"of {rate:g}; {summary['refusals']} refusals ({summary['refusals_improper']} not "
        f"rate_limited + Retry-After), {summary['retries_refused']} honoured retries refused")


def run(context: Context) -> FairnessResult:
    plan = context.plan
    store, bots = tenant_store(context)
    result = FairnessResult(image=context.image_summary(),
                            noisy_clients=plan.fairness_noisy_clients, quiet_clients=1,
                            warmup_s=plan.fairness_warmup_s, duration_s=plan.fairness_s)
    runtime = None
    for scheduler in SCHEDULERS:
        try:
            runtime = _run_flood(context, store, bots, scheduler, result) or runtime
        except Exception as exc:  # noqa: BLE001 - the other runs are still worth measuring
            context.record_error(f"fairness-{scheduler}", exc)
    try:
        _run_quota(context, store, bots, result)
    except Exception as exc:  # noqa: BLE001 - as above
        context.record_error("fairness-quota", exc)
    # The servers are stopped: a raw trunk measured now has the machine to itself.
    if runtime is not None:
        try:
            result.raw_trunk = raw_batch(runtime, plan.fairness_batch_size,
                                         context.results.get("trunk"),
                                         context.results.get("service"),
                                         _measure_in_process(context))
        except Exception as exc:  # noqa: BLE001 - keep the load numbers
            context.record_error("fairness-raw-trunk", exc)
    return result


# -- report -------------------------------------------------------------------------------------


def _statuses(counts: Mapping[str, int] | None) -> str:
    return ", ".join(f"{k}: {v}" for k, v in (counts or {}).items()) or "—"


def render(result: FairnessResult, results: Results) -> str:
    raw = result.raw_trunk or {}
    runtime = next((r["server"].get("runtime") for r in result.runs.values()
                    if r.get("server")), None) or raw.get("name", "?")
    out = [f"## Fair sharing between tenants ({runtime}, {result.image}, feature cache off)",
           ""]
    out += [f"Flood: tenant `{NOISY}` with {result.noisy_clients} closed-loop clients, "
            f"{len(QUIET)} quiet tenants with {result.quiet_clients} each, one image per "
            f"request; {fmt(result.warmup_s)} s warm-up, then {fmt(result.duration_s)} s "
            "measured (latency of the requests sent in it; images/s answered in it, from the "
            "first trunk batch's answers to the last one's), one server per scheduler:", ""]
    rows = []
    for scheduler in SCHEDULERS:
        run_ = result.runs.get(scheduler) or {}
        served = run_.get("served") or {}
        for tenant, s in (run_.get("tenants") or {}).items():
            rows.append([scheduler, tenant, s.get("clients"), s.get("requests"),
                         s.get("images_per_s"), s.get("p50_ms"), s.get("p95_ms"),
                         _statuses(s.get("statuses")), served.get(tenant)])
    out += table(["scheduler", "tenant", "clients", "requests", "images/s", "p50 ms",
                  "p95 ms", "answers", "trunk images (server)"], rows)
    rows = []
    for scheduler in SCHEDULERS:
        run_ = result.runs.get(scheduler) or {}
        if not run_:
            continue
        quiet = run_.get("quiet") or {}
        rows.append([scheduler, run_.get("total_images_per_s"), quiet.get("p50_ms"),
                     quiet.get("p95_ms"), ((run_.get("tenants") or {}).get(NOISY) or {}).get(
                         "p50_ms"), run_.get("mean_batch_size"), run_.get("server_trunk_ms"),
                     run_.get("server_heads_ms"),
                     ratio(quiet.get("p50_ms"), run_.get("server_trunk_ms"))])
    if rows:
        out += ["", f"Per scheduler (quiet: the {len(QUIET)} quiet tenants' requests pooled; "
                "server: its own histograms over the window; the last column tells a slower "
                "machine from a longer wait):", ""]
        out += table(["scheduler", "total images/s", "quiet p50 ms", "quiet p95 ms",
                      "noisy p50 ms", "mean batch", "server trunk ms/batch",
                      "server heads ms/batch", "quiet p50 in server batches"], rows)
    if raw:
        out += ["", f"Raw {raw.get('name')} trunk, one batch of {raw.get('batch_size')}: "
                f"{fmt(1000 * num(raw.get('batch_s')))} ms ({fmt(raw.get('images_per_s'))} "
                f"images/s; from the {raw.get('source', '?').removeprefix('measured in the ')})"
                "."]
    q = result.quota
    if q:
        out += ["", f"Quota: tenant `{LIMITED}` at {fmt(q.get('rate'))} images/s (burst "
                f"{q.get('burst')}; from {fmt(q.get('capacity_images_per_s'))} images/s of "
                f"capacity), one client of {q.get('images_per_request')} images per request "
                f"(the first one: {q.get('burst')}) honouring Retry-After, beside the quiet "
                f"tenants at one client each; {fmt(q.get('window_s'))} s from its first 429 "
                "(the rate: from that 429 to the client's last one):", ""]
        quiet = q.get("quiet") or {}
        out += table(["rate", "accepted images in the window", "accepted / window",
                      "accepted rate (bucket-corrected)", "× rate", "answers", "Retry-After s",
                      "not 429 rate_limited + Retry-After", "honoured retries refused",
                      "quiet p50 ms"],
                     [[q.get("rate"), q.get("accepted_images"), q.get("plain_images_per_s"),
                       q.get("accepted_images_per_s"),
                       ratio(q.get("accepted_images_per_s"), q.get("rate")),
                       _statuses(q.get("statuses")), _statuses(q.get("retry_after_s")),
                       q.get("refusals_improper"), q.get("retries_refused"),
                       quiet.get("p50_ms")]])
    out += [""]
    return "\n".join(out)


def targets(result: FairnessResult, results: Results) -> list[Target]:
    fair_p50, fifo_p50 = num(result.quiet_p50_ms("fair")), num(result.quiet_p50_ms("fifo"))
    fair_rate, fifo_rate = (num(result.total_images_per_s("fair")),
                            num(result.total_images_per_s("fifo")))
    raw = result.raw_trunk or {}
    batch_ms = 1000 * num(raw.get("batch_s"))
    q = result.quota
    rate, accepted = num(q.get("rate")), num(q.get("accepted_images_per_s"))
    improper, retried = num(q.get("refusals_improper")), num(q.get("retries_refused"))
    bad = improper + retried if q.get("refusals") else math.nan  # no refusal: not exercised
    return [
        Target.of("fair_quiet_p50", f"quiet tenants' p50 under a flood, fair <= "
                  f"{QUIET_P50_VS_FIFO} x fifo (same run)", ("fairness",),
                  ratio(fair_p50, fifo_p50), QUIET_P50_VS_FIFO, "<=", "x",
                  note("fair {:.0f} ms vs fifo {:.0f} ms", fair_p50, fifo_p50)),
        Target.of("fair_quiet_vs_batch", f"quiet tenants' p50 under a flood with fair <= "
                  f"{QUIET_P50_VS_BATCH} x one full raw trunk batch", ("fairness",),
                  ratio(fair_p50, batch_ms), QUIET_P50_VS_BATCH, "<=", "x",
                  note(f"{{:.0f}} ms vs raw {raw.get('name', '?')} batch of "
                       f"{raw.get('batch_size', '?')} {{:.0f}} ms", fair_p50, batch_ms)),
        Target.of("fair_throughput", f"total images/s under a flood, fair >= "
                  f"{THROUGHPUT_VS_FIFO} x fifo", ("fairness",), ratio(fair_rate, fifo_rate),
                  THROUGHPUT_VS_FIFO, ">=", "x",
                  note("fair {:.2f} vs fifo {:.2f} images/s", fair_rate, fifo_rate)),
        Target.of("quota_rate", f"a limited tenant's accepted images/s within "
                  f"{RATE_TOLERANCE:.0%} of its rate: |accepted / rate - 1|", ("fairness",),
                  abs(ratio(accepted, rate) - 1), RATE_TOLERANCE, "<=", "",
                  note("{:.2f} images/s accepted at a rate of {:g}", accepted, rate)),
        Target.of("quota_retry_after", "quota refusals not 429 rate_limited + Retry-After, "
                  "plus honoured retries refused again", ("fairness",), bad, 0, "<=", "",
                  note("{:.0f} refusals: {:.0f} improper, {:.0f} retries refused",
                       num(q.get("refusals")), improper, retried)),
    ]


SECTION = Section("fairness", FairnessResult, run, render, targets)
