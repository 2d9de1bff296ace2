"""The load of the fairness section (`bench.sections.fairness`): HTTP clients of tenants on a
real server, each request recorded as a `Call`. The cancellation section's loads reuse `flood`.

- `flood`: closed-loop clients per tenant, one image per request (the run's JPEGs in turn,
  `ImagePool`), each honouring Retry-After and, where given, giving up on a request after a
  timeout; a warm-up, then a window whose requests are all answered before the load stops; the
  server's /metrics text at both ends of the window.
- `quota_load`: the limited tenant's one client (several images per request, every refusal
  retried after its Retry-After) beside one closed-loop client per quiet tenant, from its first
  429 to its first 429 after the window.
- `warm_up_batch`: one full batch of distinct images at once, not measured.

Nothing here imports TensorFlow or the service; aiohttp is imported by the functions that post.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The tenants of the section: one floods, three are quiet, one has a quota.
NOISY = "noisy"
QUIET = ("quiet-1", "quiet-2", "quiet-3")
LIMITED = "limited"
TENANTS = (NOISY, *QUIET, LIMITED)

FIRST_REFUSAL_S = 120.0  # longest wait for the limited client's first 429


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
                      timeout_s: float | None = None,
                      headers: Mapping[str, str] | None = None
                      ) -> tuple[int, str, float | None]:
    """POSTs `images` to `url` (one: the raw body; more: multipart `image` parts) with
    `headers` added, if given; returns
    (status, error code, Retry-After seconds); status -1 and the error's type on a transport
    error. With `timeout_s`, the client gives up after that many seconds (status -1,
    "TimeoutError"): aiohttp then closes the request's connection, as a client that goes away
    does."""
    import aiohttp

    timeout = {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
    extra = dict(headers or {})
    if len(images) == 1:
        data, sent = images[0], {"Content-Type": "image/jpeg", **extra}
    else:
        data, sent = aiohttp.FormData(), extra or None
        for i, image in enumerate(images):
            data.add_field("image", image, filename=f"{i}.jpg", content_type="image/jpeg")
    try:
        async with session.post(url, data=data, headers=sent, **timeout) as response:
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


async def warm_up_batch(url: str, jpegs: Sequence[bytes], bot: str, n: int) -> None:
    """One full batch of distinct images at once (not measured): the trunk's batch shape."""
    from bench.load import client_session

    pool = ImagePool(jpegs)
    async with client_session(limit=0) as session:
        await asyncio.gather(*(post_images(session, f"{url}/classify/{bot}", pool.take(1))
                               for _ in range(n)))
