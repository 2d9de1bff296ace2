"""Streaming endpoints, and the WebSocket `GET /ws/classify/{bot_id}`: the protocol, written once.

A streaming endpoint is an `Endpoint` of the table with a `stream` opener. Its upgrade request
goes through the request pipeline like any request (`service.codecs.pipeline`: request scope,
caller, admission, then the opener, which checks what can fail before the upgrade: those
errors are JSON answers with their status, 401/403/404/400/503), and is answered 101; a
request that is not an upgrade gets the same checks, then 400 (`handle`). Then each message is
answered here, whatever the transport (aiohttp's socket, Ray Serve's ASGI socket, adapted to a
source of `Message`s and a sender of `Outgoing` answers):

- `relay`: one answer per message, in order (a message is read once the one before it is
  answered);
- `answer_message`: each message is a request of its own for logs and traces (a request scope:
  its id is the socket's with `.<n>` for the n-th message, it gets an access line, and its span
  is a child of the socket's); a binary message is answered by the stream's `Session`, anything
  else is a 400; an error is answered as JSON `{"error", "code", "status"}` (and
  `retry_after_s` where HTTP would send `Retry-After`), and the socket stays open.

What a transport does around it: the socket's reservation in the in-flight budget (its
largest message, `max_ws_message_bytes`, for its whole life: the pipeline's admission step),
the message size limit (close code 1009), and cancelling a message still waiting for the trunk
when the connection closes.

`classify_ws`: one image per binary message, one JSON answer per image, in order, rendered as
`POST /classify/{bot_id}` renders one bot's answer. The upgrade carries the credential
(`Authorization`, access INFER as `POST /classify`) and, if any, the routing key for a bot's
canary (`X-Multihead-Route-Key`: every message of the socket is routed by it; without it, each
message by its image's digest). The bot is resolved per message: a long-lived socket follows
the bot's active version.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from service.codecs.base import Answer, Endpoint, Reply, Request, Session, error_answer
from service.codecs.common import BOT_ID_SCHEMA, TOP_K, parse_top_k
from service.codecs.native import render_bot_result
from service.core.auth import INFER
from service.core.candidates import ROUTE_KEY_HEADER
from service.core.engine import Images
from service.core.errors import BadRequest
from service.core.logs import request_scope

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller
    from service.core.service import Service

A = TypeVar("A")

NOT_BINARY = "send each image as one binary message"
WS_PATH = "/ws/classify/{bot_id}"


@dataclass(frozen=True)
class Message:
    """One message received on a stream: binary data, or text."""

    data: bytes | str

    @property
    def binary(self) -> bool:
        return not isinstance(self.data, str)


@dataclass(frozen=True)
class Outgoing:
    """The answer to one message: its status (200, or the error's) and its JSON body."""

    status: int
    body: Mapping[str, Any]

    def text(self) -> str:
        return json.dumps(self.body)


@dataclass(frozen=True)
class Socket:
    """What a message's request scope needs of its socket (picklable: Ray sends it with each
    message to a model replica).

    Attributes:
        id: the socket's request id (its upgrade's `X-Request-Id`).
        route: the endpoint's name.
        path: the upgrade's path.
        template: the route template without regexes (`/ws/classify/{bot_id}`): the message
            spans are named `WS <template>`.
        remote: the client's address, when known.
        trace: the socket span's context as headers (`traceparent`) when that span is in
            another process (Ray); None: the current span is the socket's.
    """

    id: str
    route: str
    path: str
    template: str
    remote: str | None = None
    trace: Mapping[str, str] | None = None


def error_message(exc: BaseException) -> Outgoing:
    """An error as a message's JSON answer (the one error table, as `error_reply`)."""
    status, body, headers = error_answer(exc)
    answer: dict[str, Any] = {**body, "status": status}
    if "Retry-After" in headers:  # 429 / 503: what HTTP says in the header
        answer["retry_after_s"] = int(headers["Retry-After"])
    return Outgoing(status, answer)


async def relay(messages: AsyncIterable[Message], send: Callable[[A], Awaitable[None]],
                answer: Callable[[int, Message], Awaitable[A]]) -> int:
    """Answers the messages of one stream in order: the n-th (from 1) with `answer(n,
    message)` (an `Outgoing`, or its text when a replica made it), sent before the next is
    taken. Returns how many were answered."""
    n = 0
    async for message in messages:
        n += 1
        await send(await answer(n, message))
    return n


async def answer_message(service: Service, socket: Socket, n: int, message: Message,
                         session: Callable[[], Awaitable[Session]]) -> Outgoing:
    """The answer to the n-th message of a socket, in a request scope of its own (see the
    module doc). `session` gives the stream's open `Session` (the socket's; on a transport
    that keeps none per socket, opened for this message: its errors are the message's)."""
    with request_scope(service.tracing, service.settings.access_log, protocol="ws",
                       method="WS", route=socket.route, path=socket.path, headers=socket.trace,
                       remote=socket.remote, span_name=f"WS {socket.template}",
                       request_id_=f"{socket.id}.{n}") as req:
        if not message.binary:
            out = Outgoing(400, {"error": NOT_BINARY, "code": "bad_request", "status": 400})
        else:
            try:
                out = Outgoing(200, await (await session()).answer(message.data))
            except Exception as exc:  # noqa: BLE001 - answer this message, keep the socket
                out = error_message(exc)
        req.status = out.status
        return out


# -- classify_ws ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Classifier:
    """The `Session` of `classify_ws`: each image scored by one bot."""

    caller: Caller
    bot_id: str
    top_k: int

    async def answer(self, data: bytes) -> dict:
        # Resolved per message: a long-lived socket follows the bot's active version.
        head = await self.caller.head(self.bot_id)
        results = await self.caller.classify(Images(encoded=[data]), [head], top_k=self.top_k)
        return render_bot_result([results[0][0]])


async def open_classifier(caller: Caller, request: Request) -> Classifier:
    """The checks before the upgrade (the bot: 404 as an unknown one; `top_k`: 400)."""
    bot_id = request.params["bot_id"]
    await caller.head(bot_id)
    return Classifier(caller, bot_id, parse_top_k(request.query,
                                                  caller.top_k_default))


async def classify_ws_plain(caller: Caller, request: Request) -> Reply:
    """A request to the WebSocket route that is not an upgrade: its checks, then 400."""
    await open_classifier(caller, request)
    raise BadRequest(f"{WS_PATH} is a WebSocket: send an upgrade request (Connection: Upgrade, "
                     f"Upgrade: websocket)")


DESCRIPTION = f"""\
A WebSocket (OpenAPI 3.0 cannot describe one: this is its upgrade request). Open it with an
upgrade request (`Connection: Upgrade`, `Upgrade: websocket`); the server answers `101
Switching Protocols` with the socket's `X-Request-Id`. Then send each image as one **binary**
message: each gets one JSON text message back, in the order sent, the bot's answer as `POST
/classify/{{bot_id}}` gives it (`BotResult`). An error is answered as a message `{{"error",
"code", "status"}}` (with `retry_after_s` when overloaded) and the socket stays open; a text
message is a 400. A message over `max_ws_message_bytes` closes the socket with code 1009.

The credential (`Authorization`) and the routing key for a bot's canary (`{ROUTE_KEY_HEADER}`)
go with the upgrade request: 401, 403 and 404 (another tenant's bot, as an unknown one) are
answered as JSON before any upgrade, as is 503 when the server's in-flight budget cannot hold
the socket's largest message. A request that is not an upgrade gets the same checks, then 400.
The key is checked for the socket's whole life: once it is revoked (or its tenant removed),
the socket is closed with code 1008 and a JSON reason `{{"error", "code": "unauthorized",
"status": 401}}`, and a message sent after the revocation is not answered.
"""

ENDPOINTS = [
    Endpoint("GET", WS_PATH, "classify_ws", classify_ws_plain, access=INFER,
             stream=open_classifier, tag="native",
             summary="a WebSocket: classify each image sent as a binary message with one bot",
             description=DESCRIPTION, path_params={"bot_id": BOT_ID_SCHEMA}, params=(TOP_K,),
             answers={101: Answer(
                 "the upgrade: from now on, one JSON text message (`BotResult`, or an error) "
                 "per binary message, in order",
                 headers={"X-Request-Id": ("the socket's request id; its n-th message's is "
                                           "`<id>.<n>`", True)})},
             errors=(400, 404, 503)),
]
