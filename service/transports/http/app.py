"""The aiohttp transport: moves bytes between HTTP and the protocol codecs.

Every route of `service.codecs.routes.ENDPOINTS` becomes an aiohttp route whose handler builds a
transport-neutral `Request`, calls `dispatch` (admin check, codec, service, error mapping) and
writes the `Reply`; the glue every transport shares (the request, the body within its limits,
the 404/405 answers, request metrics and Server-Timing by endpoint name) is
`service.transports.common.exchange`. What only aiohttp does stays here: the WebSocket route
(`service.transports.http.ws`), the web page and static files, JSON bodies for aiohttp's other
errors and for requests it cannot parse, and the lifecycle (`cleanup_ctx`: the `Service` starts
its bring-up at start-up and drains on shutdown, SIGTERM included, after aiohttp stopped
accepting). A client that goes away (its connection closes) cancels its handler
(`server_options`, which every server of the app must be made with; unless the settings'
`cancel_on_disconnect` is off): the request's rows still queued for the trunk are withdrawn, its
in-flight bytes given back, and metrics count it with status 499 (`CLIENT_CLOSED`, as gRPC
does); a WebSocket whose connection closes while its image waits likewise (a close frame alone
is read once the image is answered). The listeners given
to `create_app` (the gRPC server, when the command that serves has a `grpc_port`) run over the
same `Service` and start and stop with it: they stop accepting when HTTP does, and drain within
the same timeout.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web, web_protocol

from service.codecs.base import Endpoint, Reply, dispatch, error_reply
from service.codecs.routes import ENDPOINTS
from service.core import admission
from service.core.admission import Reservation
from service.core.errors import INTERNAL_MESSAGE
from service.core.logs import REQUEST_ID_HEADER, request_scope
from service.core.service import Service
from service.core.settings import Settings
from service.transports.common.exchange import (
    CLIENT_CLOSED,
    SERVER_TIMING,
    UNMATCHED,
    admit_body,
    build_request,
    chunks,
    content_length,
    no_route,
    record,
)
from service.transports.common.lifecycle import ListenerFactory
from service.transports.http import ws
from store import HeadStore

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"

SERVICE = web.AppKey("service", Service)
# The listeners beside HTTP (the gRPC server when `grpc_port` is set), started and stopped with it.
LISTENERS = web.AppKey("listeners", list)

WS_ROUTE = "classify_ws"

# The codes of aiohttp's own errors other than "no route" (`common.exchange.no_route`).
_HTTP_CODES = {400: "bad_request", 404: "not_found", 413: "payload_too_large",
               415: "unsupported_media_type"}


def to_response(reply: Reply) -> web.Response:
    headers = dict(reply.headers)
    headers["Content-Type"] = reply.content_type
    return web.Response(status=reply.status, body=reply.body, headers=headers)


def _handler(endpoint: Endpoint):
    async def handle(request: web.Request) -> web.Response:
        service = request.app[SERVICE]
        # NOTE: held until the answer is built: the body's bytes live that long. The body is
        # read only when a codec asks; aiohttp stops at the declared length, so a longer body
        # is never read here.
        with Reservation(service.inflight) as held:
            read_body = admit_body(chunks(request.content.iter_any(), ConnectionError),
                                   content_length(request.headers),
                                   service.settings.max_body_bytes, held)
            reply = await dispatch(service, endpoint, build_request(
                request.method, request.path, request.match_info, request.query.items(),
                request.headers.items(), read_body))
        return to_response(reply)

    handle.__name__ = endpoint.name
    return handle


def _span_attributes(request: web.Request, template: str | None) -> dict[str, str]:
    """The request span's attributes (OpenTelemetry's HTTP server conventions)."""
    attributes = {"http.request.method": request.method, "url.path": request.path,
                  "url.scheme": request.scheme}
    if template is not None:
        attributes["http.route"] = template
    if request.remote:
        attributes["client.address"] = request.remote
    return attributes


@web.middleware
async def transport_middleware(request: web.Request, handler):
    """JSON bodies for aiohttp's own errors (no route, wrong method, body too large) and any
    error a transport handler lets escape; request metrics and Server-Timing by route name (the
    endpoint's name, `common.exchange.UNMATCHED` when no route matched); the request's id
    (`X-Request-Id`, echoed), span and access line (`service.core.logs.request_scope`)."""
    service = request.app[SERVICE]
    route = request.match_info.route
    matched = route.resource is not None
    template = route.resource.canonical if matched else None
    with request_scope(
            service.tracing, service.settings.access_log, protocol="http",
            method=request.method, route=route.name if matched else UNMATCHED,
            path=request.rel_url.raw_path, headers=request.headers, remote=request.remote,
            span_name=f"{request.method} {template}" if template else request.method,
            attributes=(_span_attributes(request, template) if service.tracing is not None
                        else None)) as req:
        try:
            response = await _answer(request, handler, matched)
        except web.HTTPException as exc:  # a redirect: aiohttp answers it
            req.status = exc.status
            raise
        req.status = response.status
        if not isinstance(response, web.WebSocketResponse):  # a socket sent its headers
            response.headers[REQUEST_ID_HEADER] = req.request_id
        return response


async def _answer(request: web.Request, handler, matched: bool) -> web.StreamResponse:
    """The handler's answer, or the JSON error body; counted in metrics, with Server-Timing."""
    start = time.perf_counter()
    route = request.match_info.route
    label = route.name if matched else UNMATCHED
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if not matched:  # aiohttp's router found no route: 404, or 405 with the allowed methods
            response = to_response(no_route(getattr(exc, "allowed_methods", ())))
        elif isinstance(exc, web.HTTPRequestEntityTooLarge):
            response = to_response(error_reply(admission.too_large(
                request.app[SERVICE].settings.max_body_bytes)))
        else:
            # e.g. a static file that is not there, the page when none is installed
            response = web.json_response(
                {"error": exc.reason, "code": _HTTP_CODES.get(exc.status, "http_error")},
                status=exc.status)
    except asyncio.CancelledError:
        # The client went away (`server_options`), or shutdown cancelled what was left.
        # A socket's lifetime is not a request's latency (as below): counted, not timed.
        record(request.app[SERVICE].metrics, label, CLIENT_CLOSED,
               None if label == WS_ROUTE else start)
        raise
    except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
        response = to_response(error_reply(exc))
    metrics = request.app[SERVICE].metrics
    if isinstance(response, web.WebSocketResponse):
        # A socket's lifetime is not a request's latency: count it, keep it out of the histogram.
        record(metrics, label, response.status, None)
        return response
    response.headers[SERVER_TIMING] = record(metrics, label, response.status, start)
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
               listeners: Sequence[ListenerFactory] = (),
               tracer_provider=None) -> web.Application:
    """The application. Pass `trunk`/`store` to share already-built ones (tests, benchmark);
    the app then neither builds nor closes them. `listeners` build the other listeners of this
    process (the gRPC server) from its `Service`; they start and stop with the app.
    `tracer_provider`: an OpenTelemetry SDK tracer provider to trace with (tests); by default
    the settings and the OTEL_* variables decide (`service.core.tracing`)."""
    app = web.Application(middlewares=[transport_middleware],
                          client_max_size=settings.max_body_bytes)
    app[SERVICE] = Service(settings, trunk=trunk, store=store, tracer_provider=tracer_provider)
    app[LISTENERS] = [factory(app[SERVICE]) for factory in listeners]
    app.on_shutdown.append(_stop_accepting)
    app.cleanup_ctx.append(_lifecycle)
    # NOTE: aiohttp's own router routes here, not `common.router.Router` (which Ray's ingress
    # uses): it also routes what is not an endpoint (the page, the static files, the WebSocket)
    # and fills `match_info` the middleware labels metrics with, and a catch-all route over
    # Router would hide the table from aiohttp's tooling. tests/service/transports/
    # test_router.py holds the two routers to the same match on every method and path kind, and
    # tests/service/transports/test_same_answers.py the two transports to the same answers.
    app.router.add_get("/", index, name="index")
    for endpoint in ENDPOINTS:
        app.router.add_route(endpoint.method, endpoint.path, _handler(endpoint),
                             name=endpoint.name)
    app.router.add_get("/ws/classify/{bot_id}",
                       lambda request: ws.classify_ws(request.app[SERVICE], request),
                       name=WS_ROUTE)
    if STATIC_DIR.exists():
        app.router.add_static("/static", STATIC_DIR, name="static")
    return app


def server_options(settings: Settings) -> dict[str, bool]:
    """The options every aiohttp server of the app is made with (`run_app`'s, the tests'):
    `handler_cancellation` as `settings.cancel_on_disconnect`.

    NOTE: aiohttp (since 3.9) lets a handler run on after its client disconnected unless the
    server is made with handler_cancellation=True: then the handler task is cancelled, which
    withdraws the request's queued rows (`Batcher.submit_many`). aiohttp's own TestServer sets
    it whatever it is given (tests/support/servers.py makes its servers with these options)."""
    return {"handler_cancellation": settings.cancel_on_disconnect}


def run_app(settings: Settings, listeners: Sequence[ListenerFactory] = ()) -> None:
    """Serves until SIGTERM/SIGINT, then shuts down gracefully: stop accepting, drain, close."""
    # NOTE: access_log=None: the access lines are service.core.logs' (every protocol alike,
    # --no-access-log), not aiohttp's.
    web.run_app(create_app(settings, listeners=listeners), host=settings.host, port=settings.port,
                shutdown_timeout=settings.request_timeout_s, **server_options(settings),
                access_log=None, print=lambda msg: log.info(msg.strip()))
