"""`GET /ws/classify/{bot_id}` (aiohttp WebSocket): one image per binary message, one JSON
reply per image, in order; the native codec renders each answer and each error. The upgrade
request carries the credential (`Authorization`, access INFER as `POST /classify`) and, if any,
the routing key for a bot's canary (`X-Multihead-Route-Key`: every message of the socket is
routed by it; without it, each message by its image's digest).

Each message is a request of its own for logs and traces (`service.core.logs.request_scope`):
its id is the socket's (the upgrade's `X-Request-Id`, echoed in the upgrade's answer) with
`.<n>` for the n-th message, it gets an access line, and its span is a child of the socket's.
"""
from __future__ import annotations

import json

from aiohttp import web

from service.codecs.base import error_reply
from service.codecs.common import parse_top_k
from service.codecs.native import render_bot_result
from service.core.admission import Reservation
from service.core.auth import INFER
from service.core.caller import Caller
from service.core.candidates import ROUTE_KEY_HEADER
from service.core.engine import Images
from service.core.logs import REQUEST_ID_HEADER, current, request_scope
from service.core.service import Service


async def classify_ws(service: Service, request: web.Request) -> web.WebSocketResponse:
    bot_id = request.match_info["bot_id"]
    # Auth (INFER, as POST /classify) and the bot's 404 before the upgrade: JSON errors.
    caller = service.caller(request.headers.get("Authorization"), INFER,
                            route_key=request.headers.get(ROUTE_KEY_HEADER))
    await caller.head(bot_id)
    top_k = parse_top_k(request.query, caller.top_k_default)
    with Reservation(service.inflight) as held:
        # NOTE: an open socket may be receiving a message of up to its size limit at any time:
        # it holds that much of the in-flight budget for its whole life (503 if none is left).
        held.take(service.settings.max_ws_message_bytes)
        return await _serve(service, caller, request, bot_id, top_k)


async def _serve(service: Service, caller: Caller, request: web.Request, bot_id: str,
                 top_k: int) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(max_msg_size=service.settings.max_ws_message_bytes,
    heartbeat=30)
    socket = current()  # the upgrade request's (the middleware's request_scope)
    socket_id = socket.request_id if socket is not None else "ws"
    ws.headers[REQUEST_ID_HEADER] = socket_id
    route = request.match_info.route
    span_name = f"WS {route.resource.canonical}" if route.resource is not None else "WS"
    await ws.prepare(request)
    received = 0
    async for message in ws:
        if message.type == web.WSMsgType.ERROR:
            # A protocol error or a message over max_ws_message_bytes: aiohttp has already
            # closed the socket with the right close code (1002, 1009, ...).
            break
        received += 1
        with request_scope(service.tracing, service.settings.access_log, protocol="ws",
                           method="WS", route=route.name or "", path=request.rel_url.raw_path,
                           headers=None, remote=request.remote, span_name=span_name,
                           request_id_=f"{socket_id}.{received}") as req:
            req.status = await _answer(caller, ws, message, bot_id, top_k)
    return ws


async def _answer(caller: Caller, ws: web.WebSocketResponse, message: web.WSMessage,
                  bot_id: str, top_k: int) -> int:
    """Answers one message; returns the status its answer carries (200 for a result)."""
    if message.type != web.WSMsgType.BINARY:
        await ws.send_json({"error": "send each image as one binary message",
                            "code": "bad_request", "status": 400})
        return 400
    try:
        # Resolved per message: a long-lived socket follows the bot's active version.
        head = await caller.head(bot_id)
        results = await caller.classify(Images(encoded=[message.data]), [head], top_k=top_k)
        await ws.send_json(render_bot_result([results[0][0]]))
        return 200
    except Exception as exc:  # noqa: BLE001 - answer this message, keep the socket
        reply = error_reply(exc)
        answer = {**json.loads(reply.body), "status": reply.status}
        if "Retry-After" in reply.headers:  # 429 / 503: what HTTP says in the header
            answer["retry_after_s"] = int(reply.headers["Retry-After"])
        await ws.send_json(answer)
        return reply.status
