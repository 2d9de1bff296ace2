"""`GET /ws/classify/{bot_id}` (aiohttp WebSocket): one image per binary message, one JSON
reply per image, in order; the native codec renders each answer and each error. The upgrade
request carries the credential (`Authorization`, access INFER as `POST /classify`) and, if any,
the routing key for a bot's canary (`X-Multihead-Route-Key`: every message of the socket is
routed by it; without it, each message by its image's digest)."""
from __future__ import annotations

import json

from aiohttp import web

from service.codecs.base import error_reply
from service.codecs.common import parse_top_k
from service.codecs.native import render_bot_result
from service.core.admission import Reservation
from service.core.auth import INFER
from service.core.candidates import ROUTE_KEY_HEADER
from service.core.context import Service
from service.core.engine import Images


async def classify_ws(service: Service, request: web.Request) -> web.WebSocketResponse:
    bot_id = request.match_info["bot_id"]
    # Auth (INFER, as POST /classify) and the bot's 404 before the upgrade: JSON errors.
    service = service.caller(request.headers.get("Authorization"), INFER,
                             route_key=request.headers.get(ROUTE_KEY_HEADER))
    await service.head(bot_id)
    top_k = parse_top_k(request.query, service.settings.top_k_default)
    with Reservation(service.inflight) as held:
        # NOTE: an open socket may be receiving a message of up to its size limit at any time:
        # it holds that much of the in-flight budget for its whole life (503 if none is left).
        held.take(service.settings.max_ws_message_bytes)
        return await _serve(service, request, bot_id, top_k)


async def _serve(service: Service, request: web.Request, bot_id: str,
                 top_k: int) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(max_msg_size=service.settings.max_ws_message_bytes,
    heartbeat=30)
    await ws.prepare(request)
    async for message in ws:
        if message.type == web.WSMsgType.ERROR:
            # A protocol error or a message over max_ws_message_bytes: aiohttp has already
            # closed the socket with the right close code (1002, 1009, ...).
            break
        if message.type != web.WSMsgType.BINARY:
            await ws.send_json({"error": "send each image as one binary message",
                                "code": "bad_request", "status": 400})
            continue
        try:
            # Resolved per message: a long-lived socket follows the bot's active version.
            head = await service.head(bot_id)
            results = await service.classify(Images(encoded=[message.data]), [head],
                                             top_k=top_k)
            await ws.send_json(render_bot_result([results[0][0]]))
        except Exception as exc:  # noqa: BLE001 - answer this message, keep the socket
            reply = error_reply(exc)
            answer = {**json.loads(reply.body), "status": reply.status}
            if "Retry-After" in reply.headers:  # 429 / 503: what HTTP says in the header
                answer["retry_after_s"] = int(reply.headers["Retry-After"])
            await ws.send_json(answer)
    return ws
