"""The attacks of a hostile tenant (issue 34), each run by tenant A against a real server for a
given number of seconds while B's closed loop runs (`bench.hostile.world.Victim`).

An attack returns an `Outcome`: A's answers counted by label ("400 invalid_label", "429
rate_limited", "closed 1008", "grpc UNAUTHENTICATED", ...) and the violations it saw itself (a
leak, a socket B could not open, a probe told apart from an unknown bot). `Attack.allowed` is
the set of labels A may get; anything else (a 5xx above all) is a failure, as is a violation.
The suite (tests/hostile) asserts exactly that; the bench section `isolation` prints the answers
beside B's latency.

`ATTACKS` is the list both run, in this order. `PENDING` holds attacks whose defence is not on
main yet (they fail today): neither runs them; move one into `ATTACKS` once it holds.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

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

MIB = 1 << 20


@dataclass
class Outcome:
    """What A got (`answers`: label -> count) and what went wrong beyond A's answers."""

    answers: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def add(self, label: str, n: int = 1) -> None:
        self.answers[label] += n

    def unexpected(self, allowed: frozenset[str]) -> dict[str, int]:
        """A's answers outside `allowed` (a label is allowed when it is listed, or its status
        alone is)."""
        return {k: v for k, v in self.answers.items()
                if k not in allowed and k.split(" ")[0] not in allowed}


@dataclass(frozen=True)
class Attack:
    """One attack: its name (the bench's target keys: `isolation_<name>_p50`), what it does,
    the labels A may get, `run(world, seconds) -> Outcome`, and `required`: groups of labels
    of which A must get at least one each (the defence was reached, not just never tried)."""

    name: str
    text: str
    allowed: frozenset[str]
    run: Callable[[World, float], Awaitable[Outcome]]
    required: tuple[frozenset[str], ...] = ()

    def failures(self, outcome: Outcome) -> list[str]:
        """What is wrong with A's outcome: answers outside `allowed` (any 5xx among them), a
        `required` group never seen, the attack's own violations."""
        out = [f"A got {label} x {n}" for label, n in outcome.unexpected(self.allowed).items()]
        out += [f"A never got any of {sorted(group)}" for group in self.required
                if not any(outcome.answers.get(label) for label in group)]
        return out + list(outcome.violations)


def _session(headers: dict[str, str] | None = None, limit: int = 0):
    from bench.load import client_session

    return client_session(limit=limit, headers=headers)


async def _label(resp) -> str:
    """"<status> <code>" of an answer (its JSON body's code), "<status>" without one."""
    body = await resp.read()
    try:
        code = json.loads(body).get("code")
    except (ValueError, AttributeError):
        code = None
    return f"{resp.status} {code}" if code else str(resp.status)


def _form(images: list[bytes], content_types: list[str] | None = None):
    import aiohttp

    form = aiohttp.FormData()
    for i, data in enumerate(images):
        form.add_field("image", data, filename=f"{i}",
                       content_type=(content_types or ["image/jpeg"] * len(images))[i])
    return form


async def _loop(duration_s: float, clients: int, one: Callable[[], Awaitable[None]]) -> None:
    """`clients` concurrent loops of `one()` until `duration_s` has passed (each finishes the
    call it has in flight)."""
    end = time.perf_counter() + duration_s

    async def client() -> None:
        while time.perf_counter() < end:
            await one()

    await asyncio.gather(*(client() for _ in range(clients)))


# -- 1. decode bomb -----------------------------------------------------------------------------

CORRUPT = b"\xff\xd8\xff\xe0" + b"\0" * 2000  # a JPEG's start, then nothing decodable
HUGE_PER_REQUEST = 3


async def decode_bomb(world: World, duration_s: float) -> Outcome:
    """Requests of one corrupt image and three 36-megapixel 16-bit PNGs (about 100 kB each),
    two clients in a loop."""
    out = Outcome()
    images = [CORRUPT] + [huge_png()] * HUGE_PER_REQUEST
    types = ["image/jpeg"] + ["image/png"] * HUGE_PER_REQUEST
    async with _session(Tokens.header(world.tokens.a_infer)) as session:
        async def one() -> None:
            async with session.post(f"{world.url}/classify/{A_BOT}",
                                    data=_form(images, types)) as resp:
                out.add(await _label(resp))

        await _loop(duration_s, 2, one)
    return out


# -- 2. slow uploads ----------------------------------------------------------------------------

SLOW_CONNECTIONS = 40
# Declared per connection: 40 of them fit the in-flight budget (256 MiB) together. 20 MB each
# do not: `slow_uploads_20mb`, pending (A's requests beyond the budget are 503 until A has a
# share of it).
SLOW_DECLARED = 6_000_000


async def _slow_upload(world: World, token: str, end: float, out: Outcome,
                       declared: int) -> None:
    """One connection declaring a body of `declared` bytes and sending a byte every 0.2 s
    until the server answers and closes it (or `end`, plus the server's bounds, passes)."""
    from urllib.parse import urlsplit

    parts = urlsplit(world.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (f"POST /classify/{A_BOT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: image/jpeg\r\nContent-Length: {declared}\r\n\r\n").encode()

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(head)
            await writer.drain()
            while True:
                await asyncio.sleep(0.2)
                writer.write(b"\xff")
                await writer.drain()

    sender = asyncio.ensure_future(trickle())
    try:
        # The answer, read by its Content-Length: the server closes its side only after
        # aiohttp's lingering time (it reads on what the client still sends, up to 10 s).
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                      max(1.0, end - time.perf_counter()) + 20)
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(h.split(":", 1)[1]) for h in lines
                       if h.lower().startswith("content-length:")), 0)
        body = await asyncio.wait_for(reader.readexactly(length), 20)
        try:
            code = json.loads(body).get("code")
        except ValueError:
            code = None
        status = lines[0].split(" ")[1]
        out.add(f"{status} {code}" if code else status)
    except TimeoutError:
        out.add("never answered")
    except (ConnectionError, asyncio.IncompleteReadError):
        out.add("closed")
    finally:
        sender.cancel()
        writer.close()


async def slow_uploads(world: World, duration_s: float,
                       declared: int = SLOW_DECLARED) -> Outcome:
    """`SLOW_CONNECTIONS` connections at once, each declaring a body of `declared` bytes and
    trickling a byte every 0.2 s; a connection the server ends is opened again until
    `duration_s` has passed."""
    out = Outcome()
    end = time.perf_counter() + duration_s

    async def connection() -> None:
        while time.perf_counter() < end:
            await _slow_upload(world, world.tokens.a_infer, end, out, declared)

    await asyncio.gather(*(connection() for _ in range(SLOW_CONNECTIONS)))
    return out


async def slow_uploads_20mb(world: World, duration_s: float) -> Outcome:
    """`slow_uploads` with 20 MB declared per connection (800 MB together, over the in-flight
    budget). PENDING: A's connections beyond the budget are refused 503, not 429."""
    return await slow_uploads(world, duration_s, 20_000_000)


# -- 3. labels and answers ----------------------------------------------------------------------

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
    async with _session() as session:
        async def one() -> None:
            i = next(turn)
            if i % 2:
                async with session.post(
                        f"{world.url}/classify?bots={A_WORDY},{A_BOT}&top_k={WORDY_CLASSES}",
                        data=_form(images),
                        headers=Tokens.header(world.tokens.a_infer)) as resp:
                    out.add(await _label(resp))
                return
            body, content_type = uploads[(i // 2) % len(uploads)]
            async with session.put(f"{world.url}/bots/attacker-{uuid.uuid4().hex[:8]}",
                                   data=body, headers={**Tokens.header(world.tokens.a_manage),
                                                       "Content-Type": content_type}) as resp:
                out.add(await _label(resp))

        await _loop(duration_s, 2, one)
    return out


# -- 4. classification flood --------------------------------------------------------------------

FLOOD_CLIENTS = 16
FLOOD_IMAGES = 4


async def classification_flood(world: World, duration_s: float) -> Outcome:
    """`FLOOD_CLIENTS` closed-loop clients of A, `FLOOD_IMAGES` distinct images per request."""
    out = Outcome()
    pool = world.a_images(64)
    turn = iter(range(10**9))
    async with _session(Tokens.header(world.tokens.a_infer)) as session:
        async def one() -> None:
            i = next(turn) * FLOOD_IMAGES
            images = [pool[(i + k) % len(pool)] for k in range(FLOOD_IMAGES)]
            async with session.post(f"{world.url}/classify/{A_BOT}",
                                    data=_form(images)) as resp:
                out.add(await _label(resp))
                if resp.status == 429:  # a refusal comes at once: do not spin on it
                    await asyncio.sleep(0.05)

        await _loop(duration_s, FLOOD_CLIENTS, one)
    return out


# -- 5. WebSocket flood -------------------------------------------------------------------------

WS_SOCKETS = 16  # twice the server's max-websockets


async def _ws_open(session, world: World, token: str, bot: str, out: Outcome | None):
    import aiohttp

    try:
        ws = await session.ws_connect(f"{world.url}/ws/classify/{bot}",
                                      headers=Tokens.header(token))
    except aiohttp.WSServerHandshakeError as exc:
        if out is not None:
            out.add(f"{exc.status} {_handshake_code(exc)}")
        return None
    if out is not None:
        out.add("101")
    return ws


def _handshake_code(exc) -> str:
    """The refusal's code: aiohttp keeps no body of a refused handshake, its message only."""
    return "socket_share" if exc.status == 429 else ""


async def websocket_flood(world: World, duration_s: float) -> Outcome:
    """A opens `WS_SOCKETS` sockets (more than the server's whole limit) and sends images on
    them, opening again any the server closes; meanwhile B must still open a socket and be
    answered on it."""
    import aiohttp

    out = Outcome()
    end = time.perf_counter() + duration_s
    image = world.a_images(1)[0]
    async with _session() as session:
        async def holder() -> None:
            while time.perf_counter() < end:
                ws = await _ws_open(session, world, world.tokens.a_infer, A_BOT, out)
                if ws is None:
                    await asyncio.sleep(0.2)
                    continue
                try:
                    while time.perf_counter() < end and not ws.closed:
                        await ws.send_bytes(image)
                        msg = await ws.receive(timeout=30)
                        if msg.type == aiohttp.WSMsgType.CLOSE:
                            out.add(f"closed {msg.data}")
                            break
                        if msg.type != aiohttp.WSMsgType.TEXT:
                            out.add(f"ws {msg.type.name}")
                            break
                        reply = json.loads(msg.data)
                        out.add(f"ws {reply.get('status', 200)} {reply.get('code', '')}".strip())
                        await asyncio.sleep(0.1)
                except (ConnectionError, aiohttp.ClientError):
                    out.add("closed")
                finally:
                    await ws.close()

        async def victim_socket() -> None:
            await asyncio.sleep(min(1.0, duration_s / 2))  # A's sockets are open by then
            ws = await _ws_open(session, world, world.tokens.b_infer, B_BOT, None)
            if ws is None:
                out.violations.append("B's WebSocket was refused during A's socket flood")
                return
            try:
                await ws.send_bytes(world.jpegs[0])
                reply = await ws.receive_json(timeout=30)
                if reply.get("bot_id") != B_BOT:
                    out.violations.append(f"B's WebSocket answered {reply}")
            except (TypeError, ValueError, ConnectionError) as exc:
                out.violations.append(f"B's WebSocket failed: {exc!r}")
            finally:
                await ws.close()

        await asyncio.gather(*(holder() for _ in range(WS_SOCKETS)), victim_socket())
    return out


# -- 6. revoked key on an open socket -----------------------------------------------------------

REVOKED_CLOSE_S = 10.0  # generous: the server closes within 1 s


async def revoked_key(world: World, duration_s: float) -> Outcome:
    """In a loop: the operator makes A an infer key, A opens a socket with it and is answered,
    the operator revokes the key; A's socket must be closed (1008), no answer coming first."""
    import aiohttp

    out = Outcome()
    operator = Tokens.header(world.tokens.operator)
    image = world.a_images(1)[0]
    async with _session() as session:
        async def one() -> None:
            async with session.post(f"{world.url}/keys", json={"tenant": "attacker",
                                                               "scope": "infer"},
                                    headers=operator) as resp:
                key = await resp.json()
            ws = await _ws_open(session, world, key["token"], A_BOT, out)
            if ws is None:
                return
            try:
                await ws.send_bytes(image)
                await ws.receive_json(timeout=30)
                async with session.delete(f"{world.url}/keys/{key['id']}",
                                          headers=operator) as resp:
                    await resp.read()
                await ws.send_bytes(image)  # after the revocation: never answered
                msg = await ws.receive(timeout=REVOKED_CLOSE_S)
                if msg.type == aiohttp.WSMsgType.CLOSE:
                    out.add(f"closed {msg.data}")
                else:
                    out.add(f"answered after revocation ({msg.type.name})")
            except TimeoutError:
                out.add("still open after revocation")
            finally:
                await ws.close()

        await _loop(duration_s, 1, one)
    return out


# -- 7. metrics and readiness -------------------------------------------------------------------


async def metrics_probe(world: World, duration_s: float) -> Outcome:
    """A's metrics key reads /metrics and /readyz in a loop: neither may name B's tenant or bot."""
    out = Outcome()
    async with _session(Tokens.header(world.tokens.a_metrics)) as session:
        async def one() -> None:
            for path in ("/metrics", "/readyz"):
                async with session.get(f"{world.url}{path}") as resp:
                    text = await resp.text()
                    out.add(str(resp.status))
                    for secret in ("victim", B_BOT):
                        if secret in text:
                            out.violations.append(f"{path} names {secret!r} to A's metrics key")
            await asyncio.sleep(0.1)

        await _loop(duration_s, 1, one)
    return out


# -- 8. probing B's bot ids ---------------------------------------------------------------------


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
    async with _session(Tokens.header(world.tokens.a_manage)) as session:
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

        await _loop(duration_s, 1, one)
    return out


# -- 9. registrations ---------------------------------------------------------------------------


async def registration_flood(world: World, duration_s: float) -> Outcome:
    """A registers as fast as it can: new bots (beyond --tenant-max-bots: 403 tenant_limit) and
    new versions of its bot (beyond --tenant-registrations-per-minute: 429
    registration_rate)."""
    out = Outcome()
    upload, content_type = head_upload(["cat", "dog"], world.scratch, "flood")
    turn = iter(range(10**9))
    headers = {**Tokens.header(world.tokens.a_manage), "Content-Type": content_type}
    async with _session() as session:
        async def one() -> None:
            bot = A_BOT if next(turn) % 2 else f"attacker-{uuid.uuid4().hex[:8]}"
            async with session.put(f"{world.url}/bots/{bot}", data=upload,
                                   headers=headers) as resp:
                out.add(await _label(resp))

        await _loop(duration_s, 2, one)
    return out


# -- 10. gRPC -----------------------------------------------------------------------------------

GRPC_CLIENTS = 16


def grpc_missing() -> str | None:
    """Why the gRPC attack cannot run here (the grpc extra missing), else None."""
    from bench.grpc_load import grpc_available

    return grpc_available()


async def grpc_attack(world: World, duration_s: float) -> Outcome:
    """20 MB messages without a key (UNAUTHENTICATED before they are read), then a flood of
    ModelInfer calls with A's key from `GRPC_CLIENTS` clients, 4 images a call."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    out = Outcome()

    def request(images: list[bytes]):
        req = service_pb2.ModelInferRequest(model_name=A_BOT)
        req.inputs.add(name="image_bytes", datatype="BYTES", shape=[len(images)])
        req.raw_input_contents.append(b"".join(struct_len(i) for i in images))
        return req

    big = service_pb2.ModelInferRequest(model_name=B_BOT)
    big.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
    big.raw_input_contents.append(b"\0" * (20 * MIB))
    pool = world.a_images(64)
    turn = iter(range(10**9))
    async with grpc.aio.insecure_channel(world.grpc_address, options=[
            ("grpc.max_send_message_length", 64 * MIB)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def call(req, metadata) -> None:
            try:
                await stub.ModelInfer(req, metadata=metadata, timeout=60)
                out.add("grpc OK")
            except grpc.RpcError as exc:
                out.add(f"grpc {exc.code().name}")
                if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.UNAVAILABLE):
                    await asyncio.sleep(0.05)

        for _ in range(2):
            await call(big, ())
        metadata = (("authorization", f"Bearer {world.tokens.a_infer}"),)

        async def one() -> None:
            i = next(turn) * 4
            await call(request([pool[(i + k) % len(pool)] for k in range(4)]), metadata)

        await _loop(duration_s, GRPC_CLIENTS, one)
    return out


def struct_len(data: bytes) -> bytes:
    """A BYTES element of a raw input: its length (4 bytes, little-endian), then the bytes."""
    return len(data).to_bytes(4, "little") + data


# -- 11. feature-cache probe --------------------------------------------------------------------


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
    async with _session(Tokens.header(world.tokens.a_infer)) as session:
        async def ask(image: bytes) -> None:
            async with session.post(f"{world.url}/classify/{A_BOT}", data=image,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                out.add(await _label(resp))

        async def one() -> None:
            from bench.hostile.world import tiny_jpeg

            await ask(world.b_last())
            await ask(tiny_jpeg(next(fresh)))
            await asyncio.sleep(0.1)

        before = await _cache_hits(session, world)
        await _loop(duration_s, 1, one)
        hits = await _cache_hits(session, world) - before
    if hits:
        out.violations.append(f"A's requests hit the feature cache {hits:.0f} time(s)")
    return out


# -- pending: per-tenant share of the in-flight bytes -------------------------------------------

INFLIGHT_BODIES = 30
INFLIGHT_BODY_BYTES = 10 * MIB


async def inflight_bytes(world: World, duration_s: float) -> Outcome:
    """Many large bodies at once from A (`INFLIGHT_BODIES` of 10 MB, sent at full speed): A is
    to be held to its share of --max-inflight-bytes (429), B never refused (503) for A's use.
    PENDING: per-tenant shares of the in-flight bytes are not on main yet."""
    out = Outcome()
    body = b"\xff\xd8" + b"\0" * (INFLIGHT_BODY_BYTES - 2)
    async with _session(Tokens.header(world.tokens.a_infer)) as session:
        async def one() -> None:
            async with session.post(f"{world.url}/classify/{A_BOT}", data=body,
                                    headers={"Content-Type": "image/jpeg"}) as resp:
                out.add(await _label(resp))

        await _loop(duration_s, INFLIGHT_BODIES, one)
    return out


def _labels(*labels: str) -> frozenset[str]:
    return frozenset(labels)


ATTACKS: tuple[Attack, ...] = (
    Attack("metrics", "A's metrics key reads /metrics and /readyz", _labels("200"),
           metrics_probe, (_labels("200"),)),
    Attack("bot_probe", "A asks about B's bot and an unknown one on every bot route",
           _labels("404 unknown_bot", "429 registration_rate"), bot_probe,
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
           _labels("101", "429 socket_share", "closed", "ws 200", "ws 429"),
           websocket_flood, (_labels("429 socket_share", "closed 1013"),)),
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
           _labels("408 request_timeout", "closed"), slow_uploads,
           (_labels("408 request_timeout", "closed"),)),
    Attack("decode_bomb", "a corrupt image and three 36-megapixel 16-bit PNGs a request",
           _labels("400", "413", "429 rate_limited", "429 queue_share"), decode_bomb,
           (_labels("400 invalid_image", "413 image_too_large", "429 rate_limited"),)),
)

PENDING: tuple[Attack, ...] = (
    Attack("inflight_bytes", f"{INFLIGHT_BODIES} bodies of 10 MB at once",
           _labels("200", "400", "429"), inflight_bytes),
    Attack("slow_uploads_20mb", f"{SLOW_CONNECTIONS} connections trickling a 20 MB body",
           _labels("408 request_timeout", "closed", "429"), slow_uploads_20mb),
)

BY_NAME = {a.name: a for a in ATTACKS + PENDING}
