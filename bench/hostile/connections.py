"""The hostile tenant's attacks on connections (`bench.hostile.attacks` lists them): slow
uploads, a WebSocket flood, a key revoked under an open WebSocket."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

from bench.hostile.common import Outcome, client_of, loop
from bench.hostile.world import A_BOT, B_BOT, Tokens, World

# -- slow uploads ----------------------------------------------------------------------------

SLOW_CONNECTIONS = 40
# Declared per connection, as the attack: 40 of them (800 MB) pass the in-flight budget
# (256 MiB): A's connections beyond it are refused before their bodies (429 inflight_share).
SLOW_DECLARED = 20_000_000


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


# -- WebSocket flood -------------------------------------------------------------------------

WS_SOCKETS = 16  # twice the server's max-websockets


async def _ws_open(session, world: World, token: str, bot: str, out: Outcome | None):
    import aiohttp

    try:
        ws = await session.ws_connect(f"{world.url}/ws/classify/{bot}",
                                      headers=Tokens.header(token))
    except aiohttp.WSServerHandshakeError as exc:
        if out is not None:  # aiohttp keeps no body of a refused handshake: the status only
            out.add(str(exc.status))
        return None
    if out is not None:
        out.add("101")
    return ws


async def websocket_flood(world: World, duration_s: float) -> Outcome:
    """A opens `WS_SOCKETS` sockets (more than the server's whole limit) and sends images on
    them, opening again any the server closes; meanwhile B must still open a socket and be
    answered on it."""
    import aiohttp

    out = Outcome()
    end = time.perf_counter() + duration_s
    image = world.a_images(1)[0]
    async with client_of() as session:
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


# -- revoked key on an open socket -----------------------------------------------------------

REVOKED_CLOSE_S = 10.0  # generous: the server closes within 1 s


REVOKED_PER_S = 5


async def revoked_key(world: World, duration_s: float) -> Outcome:
    """In a loop: the operator makes A an infer key, A opens a socket with it and is answered,
    the operator revokes the key; A's socket must be closed (1008), no answer coming first.
    At most REVOKED_PER_S rounds a second: the operator's key changes, not a tenant's flood
    (each is two store writes and a new snapshot of the keys)."""
    import aiohttp

    out = Outcome()
    operator = Tokens.header(world.tokens.operator)
    image = world.a_images(1)[0]
    async with client_of() as session:
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
            await asyncio.sleep(1 / REVOKED_PER_S)

        await loop(duration_s, 1, one)
    return out
