"""The aiohttp transport: moves bytes between HTTP and the protocol codecs.

Every route of `service.codecs.routes.ENDPOINTS` becomes an aiohttp route whose handler builds a
transport-neutral `Request`, calls `dispatch` (admin check, codec, service, error mapping) and
writes the `Reply`. What only aiohttp does stays here: the request body limit, the WebSocket
route (`service.transports.http.ws`), the web page and static files, JSON bodies for aiohttp's
own 404/405, per-route request metrics, and the lifecycle (`cleanup_ctx`: the `Service` starts
its bring-up at start-up and drains on shutdown, SIGTERM included, after aiohttp stopped
accepting). The listeners given to `create_app` (the gRPC server, when the command that serves
has a `grpc_port`) run over the same `Service` and start and stop with it: they stop accepting
when HTTP does, and drain within the same timeout.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web, web_protocol

from heads import HeadStore
from service.codecs.base import Endpoint, Reply, Request, dispatch, error_reply
from service.codecs.routes import ENDPOINTS
from service.core import admission, memory
from service.core.admission import Reservation
from service.core.context import Service
from service.core.errors import INTERNAL_MESSAGE, BadRequest
from service.core.settings import Settings
from service.transports.common.lifecycle import ListenerFactory
from service.transports.http import ws

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"

SERVICE = web.AppKey("service", Service)
# The listeners beside HTTP (the gRPC server when `grpc_port` is set), started and stopped with it.
LISTENERS = web.AppKey("listeners", list)

_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
               413: "payload_too_large", 415: "unsupported_media_type"}


async def _chunks(request: web.Request):
    try:
        async for chunk in request.content.iter_any():
            yield chunk
    except ConnectionError:  # the client went away mid-body
        raise BadRequest("the request body was cut short") from None


def to_request(request: web.Request, held: Reservation) -> Request:
    """The codecs' view of an aiohttp request; the body is read only when a codec asks
    (`admission.read_body`: in place for a declared length, counted as it streams if chunked)."""
    limit = request.app[SERVICE].settings.max_body_bytes

    async def read_body() -> bytes | bytearray:
        # NOTE: aiohttp stops at the declared length, so a longer body is never read here.
        return await admission.read_body(_chunks(request), request.content_length, limit, held)

    return Request(
        method=request.method,
        path=request.path,
        params=dict(request.match_info),
        query={key: request.query.get(key) for key in request.query.keys()},
        headers={key.lower(): value for key, value in request.headers.items()},
        read_body=read_body,
    )


def to_response(reply: Reply) -> web.Response:
    headers = dict(reply.headers)
    headers["Content-Type"] = reply.content_type
    return web.Response(status=reply.status, body=reply.body, headers=headers)


def _handler(endpoint: Endpoint):
    async def handle(request: web.Request) -> web.Response:
        service = request.app[SERVICE]
        # NOTE: held until the answer is built: the body's bytes live that long.
        with Reservation(service.inflight) as held:
            admission.admit(request.content_length, service.settings.max_body_bytes, held)
            reply = await dispatch(service, endpoint, to_request(request, held))
        return to_response(reply)

    handle.__name__ = endpoint.name
    return handle


@web.middleware
async def transport_middleware(request: web.Request, handler):
    """JSON bodies for aiohttp's own errors (no route, wrong method, body too large) and any
    error a transport handler lets escape; request counts and latency by route template."""
    start = time.perf_counter()
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            response = to_response(error_reply(admission.too_large(
                request.app[SERVICE].settings.max_body_bytes)))
        else:
            response = web.json_response(
                {"error": exc.reason, "code": _HTTP_CODES.get(exc.status, "http_error")},
                status=exc.status, headers={k: v for k, v in exc.headers.items()
                                            if k.lower() == "allow"})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
        response = to_response(error_reply(exc))
    elapsed_s = time.perf_counter() - start
    if isinstance(response, web.WebSocketResponse):
        # A socket's lifetime is not a request's latency: count it, keep it out of the histogram.
        request.app[SERVICE].metrics.observe_request(route, response.status, None)
        return response
    response.headers["Server-Timing"] = f"app;dur={elapsed_s * 1000:.1f}"
    request.app[SERVICE].metrics.observe_request(route, response.status, elapsed_s)
    return response


def _protocol_error(self, request, status: int = 500, exc: BaseException | None = None,
                    message: str | None = None) -> web.StreamResponse:
    """aiohttp's answer to a request it could not parse (request line, headers, framing),
    as the JSON error body instead of text/plain; logged as one line, not a traceback."""
    if status >= 500:
        # aiohttp's own handler logs the traceback; its text/plain answer is replaced below.
        _aiohttp_handle_error(self, request, status, exc, message)
        body = {"error": INTERNAL_MESSAGE, "code": "internal"}
    else:
        reason = (message or getattr(exc, "message", None) or "").strip().splitlines()
        log.info("malformed HTTP request from %s: %s", request.remote,
                 reason[0][:200] if reason else status)
        detail = f": {reason[0][:100]}" if reason else ""
        body = {"error": f"malformed HTTP request{detail}",
                "code": _HTTP_CODES.get(status, "bad_request")}
    response = web.Response(status=status, content_type="application/json",
                            body=b"" if request.method == "HEAD" else json.dumps(body).encode())
    response.force_close()
    return response


# NOTE: aiohttp answers requests it cannot parse before any app code runs (no middleware sees
# them). Its hook for that answer is RequestHandler.handle_error, which every server of this
# process shares; replacing it makes those answers JSON too, like every other error.
_aiohttp_handle_error = web_protocol.RequestHandler.handle_error
web_protocol.RequestHandler.handle_error = _protocol_error


async def _lifecycle(app: web.Application):
    service = app[SERVICE]
    for listener in app[LISTENERS]:
        await listener.open()  # binds now (a port in use fails the start)
    await service.start()
    yield
    for listener in app[LISTENERS]:
        await listener.close()  # the drain begun by _stop_accepting
    await service.close()


async def _stop_accepting(app: web.Application) -> None:
    """on_shutdown, i.e. when the HTTP sites stopped accepting: the other listeners refuse new
    calls too, and their calls in flight drain while the HTTP handlers do (same
    `request_timeout_s`)."""
    for listener in app[LISTENERS]:
        listener.begin_stop()


async def index(request: web.Request) -> web.StreamResponse:
    page = STATIC_DIR / "index.html"
    if not page.exists():
        raise web.HTTPNotFound(reason="no web page installed")
    return web.FileResponse(page)


def create_app(settings: Settings, *, trunk=None, store: HeadStore | None = None,
               listeners: Sequence[ListenerFactory] = ()) -> web.Application:
    """The application. Pass `trunk`/`store` to share already-built ones (tests, benchmark);
    the app then neither builds nor closes them. `listeners` build the other listeners of this
    process (the gRPC server) from its `Service`; they start and stop with the app."""
    app = web.Application(middlewares=[transport_middleware],
                          client_max_size=settings.max_body_bytes)
    app[SERVICE] = Service(settings, trunk=trunk, store=store)
    app[LISTENERS] = [factory(app[SERVICE]) for factory in listeners]
    app.on_shutdown.append(_stop_accepting)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_get("/", index)
    for endpoint in ENDPOINTS:
        app.router.add_route(endpoint.method, endpoint.path, _handler(endpoint),
                             name=endpoint.name)
    app.router.add_get("/ws/classify/{bot_id}",
                       lambda request: ws.classify_ws(request.app[SERVICE], request),
                       name="classify_ws")
    if STATIC_DIR.exists():
        app.router.add_static("/static", STATIC_DIR)
    return app


def run_app(settings: Settings, listeners: Sequence[ListenerFactory] = ()) -> None:
    """Serves until SIGTERM/SIGINT, then shuts down gracefully: stop accepting, drain, close."""
    memory.tune_allocator()
    web.run_app(create_app(settings, listeners=listeners), host=settings.host, port=settings.port,
                shutdown_timeout=settings.request_timeout_s,
                print=lambda msg: log.info(msg.strip()))
