"""The Ray transport's ingress: what Ray's HTTP proxy calls, an ASGI app without TensorFlow.

It routes with `service.transports.common.router.Router` over `service.codecs.routes.ENDPOINTS`,
reads the body within the size limit and byte budget, and passes the request to a model
replica (`service.transports.ray.replica`) through a deployment handle (Ray balances the
replicas). A request no endpoint matches goes to a replica too (without its body), which
answers 404/405 and counts it: the replicas hold the metrics. So does a request the ingress
refuses itself (a body over `max_body_bytes`, the byte budget full, a lost replica): its
refusal goes to a replica (without the body) to be answered and counted; only with no replica
answering within PROBE_TIMEOUT_S does the ingress answer it uncounted. The ingress's budget is
one for all tenants (everything counts under ""): it holds no key table and the replica checks
the credential after the body is read, so the tenant is not known when a body is admitted
here; the replicas' budgets are shared by tenant (`service.core.admission`). When a model replica
dies with requests in flight, a request that is safe to repeat (everything but the admin
writes) is retried once on another replica, and the rest get 503 `replica_lost` + Retry-After
(counted by another replica), never a bare 500.

WebSockets: Ray's proxy hands the ingress the ASGI websocket scope (Ray 2.60, `serve.ingress`
with `__serve_build_asgi_app__`; a deployment whose `__call__` takes a Starlette `Request`
cannot take one: Ray builds that `Request` from the scope, and Starlette's `Request` accepts
only an `http` scope). The upgrade of a streaming endpoint holds its largest message
(`max_ws_message_bytes`) of this ingress's byte budget for the socket's whole life, then goes to
a replica (`Call.upgrade`), which checks the caller, the bot and the parameters: an error is
answered before the upgrade as JSON with its status (the ASGI denial response); 101 accepts the
socket with its `X-Request-Id`. Each message then goes to a replica as a call of its own
(`Call.message`) and its answer is sent back, one per message, in order (`stream.relay`). The
socket is read ahead: when the client leaves while a message waits for the trunk, that call is
cancelled (the replica withdraws its rows and counts 499); a message over `max_ws_message_bytes`
closes the socket with 1009; a message the replica refuses 401 (the socket's key was revoked
since, or its tenant removed: the replica checks the key per message) closes it with 1008
and a JSON reason, as on aiohttp. An idle socket whose key was revoked is closed too: the
ingress holds no key table, so every KEYS_WATCH_S while sockets are open it asks a model
replica which of their keys are still accepted (`ReplicaKeys`), and closes the others with
1008: within that + the replica's store poll, under a second as on aiohttp. A route
that is not a stream answers an upgrade request with its
HTTP answer, as aiohttp does.

Metrics: `/metrics` goes to a replica like any request (it checks the caller's access and
counts the scrape); then the ingress asks every model replica for its metrics
(`DeploymentHandle.broadcast`), waits at most METRICS_TIMEOUT_S for each, and answers their
merge (`service.core.metrics_merge`: counters and histograms summed, gauges by meaning,
`multihead_metrics_replicas_missing` for replicas that did not answer), cut to a tenant's own
series for a tenant's key (the scope the replica put on its reply: `service.core.metrics_scope`).

Cancellation: a client that disconnects makes Ray's proxy cancel the ingress's request, which
cancels its call to the model replica: the replica counts a 499 and its batcher withdraws the
request's rows still queued for the trunk (as on aiohttp and gRPC).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.websockets import WebSocket

from service.codecs import pipeline, stream
from service.codecs.base import Endpoint, Reply, Request, error_reply
from service.codecs.routes import ENDPOINTS
from service.core import connections, memory
from service.core.admission import ByteBudget, Reservation
from service.core.errors import (
    DeadlineExceeded,
    NotReady,
    Overloaded,
    ReplicaLost,
    ServiceError,
)
from service.core.logs import REQUEST_ID_HEADER
from service.core.metrics_merge import Aggregate
from service.core.metrics_scope import scoped
from service.core.settings import Settings
from service.transports.common.exchange import IncomingBody, build_request, chunks
from service.transports.common.router import Router, route_template
from service.transports.ray.replica import (
    ENDPOINTS_BY_NAME,
    REPLICA_HEADER,
    TRACEPARENT,
    Call,
    Delivery,
)

log = logging.getLogger(__name__)

# Readiness endpoints (ops /readyz, OIP v2 server ready): answered "not ready" by the ingress
# when no model replica takes them within PROBE_TIMEOUT_S.
READINESS_PROBES = frozenset({"readyz", "oip_server_ready"})
PROBE_TIMEOUT_S = 2.0
# The endpoint whose answer the ingress builds from every model replica's metrics, and how
# long it waits for each replica.
METRICS_ENDPOINT = "metrics"
METRICS_TIMEOUT_S = 2.0
# The ASGI extension that lets an app answer a WebSocket upgrade with an HTTP response.
DENIAL_EXTENSION = "websocket.http.response"
CLOSE_TOO_BIG = 1009  # RFC 6455: a message too big to process
# Refused: when the server cannot send a denial response, and a message whose key was revoked.
CLOSE_POLICY = connections.CLOSE_POLICY
CLOSE_REASON = connections.CLOSE_REASON
UNAUTHORIZED = 401
# How often the ingress asks a model replica which of its open sockets' keys are still
# accepted (seconds): a revoked key's idle socket is closed within this + the replica's store
# poll (0.25 s) + the call.
KEYS_WATCH_S = 0.25


class ReplicaKeys(connections.Connections):
    """The ingress's open sockets by API key, checked against a model replica's key table (the
    ingress has no store): each round asks one replica which keys are still accepted
    (`Replica.live_keys`); a round whose call fails (no replica) changes nothing."""

    def __init__(self, model: DeploymentHandle) -> None:
        super().__init__(dict, every_s=KEYS_WATCH_S)
        self._model = model

    async def live(self, key_ids):
        try:
            return set(await asyncio.wait_for(self._model.live_keys.remote(list(key_ids)),
                                              PROBE_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - no replica now: asked again next round
            log.debug("no model replica said which keys are live: %r", exc)
            return None


class _Closed(Exception):
    """The relay's end: the socket was closed (its key was revoked)."""


class Ingress:
    """What Ray's HTTP proxy calls (an ASGI app: `serve.ingress` builds it with
    `__serve_build_asgi_app__`): routes, reads the body within the limits, and hands the
    request to a model replica through a deployment handle.

    NOTE: a separate, light deployment (no TensorFlow) so that a model replica that dies with
    requests in flight costs those requests a retry on another replica (classification and
    every read are safe to repeat) or an explicit 503, never the proxy's bare 500.
    """

    def __init__(self, model: DeploymentHandle, settings: Settings) -> None:
        self.model = model
        self.settings = settings
        self.router = Router(ENDPOINTS)
        self.inflight = ByteBudget(settings.max_inflight_bytes, on_burst_end=memory.Trimmer())
        self.metrics = Aggregate()
        self.keys = ReplicaKeys(model)
        self._asked = 0  # model replicas asked for their metrics at the last scrape

    def __serve_build_asgi_app__(self):  # noqa: N807 - Ray's hook
        # NOTE: a plain coroutine function, not the bound method: uvicorn (which runs the
        # app's lifespan for Ray) takes any other callable for an ASGI 2 app.
        async def app(scope: dict[str, Any], receive, send) -> None:
            await self.asgi(scope, receive, send)

        return app

    async def asgi(self, scope: dict[str, Any], receive, send) -> None:
        """The ASGI app: HTTP requests, WebSockets and the lifespan protocol."""
        if scope["type"] == "http":
            response = await self.respond(HttpRequest(scope, receive, send))
            await response(scope, receive, send)
        elif scope["type"] == "websocket":
            await self.websocket(WebSocket(scope, receive, send))
        elif scope["type"] == "lifespan":  # nothing to start or stop: the replicas hold it
            while True:
                event = (await receive())["type"]
                if event == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif event == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def respond(self, http: HttpRequest) -> Response:
        """The answer to one HTTP request."""
        match = self.router.match(http.method, http.url.path)
        try:
            reply = await self._forward(http, match.endpoint, match.params, match.allowed)
            if (match.endpoint is not None and match.endpoint.name == METRICS_ENDPOINT
                    and reply.status == 200):
                reply = await self._all_metrics(reply)
        except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
            reply = error_reply(exc)
        body = b"" if http.method == "HEAD" else reply.body
        return _response(reply, body)

    async def _forward(self, http: HttpRequest, endpoint: Endpoint | None,
                       params: dict[str, str], allowed: tuple[str, ...]) -> Reply:
        query, headers = http.query_params.multi_items(), http.headers.items()
        request = build_request(http.method, http.url.path, params, query, headers)
        name = None if endpoint is None else endpoint.name
        with Reservation(self.inflight) as held:
            body: bytes | bytearray = b""
            if endpoint is not None:  # else a replica answers it (and counts it) unread
                incoming = IncomingBody(chunks(http.stream(), ClientDisconnect), request.headers,
                                        self.settings.max_body_bytes)
                try:
                    incoming.admit(held)
                    body = await incoming.read()
                except ServiceError as exc:  # refused here: a replica answers and counts it
                    return await self._call(Call(name, request, refused=exc))
            call = Call(name, request, bytes(body), allowed)
            del body
            return await self._deliver(call)

    async def _deliver(self, call: Call) -> Reply:
        """`call` answered by a model replica; retried once on another when its replica dies,
        unless it is an admin write (never repeated behind a client); 503 `replica_lost`
        when it cannot be."""
        endpoint = ENDPOINTS_BY_NAME.get(call.endpoint) if call.endpoint is not None else None
        tries = 1 if endpoint is not None and endpoint.admin else 2
        for attempt in range(1, tries + 1):
            try:
                return await self._call(call)
            except RayActorError:
                log.warning("a replica died serving %s %s (try %d of %d)",
                            call.request.method, call.request.path, attempt, tries)
        lost = ReplicaLost(
            "the replica serving this request stopped; retry (another replica answers)")
        if call.message is not None:  # a message: answered here (messages are not counted)
            out = stream.error_message(lost)
            return Reply(out.status, out.text().encode())
        return await self._call(dataclasses.replace(call, body=b"", refused=lost))

    # -- WebSockets ----------------------------------------------------------------------------

    async def websocket(self, ws: WebSocket) -> None:
        """One WebSocket upgrade, then the socket's messages (see the module doc)."""
        path = ws.url.path
        match = self.router.match("GET", path)
        endpoint = match.endpoint
        request = build_request("GET", path, match.params, ws.query_params.multi_items(),
                                ws.headers.items())
        if endpoint is None or endpoint.stream is None:  # its HTTP answer, as on aiohttp
            try:
                reply = await self._deliver(Call(endpoint.name if endpoint else None, request,
                                                 allowed=match.allowed))
            except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
                reply = error_reply(exc)
            await _deny(ws, reply)
            return
        with Reservation(self.inflight) as held:
            refused = None
            try:
                # NOTE: an open socket may be receiving a message of up to its size limit at
                # any time: it holds that much of the budget for its whole life.
                held.take(self.settings.max_ws_message_bytes)
            except Overloaded as exc:
                refused = exc
            try:
                reply = await self._deliver(Call(endpoint.name, request, refused=refused,
                                                 upgrade=True))
            except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
                reply = error_reply(exc)
            if reply.status != pipeline.SWITCHING_PROTOCOLS:
                await _deny(ws, reply)
                return
            socket_id = reply.headers.get(REQUEST_ID_HEADER, "ws")
            await ws.accept(headers=[(name.lower().encode(), reply.headers[name].encode())
                                     for name in (REQUEST_ID_HEADER, REPLICA_HEADER)
                                     if name in reply.headers])
            trace = ({TRACEPARENT: reply.headers[TRACEPARENT]} if TRACEPARENT in reply.headers
                     else None)
            socket = stream.Socket(socket_id, endpoint.name, path, route_template(endpoint.path),
                                   trace=trace)

            async def close() -> None:  # its key was revoked: 1008 with the JSON reason
                await ws.close(CLOSE_POLICY, CLOSE_REASON)

            with self.keys.hold_key(reply.key_id, close):
                await self._relay(ws, socket, request)

    async def _relay(self, ws: WebSocket, socket: stream.Socket, request: Request) -> None:
        """Answers the socket's messages in order until it closes; a message still waiting
        when the client leaves is cancelled."""
        inbox: asyncio.Queue[stream.Message] = asyncio.Queue()
        limit = self.settings.max_ws_message_bytes

        async def messages():
            while True:
                yield await inbox.get()

        async def answer(n: int, message: stream.Message) -> Reply:
            return await self._deliver(Call(socket.route, request, message=Delivery(
                socket, n, message.data)))

        async def send(reply: Reply) -> None:
            if reply.status == UNAUTHORIZED:
                # The replica checked the key again and refused it (revoked, or its tenant
                # removed): the socket is closed, as on aiohttp.
                await ws.close(CLOSE_POLICY, CLOSE_REASON)
                raise _Closed
            await ws.send_text(reply.body.decode())

        relaying = asyncio.create_task(stream.relay(messages(), send, answer))

        async def read() -> None:
            try:
                while True:
                    event = await ws.receive()
                    if event["type"] == "websocket.disconnect":
                        return
                    data = event.get("bytes")
                    if data is None:
                        data = event.get("text") or ""
                    size = len(data) if isinstance(data, bytes) else len(data.encode())
                    if size > limit:
                        await ws.close(CLOSE_TOO_BIG)
                        return
                    inbox.put_nowait(stream.Message(data))
            finally:
                relaying.cancel()  # the client left (or was closed): nothing more is sent

        reader = asyncio.create_task(read())
        try:
            await asyncio.wait([relaying])
        finally:
            reader.cancel()
            relaying.cancel()
        if (not relaying.cancelled() and relaying.exception() is not None
                and not isinstance(relaying.exception(), _Closed)):
            log.warning("a WebSocket relay ended with %r", relaying.exception())

    # -- metrics --------------------------------------------------------------------------------

    async def _all_metrics(self, reply: Reply) -> Reply:
        """The answer to /metrics: every model replica's metrics, merged
        (`service.core.metrics_merge`). `reply` is the answer of the replica that checked the
        caller's access and counted the scrape, as for any request; its body is replaced by
        the merge, cut to the caller's own series (`reply.scope`: a tenant's key) after
        merging (`service.core.metrics_scope`)."""
        texts, missing = await self._replica_metrics()
        body, content_type = self.metrics.merge(texts, missing)
        if reply.scope is not None:
            body = scoped(body, reply.scope)
        return dataclasses.replace(reply, body=body, content_type=content_type)

    async def _replica_metrics(self) -> tuple[dict[str, str], int]:
        """{replica name: its Prometheus text} of every model replica that answers within
        METRICS_TIMEOUT_S, and how many replicas asked did not (killed, stuck)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + METRICS_TIMEOUT_S
        # NOTE: the public `results_async` has one timeout for all the replicas: one stuck
        # replica would lose every answer. So each replica's result is awaited within the
        # deadline on its own, through `_fetch_replica_results_async` (the step `results_async`
        # starts with in Ray 2.60, pinned in setup.py; tests/scaleout/test_ray.py calls it).
        try:
            broadcast = self.model.broadcast("metrics_text")
            results = await asyncio.wait_for(broadcast._fetch_replica_results_async(),
                                             METRICS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - no replica to ask: the sums remembered
            log.warning("no model replica could be asked for its metrics: %r", exc)
            return {}, max(self._asked, 1)
        answers = await asyncio.gather(
            *(asyncio.wait_for(result.get_async(), max(deadline - loop.time(), 0.1))
              for result in results), return_exceptions=True)
        texts: dict[str, str] = {}
        for got in answers:
            if isinstance(got, BaseException):
                log.warning("a model replica did not give its metrics: %r", got)
            else:
                name, text = got
                texts[name] = text
        self._asked = len(answers)
        return texts, len(answers) - len(texts)

    async def _call(self, call: Call) -> Reply:
        # NOTE: with no model replica ready, Ray queues the call until one is: a readiness
        # probe must not wait for that, it must say "not ready", and a request no endpoint
        # matches or the ingress refused is still answered at once (uncounted: no replica to
        # count it).
        local = call.local_answer()
        probe = local is not None or call.endpoint in READINESS_PROBES
        timeout = PROBE_TIMEOUT_S if probe else self.settings.request_timeout_s + 5.0
        response = self.model.handle.remote(call)
        try:
            return await asyncio.wait_for(response, timeout)
        except asyncio.CancelledError:
            # The client left: Ray's proxy cancelled this request. The model replica's handler
            # must be cancelled too (its batcher then withdraws the request's queued rows).
            # NOTE: Ray 2.60 does it by itself (measured with tests/scaleout/test_ray.py, this
            # line taken out), but awaiting a DeploymentResponse in a cancelled task does not
            # cancel the call: done here so as not to depend on how Ray does it.
            response.cancel()
            raise
        except (TimeoutError, RayActorError) as exc:
            if isinstance(exc, TimeoutError):
                response.cancel()  # given up: not to be assigned or run for nobody
            if local is not None:
                return local
            if isinstance(exc, RayActorError):
                raise
            if probe:
                raise NotReady("no replica is ready") from None
            raise DeadlineExceeded(f"no replica answered within {timeout:.0f} s") from None


def _response(reply: Reply, body: bytes) -> Response:
    return Response(body, status_code=reply.status, headers=dict(reply.headers),
                    media_type=reply.content_type)


async def _deny(ws: WebSocket, reply: Reply) -> None:
    """Answers a WebSocket upgrade with `reply` instead of upgrading (the ASGI denial response;
    a close before the upgrade, which the server answers 403, where it has none)."""
    if DENIAL_EXTENSION in ws.scope.get("extensions", {}):
        await ws.send_denial_response(_response(reply, reply.body))
    else:
        await ws.close(CLOSE_POLICY)
