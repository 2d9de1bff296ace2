"""A streaming endpoint's upgrade on aiohttp: the socket adapted to the stream protocol of
`service.codecs.stream` (a source of messages, a sender of answers).

The upgrade request has been through the request pipeline up to its handler (request scope,
caller, admission: the socket's largest message held in the in-flight budget for its whole
life); the stream is opened (its checks answer JSON errors before the upgrade), the upgrade
answers 101 with the socket's `X-Request-Id`, and `stream.relay` answers each message in order
(`stream.answer_message`: a request scope per message). A tenant opens at most its share of
`max_websockets` (`service.core.sockets`: 429 `socket_share` before the upgrade; a socket
pushed out for a tenant within its share is closed with 1013; so is one whose reservation of
the in-flight bytes is pushed out, `service.core.admission`, with the code `inflight_share`).
A message over `max_ws_message_bytes` or a protocol error closes the socket with its close
code (aiohttp's: 1009, 1002, ...). A
socket whose connection closes while a message waits for the trunk is cancelled by aiohttp
(`app.server_options`), which withdraws the message's rows; a close frame alone is read once
the message before it is answered.

The socket's key is checked for its whole life (`service.core.connections`): a message that
arrives once the key is revoked (or its tenant removed) is not answered, and the socket is
closed with code 1008 and a JSON reason, as it is within a second of the revocation when
no message comes.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from service.codecs import stream
from service.codecs.base import Endpoint, Request
from service.core import deadlines, sockets
from service.core.admission import Reservation
from service.core.connections import CLOSE_POLICY, CLOSE_REASON
from service.core.logs import REQUEST_ID_HEADER, current

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller
    from service.core.service import Service

# What aiohttp's heartbeat pings an idle socket with (seconds).
HEARTBEAT_S = 30.0


def is_upgrade(request: web.Request) -> bool:
    """Whether the request asks for a WebSocket upgrade that aiohttp can accept."""
    return web.WebSocketResponse().can_prepare(request).ok


async def serve(service: Service, endpoint: Endpoint, caller: Caller, request: web.Request,
                neutral: Request, held: Reservation) -> web.WebSocketResponse:
    """Opens the stream of `endpoint` for `caller`, upgrades, and answers its messages until
    the socket closes; `held` is its reservation of the in-flight bytes, which may be pushed
    out once the socket is open (closed with 1013, `inflight_share`)."""
    session = await endpoint.stream(caller, neutral)
    ws = web.WebSocketResponse(max_msg_size=service.settings.max_ws_message_bytes,
                               heartbeat=HEARTBEAT_S)
    upgrade = current()  # the upgrade request's (the pipeline's request scope)
    socket = stream.Socket(
        id=upgrade.request_id if upgrade is not None else "ws", route=endpoint.name,
        path=request.rel_url.raw_path, template=request.match_info.route.resource.canonical,
        remote=request.remote)
    ws.headers[REQUEST_ID_HEADER] = socket.id
    connections, principal = service.connections, caller.principal
    tenant = principal.tenant or ""

    async def push_out() -> None:  # made room for a tenant within its share: 1013
        # NOTE: a socket pushed out between its admission and its upgrade (a few ms) is not
        # closed: it lives on uncounted, one over the total at most per such race.
        if ws.prepared:
            await ws.close(code=sockets.CLOSE_TRY_LATER, message=sockets.CLOSE_REASON.encode())

    pushed = service.sockets.admit(tenant, ws, push_out)  # 429 socket_share before the upgrade
    try:
        if pushed is not None:
            await pushed()
        await ws.prepare(request)
        closing: list[asyncio.Task] = []

        def pushed_out() -> None:  # its bytes made room for a tenant within its share: 1013
            closing.append(asyncio.get_running_loop().create_task(ws.close(
                code=sockets.CLOSE_TRY_LATER, message=sockets.BYTES_CLOSE_REASON.encode())))

        # The upgrade's X-Multihead-Deadline-Ms (checked by the pipeline), else the tenant's
        # default deadline, is each message's, counted from the message's arrival.
        per_message_ms = deadlines.request_ms(neutral.headers,
                                              service.tenancy.deadline_ms(tenant))
        with held.pushable(pushed_out):
            return await _relay(service, socket, session, ws, connections, principal,
                                per_message_ms)
    finally:
        service.sockets.release(tenant, ws)


async def _relay(service: Service, socket: stream.Socket, session: stream.Session,
                 ws: web.WebSocketResponse, connections, principal,
                 per_message_ms: float | None) -> web.WebSocketResponse:

    async def close() -> None:  # its key was revoked: 1008 with the JSON reason
        await ws.close(code=CLOSE_POLICY, message=CLOSE_REASON.encode())

    async def opened() -> stream.Session:
        return session

    async def answer(n: int, message: stream.Message) -> stream.Outgoing | None:
        if not connections.accepts(principal):  # refused: the socket is closed instead
            await close()
            return None
        deadline = (None if per_message_ms is None
                    else time.monotonic() + per_message_ms / 1000.0)
        with deadlines.scope(deadline):
            return await stream.answer_message(service, socket, n, message, opened)

    async def send(out: stream.Outgoing | None) -> None:
        if out is None or ws.closed:
            return
        if not connections.accepts(principal):  # revoked while the message was answered
            await close()
            return
        await ws.send_str(out.text())

    with connections.hold(principal, close):
        await stream.relay(_messages(ws), send, answer)
    return ws


async def _messages(ws: web.WebSocketResponse) -> AsyncIterator[stream.Message]:
    async for message in ws:
        if message.type == web.WSMsgType.ERROR:
            # A protocol error or a message over max_ws_message_bytes: aiohttp has already
            # closed the socket with the right close code (1002, 1009, ...).
            return
        yield stream.Message(message.data if message.type in (web.WSMsgType.BINARY,
                                                              web.WSMsgType.TEXT) else "")
