"""The aiohttp transport: moves bytes between HTTP and the protocol codecs.

Every request runs through the request pipeline (`service.codecs.pipeline`: request scope,
caller, admission, handler, error, metrics; `run` with `HttpOutcome`, which renders answers as
aiohttp responses with `X-Request-Id` and Server-Timing). Every route of
`service.codecs.routes.ENDPOINTS` becomes an aiohttp route whose handler runs it with the
endpoint's access rule, the body admitted before it is read (`common.exchange.IncomingBody`)
and the codec's call as the handler step, writing its `Reply`; a streaming endpoint's upgrade
request opens its stream (`service.transports.http.ws`). What only aiohttp serves (the web page
and static files) and what aiohttp answers itself (no route: 404/405, JSON bodies for its other
errors and for requests it cannot parse) run through the pipeline too, without a caller, from
`transport_middleware`. The lifecycle: `cleanup_ctx` (the `Service` starts its bring-up at
start-up and drains on shutdown, SIGTERM included, after aiohttp stopped accepting). A client
that goes away (its connection closes) cancels its handler (`server_options`, which every
server of the app must be made with; unless the settings' `cancel_on_disconnect` is off): the
request's rows still queued for the trunk are withdrawn, its in-flight bytes given back, and
metrics count it with status 499 (`CLIENT_CLOSED`, as gRPC does); a WebSocket whose connection
closes while its image waits likewise (a close frame alone is read once the image is answered).
A request pushed out of the in-flight bytes before its body is read, for a tenant within its
share (429 `inflight_share`, `service.core.admission`), has its connection closed. So has a
client too slow to send its request, answered 408 `request_timeout`: its head within
`header_timeout_s` (`timeouts`), its body at `body_min_rate_bytes_s` after `body_grace_s`
(`common.exchange.paced`).
The listeners given to `create_app` (the gRPC server, when the command that serves has a
`grpc_port`) run over the same `Service` and start and stop with it: they stop accepting when
HTTP does, and drain within the same timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web, web_protocol

from service.codecs import pipeline
from service.codecs.base import Endpoint, Reply, error_reply
from service.codecs.pipeline import UNMATCHED, Incoming
from service.codecs.routes import ENDPOINTS
from service.core import admission
from service.core.admission import Reservation
from service.core.errors import INTERNAL_MESSAGE
from service.core.logs import REQUEST_ID_HEADER, RequestLog
from service.core.service import Service
from service.core.settings import Settings
from service.transports.common.exchange import (
    IncomingBody,
    build_request,
    chunks,
    no_route,
    paced,
)
from service.transports.common.lifecycle import ListenerFactory
from service.transports.http import ws
from service.transports.http.timeouts import HEADER_TIMEOUT, REQUEST_TIMEOUT
from store import HeadStore

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"

SERVICE = web.AppKey("service", Service)
# The listeners beside HTTP (the gRPC server when `grpc_port` is set), started and stopped with it.
LISTENERS = web.AppKey("listeners", list)

ENDPOINT_NAMES = frozenset(endpoint.name for endpoint in ENDPOINTS)

# The codes of aiohttp's own errors other than "no route" (`common.exchange.no_route`).
_HTTP_CODES = {400: "bad_request", 404: "not_found", 413: "payload_too_large",
               415: "unsupported_media_type"}


def to_response(reply: Reply) -> web.Response:
    headers = dict(reply.headers)
    headers["Content-Type"] = reply.content_type
    return web.Response(status=reply.status, body=reply.body, headers=headers)


class HttpOutcome:
    """How the pipeline's answers leave on aiohttp (`pipeline.Outcome`): responses, with
    `X-Request-Id` and Server-Timing; aiohttp's own errors (no route, wrong method, body too
    large, a static file that is not there) as JSON bodies."""

    def __init__(self, settings: Settings, request: web.Request | None = None) -> None:
        self.settings = settings
        self.request = request

    def error(self, exc: Exception) -> web.StreamResponse:
        if not isinstance(exc, web.HTTPException):
            return to_response(error_reply(exc))
        if exc.status < 400:  # a redirect: sent as aiohttp made it
            return web.Response(status=exc.status, headers=exc.headers, text=exc.text)
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            return to_response(error_reply(admission.too_large(self.settings.max_body_bytes)))
        # e.g. a static file that is not there, the page when none is installed
        return web.json_response(
            {"error": exc.reason, "code": _HTTP_CODES.get(exc.status, "http_error")},
            status=exc.status)

    def status(self, answer: web.StreamResponse) -> int:
        return answer.status

    def cancelled(self, req: RequestLog) -> int:
        return pipeline.CLIENT_CLOSED

    async def done(self, answer: web.StreamResponse, req: RequestLog,
                   timing: str | None) -> web.StreamResponse:
        if (answer.status == REQUEST_TIMEOUT
                or (answer.status >= 400 and self.request is not None
                    and not self.request.content.is_eof())):
            # A body too slow, or refused before it was read whole (refused early, pushed out
            # of the byte budget): the connection is closed after the answer, not kept by
            # reading (and dropping) the rest of the body.
            answer.force_close()
            if self.request is not None and self.request.transport is not None:
                close_unread(self.request.transport)
        if not answer.prepared:  # a socket has sent its headers
            answer.headers[REQUEST_ID_HEADER] = req.request_id
            if timing is not None:
                answer.headers[pipeline.SERVER_TIMING] = timing
        return answer


def _incoming(request: web.Request, route: str, template: str | None, *,
              stream: bool = False) -> Incoming:
    return Incoming(
        "http", request.method, route, request.rel_url.raw_path, request.headers,
        f"{request.method} {template}" if template else request.method, request.remote,
        request.match_info, lambda: _span_attributes(request, template), stream,
        functools.partial(_stop_reading, request))


def _stop_reading(request: web.Request) -> None:
    """Pauses reading the connection of a request whose body is not read whole (it is closed
    after its answer: `HttpOutcome.done`); a body read whole leaves the connection as it is."""
    if request.transport is not None and not request.content.is_eof():
        with contextlib.suppress(Exception):
            request.transport.pause_reading()


def _handler(endpoint: Endpoint):
    """The aiohttp handler of one endpoint: the request pipeline around its codec call."""

    async def handle(request: web.Request) -> web.StreamResponse:
        service = request.app[SERVICE]
        incoming = _incoming(request, endpoint.name, request.match_info.route.resource.canonical,
                             stream=endpoint.stream is not None)
        if endpoint.stream is not None and ws.is_upgrade(request):
            async def open_stream(caller, held: Reservation) -> web.StreamResponse:
                return await ws.serve(service, endpoint, caller, request, build_request(
                    request.method, request.path, request.match_info, request.query.items(),
                    request.headers.items()), held)

            # NOTE: an open socket may be receiving a message of up to its size limit at any
            # time: it holds that much of the in-flight budget for its whole life.
            return await pipeline.run(
                service, incoming, open_stream, HttpOutcome(service.settings, request),
                access=endpoint.access,
                admit=lambda held: held.take(service.settings.max_ws_message_bytes))
        # NOTE: the body is read only when the codec asks; aiohttp stops at the declared
        # length, so a longer body is never read here. Its bytes are held until the answer is
        # built.
        settings = service.settings
        body = IncomingBody(paced(chunks(request.content.iter_any(), ConnectionError),
                                  settings.body_min_rate_bytes_s, settings.body_grace_s),
                            request.headers, settings.max_body_bytes)

        async def call(caller, held: Reservation) -> web.StreamResponse:
            return to_response(await endpoint.handle(caller, build_request(
                request.method, request.path, request.match_info, request.query.items(),
                request.headers.items(), body.read)))

        return await pipeline.run(service, incoming, call, HttpOutcome(service.settings, request),
                                  access=endpoint.access, admit=body.admit)

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
    """What is not an endpoint through the request pipeline too, without a caller: the web
    page and static files under their route's name, and what aiohttp answers itself (no route:
    404, or 405 with the allowed methods) under `UNMATCHED`. The endpoints' handlers run it
    themselves (`_handler`)."""
    route = request.match_info.route
    if route.name in ENDPOINT_NAMES:
        return await handler(request)
    matched = route.resource is not None
    template = route.resource.canonical if matched else None
    service = request.app[SERVICE]

    async def answer(caller, held: Reservation) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if matched or exc.status >= 500 or exc.status < 400:
                raise
            # aiohttp's router found no route: 404, or 405 with the allowed methods
            return to_response(no_route(getattr(exc, "allowed_methods", ())))

    return await pipeline.run(service, _incoming(request, route.name if matched else UNMATCHED,
                                                 template),
                              answer, HttpOutcome(service.settings, request))


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
    app[HEADER_TIMEOUT] = settings.header_timeout_s  # `timeouts`: 408 for a slow head
    app[SERVICE] = Service(settings, trunk=trunk, store=store, tracer_provider=tracer_provider)
    app[LISTENERS] = [factory(app[SERVICE]) for factory in listeners]
    app.on_shutdown.append(_stop_accepting)
    app.cleanup_ctx.append(_lifecycle)
    # NOTE: aiohttp's own router routes here, not `common.router.Router` (which Ray's ingress
    # uses): it also routes what is not an endpoint (the page, the static files)
    # and fills `match_info` the middleware labels metrics with, and a catch-all route over
    # Router would hide the table from aiohttp's tooling. tests/service/transports/
    # test_router.py holds the two routers to the same match on every method and path kind, and
    # tests/service/transports/test_same_answers.py the two transports to the same answers.
    app.router.add_get("/", index, name="index")
    for endpoint in ENDPOINTS:
        app.router.add_route(endpoint.method, endpoint.path, _handler(endpoint),
                             name=endpoint.name)
    if STATIC_DIR.exists():
        app.router.add_static("/static", STATIC_DIR, name="static")
    return app


# How long a connection closed with its body unread stays open after its answer (reading
# nothing) before it is reset: the client's time to read the answer (as Go's net/http waits).
UNREAD_CLOSE_S = 0.5


def close_unread(transport: asyncio.Transport) -> None:
    """Makes `transport`'s close, once its answer is written, a close that reads nothing more:
    reading paused, a FIN after the answer, the socket reset UNREAD_CLOSE_S later. Closing at
    once with unread bytes would reset the connection at once: a client still sending its
    body (most do not read before they have sent it) could lose the answer."""
    loop = asyncio.get_running_loop()

    def linger() -> None:
        if transport.is_closing():
            return
        with contextlib.suppress(Exception):
            transport.pause_reading()
        with contextlib.suppress(Exception):
            transport.write_eof()  # after what is buffered: the answer
        loop.call_later(UNREAD_CLOSE_S, transport.abort)

    transport.close = linger  # aiohttp's close of the connection, when the answer is sent


def server_options(settings: Settings) -> dict[str, bool | float]:
    """The options every aiohttp server of the app is made with (`run_app`'s, the tests'):
    `handler_cancellation` as `settings.cancel_on_disconnect`, and no lingering close.

    NOTE: lingering_time 0: a request answered before its body was read whole (refused from
    its head, pushed out of the byte budget) has its connection closed after the answer.
    aiohttp's default read and dropped the rest for up to 10 s, at the client's pace: a tenant
    whose 30 clients sent 10 MB bodies refused anyway had the event loop read 600 MB a second.

    NOTE: aiohttp (since 3.9) lets a handler run on after its client disconnected unless the
    server is made with handler_cancellation=True: then the handler task is cancelled, which
    withdraws the request's queued rows (`Batcher.submit_many`). aiohttp's own TestServer sets
    it whatever it is given (tests/support/servers.py makes its servers with these options)."""
    return {"handler_cancellation": settings.cancel_on_disconnect, "lingering_time": 0}


def run_app(settings: Settings, listeners: Sequence[ListenerFactory] = ()) -> None:
    """Serves until SIGTERM/SIGINT, then shuts down gracefully: stop accepting, drain, close."""
    # NOTE: access_log=None: the access lines are service.core.logs' (every protocol alike,
    # --no-access-log), not aiohttp's.
    app = create_app(settings, listeners=listeners)
    app[SERVICE].freeze_gc_when_ready = True  # the process's one service
    web.run_app(app, host=settings.host, port=settings.port,
                shutdown_timeout=settings.request_timeout_s, **server_options(settings),
                access_log=None, print=lambda msg: log.info(msg.strip()))
