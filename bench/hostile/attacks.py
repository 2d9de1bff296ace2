"""The attacks of a hostile tenant (issue 34), each run by tenant A against a real server for a
given number of seconds while B's closed loop runs (`bench.hostile.world.Victim`).

An attack returns an `Outcome`: A's answers counted by label ("400 invalid_label", "429
rate_limited", "closed 1008", "grpc UNAUTHENTICATED", ...) and the violations it saw itself (a
leak, a socket B could not open, a probe told apart from an unknown bot). `Attack.allowed` is
the set of labels A may get; anything else (a 5xx above all) is a failure, as is a violation.
The suite (tests/hostile) asserts exactly that; the bench section `isolation` prints the answers
beside B's latency.

The attacks on connections (slow uploads, a WebSocket flood, a key revoked under an open
socket) are in `bench.hostile.connections`.

`ATTACKS` is the list both run, in this order.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

from bench.hostile.common import MIB, Attack, Outcome, client_of, form, label_of, loop
from bench.hostile.connections import (
    SLOW_CONNECTIONS,
    SLOW_DECLARED,
    WS_SOCKETS,
    revoked_key,
    slow_uploads,
    websocket_flood,
)
from bench.hostile.world import (
    A_BOT,
    A_WORDY,
    B_BOT,
    WORDY_CLASSES,
    Tokens,
    World,
    head_upload,
    huge_png,
)

# -- decode bomb ----------------------------------------------------------------------------------

CORRUPT = b"\xff\xd8\xff\xe0" + b"\0" * 2000  # a JPEG's start, then nothing decodable
HUGE_PER_REQUEST = 3


async def decode_bomb(world: World, duration_s: float) -> Outcome:
    """Requests of one corrupt image and three 36-megapixel 16-bit PNGs (about 100 kB each),
    two clients in a loop."""
    out = Outcome()
    images = [CORRUPT] + [huge_png()] * HUGE_PER_REQUEST
    types = ["image/jpeg"] + ["image/png"] * HUGE_PER_REQUEST
    async with client_of(Tokens.header(world.tokens.a_infer)) as session:
        async def one() -> None:
            async with session.post(f"{world.url}/classify/{A_BOT}",
                                    data=form(images, types)) as resp:
                out.add(await label_of(resp))

        await loop(duration_s, 2, one)
    return out


# -- labels and answers ---------------------------------------------------------------------------

BAD_LABELS = (["cat", "\x07" * MIB], ["cat", "red\x1b[31m"], ["cat", "x" * 300])
ANSWER_BOMB_IMAGES = 32


async def huge_labels(world: World, duration_s: float) -> Outcome:
    """Head uploads whose labels are 1 MB of control characters, hold an escape sequence or
    are too long, in turn; and answer bombs: 32 images scored by A's bot of 100 labels of the
    longest length and its other bot, top_k 100."""
    out = Outcome()
    uploads = [head_upload(labels, world.scratch, f"bad-{i}") for i, labels in
               enumerate(BAD_LABELS)]
    images = world.a_images(ANSWER_BOMB_IMAGES)
    turn = iter(range(10**9))
    async with client_of() as session:
        async def one() -> None:
            i = next(turn)
            if i % 2:
                async with session.post(
                        f"{world.url}/classify?bots={A_WORDY},{A_BOT}&top_k={WORDY_CLASSES}",
                        data=form(images),
                        headers=Tokens.header(world.tokens.a_infer)) as resp:
                    out.add(await label_of(resp))
                return
            body, content_type = uploads[(i // 2) % len(uploads)]
            async with session.put(f"{world.url}/bots/attacker-{uuid.uuid4().hex[:8]}",
                                   data=body, headers={**Tokens.header(world.tokens.a_manage),
                                                       "Content-Type": content_type}) as resp:
                out.add(await label_of(resp))

        await loop(duration_s, 2, one)
    return out


# -- classification flood -------------------------------------------------------------------------

FLOOD_CLIENTS = 16
FLOOD_IMAGES = 4


async def classification_flood(world: World, duration_s: float) -> Outcome:
    """`FLOOD_CLIENTS` closed-loop clients of A, `FLOOD_IMAGES` distinct images per request."""
    out = Outcome()
    pool = world.a_images(64)
    turn = iter(range(10**9))
    async with client_of(Tokens.header(world.tokens.a_infer)) as session:
        async def one() -> None:
            i = next(turn) * FLOOD_IMAGES
            images = [pool[(i + k) % len(pool)] for k in range(FLOOD_IMAGES)]
            async with session.post(f"{world.url}/classify/{A_BOT}",
                                    data=form(images)) as resp:
                out.add(await label_of(resp))
                if resp.status == 429:  # a refusal comes at once: do not spin on it
                    await asyncio.sleep(0.05)

        await loop(duration_s, FLOOD_CLIENTS, one)
    return out


# -- metrics and readiness ------------------------------------------------------------------------


async def metrics_probe(world: World, duration_s: float) -> Outcome:
    """A's metrics key reads /metrics and /readyz in a loop: neither may name B's tenant or bot."""
    out = Outcome()
    async with client_of(Tokens.header(world.tokens.a_metrics)) as session:
        async def one() -> None:
            for path in ("/metrics", "/readyz"):
                async with session.get(f"{world.url}{path}") as resp:
                    text = await resp.text()
                    out.add(str(resp.status))
                    for secret in ("victim", B_BOT):
                        if secret in text:
                            out.violations.append(f"{path} names {secret!r} to A's metrics key")
            await asyncio.sleep(0.1)

        await loop(duration_s, 1, one)
    return out


# -- probing B's bot ids --------------------------------------------------------------------------


async def bot_probe(world: World, duration_s: float) -> Outcome:
    """A's manage key asks about B's bot and about a bot nobody registered on every route that
    reads or writes one (a head upload as a `candidate`: a plain upload to a free id creates
    a bot); each pair of answers must be the same (status, and body with the id blanked)."""
    out = Outcome()
    upload, content_type = head_upload(["cat", "dog"], world.scratch, "probe", "shadow")
    routes = [("GET", "/bots/{}", None, {}), ("DELETE", "/bots/{}", None, {}),
              ("PUT", "/bots/{}", upload, {"Content-Type": content_type}),
              ("POST", "/bots/{}/rollback", None, {}),
              ("POST", "/bots/{}/candidate/promote", None, {}),
              ("DELETE", "/bots/{}/candidate", None, {}),
              ("POST", "/classify/{}", world.a_images(1)[0], {"Content-Type": "image/jpeg"})]
    async with client_of(Tokens.header(world.tokens.a_manage)) as session:
        async def ask(method: str, path: str, body, headers) -> tuple[int, bytes]:
            async with session.request(method, f"{world.url}{path}", data=body,
                                       headers=headers) as resp:
                return resp.status, await resp.read()

        async def one() -> None:
            for method, path, body, headers in routes:
                unknown = f"unknown-{uuid.uuid4().hex[:6]}"
                theirs = await ask(method, path.format(B_BOT), body, headers)
                nobody = await ask(method, path.format(unknown), body, headers)
                label = str(theirs[0])
                with contextlib.suppress(ValueError, AttributeError):
                    label = f"{theirs[0]} {json.loads(theirs[1]).get('code')}"
                out.add(label)
                if (theirs[0], theirs[1].replace(B_BOT.encode(), b"?")) != \
                        (nobody[0], nobody[1].replace(unknown.encode(), b"?")):
                    out.violations.append(f"{method} {path}: B's bot {theirs} vs an unknown "
                                          f"one {nobody}")

        await loop(duration_s, 1, one)
    return out


# -- registrations --------------------------------------------------------------------------------


async def registration_flood(world: World, duration_s: float) -> Outcome:
    """A registers as fast as it can: new bots (beyond --tenant-max-bots: 403 tenant_limit) and
    new versions of its bot (beyond --tenant-registrations-per-minute: 429
    registration_rate)."""
    out = Outcome()
    upload, content_type = head_upload(["cat", "dog"], world.scratch, "flood")
    turn = iter(range(10**9))
    headers = {**Tokens.header(world.tokens.a_manage), "Content-Type": content_type}
    async with client_of() as session:
        async def one() -> None:
            bot = A_BOT if next(turn) % 2 else f"attacker-{uuid.uuid4().hex[:8]}"
            async with session.put(f"{world.url}/bots/{bot}", data=upload,
                                   headers=headers) as resp:
                out.add(await label_of(resp))

        await loop(duration_s, 2, one)
    return out


# -- gRPC -----------------------------------------------------------------------------------------

GRPC_CLIENTS = 16


def grpc_missing() -> str | None:
    """Why the gRPC attack cannot run here (the grpc extra missing), else None."""
    from bench.grpc_load import grpc_available

    return grpc_available()


async def grpc_attack(world: World, duration_s: float) -> Outcome:
    """20 MB messages without a key (UNAUTHENTICATED before they are read), then a flood of
    ModelInfer calls with A's key from `GRPC_CLIENTS` clients, 4 images a call."""
    from bench.grpc_load import InferChannel

    out = Outcome()
    pool = world.a_images(64)
    turn = iter(range(10**9))
    async with InferChannel(world.grpc_address) as channel:
        async def call(model: str, images: list[bytes], token: str | None) -> None:
            status = await channel.infer(model, images, token)
            out.add(f"grpc {status}")
            if status in ("RESOURCE_EXHAUSTED", "UNAVAILABLE"):
                await asyncio.sleep(0.05)  # a refusal comes at once: do not spin on it

        for _ in range(2):
            await call(B_BOT, [b"\0" * (20 * MIB)], None)

        async def one() -> None:
            i = next(turn) * 4
            await call(A_BOT, [pool[(i + k) % len(pool)] for k in range(4)],
                       world.tokens.a_infer)

        await loop(duration_s, GRPC_CLIENTS, one)
    return out


# -- feature-cache probe --------------------------------------------------------------------------


CACHE_HITS = "multihead_feature_cache_hits_total"


async def _cache_hits(session, world: World) -> float:
    """The server's feature-cache hits so far (the operator's /metrics)."""
    from bench.prometheus import value

    async with session.get(f"{world.url}/metrics",
                           headers=Tokens.header(world.tokens.operator)) as resp:
        return value(await resp.text(), CACHE_HITS) or 0.0


async def cache_probe(world: World, duration_s: float) -> Outcome:
    """A sends the image B was answered for last (still in the feature cache, were it shared),
    then an image nobody sent: none of A's requests may hit the cache (B's own loop never
    does: it sends more distinct images than the cache holds), so the server's hit count
    must not move. (A hit would show to A in its answer's time and its Server-Timing.)"""
    out = Outcome()
    fresh = iter(range(10_000, 10**9))
    async with client_of(Tokens.header(world.tokens.a_infer)) as session:
        async def ask(image: bytes) -> None:
            async with session.post(f"{world.url}/classify/{A_BOT}", data=image,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                out.add(await label_of(resp))

        async def one() -> None:
            from bench.hostile.world import tiny_jpeg

            await ask(world.b_last())
            await ask(tiny_jpeg(next(fresh)))
            await asyncio.sleep(0.1)

        before = await _cache_hits(session, world)
        await loop(duration_s, 1, one)
        hits = await _cache_hits(session, world) - before
    if hits:
        out.violations.append(f"A's requests hit the feature cache {hits:.0f} time(s)")
    return out


# -- the in-flight bytes -------------------------------------------------------------------------

INFLIGHT_BODIES = 30
INFLIGHT_BODY_BYTES = 10 * MIB


async def inflight_bytes(world: World, duration_s: float) -> Outcome:
    """Many large bodies at once from A (`INFLIGHT_BODIES` of 10 MB, sent at full speed): A has
    at most its quota's burst of bodies read at once (each request past its head holds an
    image of the bucket: 429 rate_limited from the head, the body never read) and at most its
    share of --max-inflight-bytes (429 inflight_share); B is never refused for A's use."""
    out = Outcome()
    body = b"\xff\xd8" + b"\0" * (INFLIGHT_BODY_BYTES - 2)
    async with client_of(Tokens.header(world.tokens.a_infer)) as session:
        async def one() -> None:
            async with session.post(f"{world.url}/classify/{A_BOT}", data=body,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                out.add(await label_of(resp))

        await loop(duration_s, INFLIGHT_BODIES, one)
    return out


def _labels(*labels: str) -> frozenset[str]:
    return frozenset(labels)


ATTACKS: tuple[Attack, ...] = (
    Attack("metrics", "A's metrics key reads /metrics and /readyz", _labels("200"),
           metrics_probe, (_labels("200"),)),
    Attack("bot_probe", "A asks about B's bot and an unknown one on every bot route",
           _labels("404 unknown_bot", "429 registration_rate", "429 rate_limited"), bot_probe,
           (_labels("404 unknown_bot"),)),
    Attack("cache_probe", "A sends the images B sends (feature cache per tenant)",
           _labels("200", "429 rate_limited"), cache_probe, (_labels("200"),)),
    Attack("revoked_key", "a socket's key revoked while it is open",
           _labels("101", "closed 1008"), revoked_key, (_labels("closed 1008"),)),
    Attack("registrations", "new bots and versions as fast as A can",
           _labels("200", "201", "403 tenant_limit", "429 registration_rate"),
           registration_flood, (_labels("403 tenant_limit", "429 registration_rate"),)),
    Attack("labels", "1 MB / control-character / too-long labels; answer bombs",
           _labels("400 invalid_label", "413 answer_too_large", "429 registration_rate"),
           huge_labels, (_labels("400 invalid_label", "429 registration_rate"),
                         _labels("413 answer_too_large"))),
    Attack("websockets", f"{WS_SOCKETS} WebSockets of A, B opening one",
           _labels("101", "429", "closed", "ws 200", "ws 429", "ws 429 rate_limited"),
           websocket_flood, (_labels("429", "closed 1013"),)),
    Attack("grpc", "20 MB messages without a key; a ModelInfer flood with A's key",
           _labels("grpc OK", "grpc UNAUTHENTICATED", "grpc RESOURCE_EXHAUSTED",
                   "grpc UNAVAILABLE"), grpc_attack,
           (_labels("grpc UNAUTHENTICATED"),
            _labels("grpc RESOURCE_EXHAUSTED", "grpc UNAVAILABLE"))),
    Attack("flood", f"{FLOOD_CLIENTS} clients of A, {FLOOD_IMAGES} images a request",
           _labels("200", "429 rate_limited", "429 queue_share"), classification_flood,
           (_labels("429 rate_limited", "429 queue_share"),)),
    Attack("slow_uploads", f"{SLOW_CONNECTIONS} connections trickling a "
           f"{SLOW_DECLARED / 1e6:.0f} MB body",
           _labels("408 request_timeout", "closed", "429 inflight_share", "429 rate_limited"),
           slow_uploads,
           (_labels("408 request_timeout", "closed"),)),
    # A's client writes up to 30 x 10 MB at once: on a loaded machine it may open a connection
    # and send no head within the world's 1 s header timeout (seen in CI: the server logged
    # "request headers not received"), a clear 408 for A. A body the server times out is
    # "408 request_timeout", not allowed: A sends at full speed.
    Attack("inflight_bytes", f"{INFLIGHT_BODIES} bodies of 10 MB at once",
           _labels("400 invalid_image", "429 inflight_share", "429 rate_limited",
                   "408 request_timeout head"),
           inflight_bytes, (_labels("429 inflight_share", "429 rate_limited"),)),
    Attack("decode_bomb", "a corrupt image and three 36-megapixel 16-bit PNGs a request",
           _labels("400", "413", "429 rate_limited", "429 queue_share"), decode_bomb,
           (_labels("400 invalid_image", "413 image_too_large", "429 rate_limited"),)),
)

BY_NAME = {a.name: a for a in ATTACKS}
