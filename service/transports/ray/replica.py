"""The Ray transport's model replicas: one `Service` each, answering the ingress's calls.

A `Call` is one routed request as the ingress hands it over (picklable: it crosses processes).
`answer(service, call)` runs it through the request pipeline (`service.codecs.pipeline`), as
the aiohttp transport runs a request: the same request scope (request id, span, access line),
caller, admission (the body is already in this process: its bytes are held against this
replica's budget too), codecs and error table, metrics and Server-Timing by endpoint name. A
request no endpoint matched is answered 404/405 and counted under `UNMATCHED`; a request the
ingress refused itself (a body over the limit, the budget full, a lost replica) is answered
with that refusal at the admission step, after the caller step, as on aiohttp.

A streaming endpoint (the WebSocket) is two kinds of calls, since the replicas keep no
per-socket state (each call may reach another replica):
- its upgrade (`Call.upgrade`): the pipeline with the stream's opener as handler (its checks
  answer JSON errors), answered 101 with the socket's request id and, when tracing is on, its
  span's context (`traceparent`); counted, not timed, when it opens;
- each message (`Call.message`): `stream.answer_message` (a request scope of its own, id
  `<socket id>.<n>`, span under the socket's), with the stream opened for this message from
  the upgrade's request (the caller's credential checked again, the message's bytes held
  against this replica's budget). A message cancelled because the client left counts the
  socket's route with 499.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass

from ray import serve

from service.codecs import pipeline, stream
from service.codecs.base import Endpoint, Reply, Request, Session, error_reply
from service.codecs.pipeline import Incoming
from service.codecs.routes import ENDPOINTS
from service.core.admission import Reservation
from service.core.errors import ServiceError
from service.core.logs import REQUEST_ID_HEADER, RequestLog, configure
from service.core.service import Service
from service.core.settings import Settings
from service.transports.common.exchange import metric_label, no_route
from service.transports.common.router import route_template

log = logging.getLogger(__name__)

REPLICA_HEADER = "X-Multihead-Replica"
TRACEPARENT = "traceparent"

ENDPOINTS_BY_NAME = {endpoint.name: endpoint for endpoint in ENDPOINTS}


@dataclass(frozen=True)
class Delivery:
    """One message of a stream, as the ingress hands it to a model replica."""

    socket: stream.Socket
    n: int  # its rank on the socket, from 1
    data: bytes | str


@dataclass(frozen=True)
class Call:
    """One routed request, as the ingress hands it to a model replica (picklable).

    `endpoint` is the matched endpoint's name, or None when no endpoint matched: the replica
    then answers 404, or 405 with `allowed`, and counts it like any request (the ingress
    counts nothing itself: the replicas hold the metrics). `refused`: the ingress's own
    refusal of the request (its body over the limit, ...), which the replica answers (and
    counts) at the pipeline's admission step. `upgrade`: a streaming endpoint's upgrade;
    `message`: one message of an open stream (`request` is then the upgrade's).
    """

    endpoint: str | None
    request: Request  # without its body reader: the body travels as bytes
    body: bytes = b""
    allowed: tuple[str, ...] = ()
    refused: ServiceError | None = None
    upgrade: bool = False
    message: Delivery | None = None

    def local_answer(self) -> Reply | None:
        """What the ingress answers itself, uncounted, when no replica takes this call in
        time: a no-route or refused call's answer; None for a routed call (it needs one)."""
        if self.refused is not None:
            return error_reply(self.refused)
        return no_route(self.allowed) if self.endpoint is None else None


class ReplyOutcome:
    """How the pipeline's answers leave a model replica (`pipeline.Outcome`): a `Reply` with
    `X-Request-Id` and Server-Timing, which the ingress sends as it is."""

    def error(self, exc: Exception) -> Reply:
        return error_reply(exc)

    def status(self, answer: Reply) -> int:
        return answer.status

    def cancelled(self, req: RequestLog) -> int:
        # The client left: Ray's proxy cancelled the ingress's request, which cancelled this
        # call (`Ingress._call`); the batcher has withdrawn the request's queued rows.
        return pipeline.CLIENT_CLOSED

    async def done(self, answer: Reply, req: RequestLog, timing: str | None) -> Reply:
        headers = {**answer.headers, REQUEST_ID_HEADER: req.request_id}
        if timing is not None:
            headers[pipeline.SERVER_TIMING] = timing
        return dataclasses.replace(answer, headers=headers)


REPLY = ReplyOutcome()


async def answer(service: Service, call: Call) -> Reply:
    """Answers one routed request (see the module doc). What a model replica does with each
    call; a function of the `Service` so that it runs without Ray too
    (tests/service/transports/test_same_answers.py)."""
    endpoint = ENDPOINTS_BY_NAME[call.endpoint] if call.endpoint is not None else None
    if call.message is not None and endpoint is not None:
        return await _message(service, endpoint, call.request, call.message)
    request = call.request
    incoming = Incoming(
        "http", request.method, metric_label(endpoint), request.path, request.headers,
        f"{request.method} {route_template(endpoint.path)}" if endpoint else request.method,
        params=request.params, stream=endpoint is not None and endpoint.stream is not None,
        attributes=lambda: {"http.request.method": request.method, "url.path": request.path})

    def admit(held: Reservation) -> None:
        if call.refused is not None:
            raise call.refused
        held.take(len(call.body))

    async def step(caller, held: Reservation) -> Reply:
        if endpoint is None:
            return no_route(call.allowed)
        if call.upgrade and endpoint.stream is not None:
            await endpoint.stream(caller, request)
            trace = service.tracing.carrier() if service.tracing is not None else {}
            return Reply(pipeline.SWITCHING_PROTOCOLS, headers=trace,
                         key_id=caller.principal.key_id)
        body = call.body

        async def read_body() -> bytes:
            return body

        return await endpoint.handle(caller, dataclasses.replace(request, read_body=read_body))

    return await pipeline.run(service, incoming, step, REPLY,
                              access=endpoint.access if endpoint is not None else None,
                              admit=admit)


async def _message(service: Service, endpoint: Endpoint, request: Request,
                   delivery: Delivery) -> Reply:
    """One message of a stream: answered as on aiohttp, the stream opened for it."""
    with Reservation(service.inflight) as held:
        async def opened() -> Session:
            caller = pipeline.caller_of(service, endpoint.access, request.headers)
            held.tenant = pipeline.tenant_of(caller)  # nothing held yet: counted under it
            held.take(len(delivery.data))
            return await endpoint.stream(caller, request)

        try:
            out = await stream.answer_message(service, delivery.socket, delivery.n,
                                              stream.Message(delivery.data), opened)
        except asyncio.CancelledError:
            # Cancelled: the client left while the message waited (its rows are withdrawn).
            pipeline.record(service.metrics, endpoint.name, pipeline.CLIENT_CLOSED, None)
            raise
    return Reply(out.status, out.text().encode())


class Replica:
    """One model replica: one `Service` (trunk, batcher, store) in one Ray actor process."""

    async def __init__(self, settings: Settings) -> None:
        # NOTE: this actor's lines go where Ray sends its workers' stderr (files, the driver).
        configure(settings.log_format)
        self.settings = settings
        self.service = Service(settings)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.service.identity = {"replica": self.name, "pid": os.getpid()}
        await self.service.start()
        if not await self.service.wait_ready():
            # Ray retries a replica whose constructor fails, and routes nothing to it meanwhile.
            raise RuntimeError(self.service.readiness.error or "bring-up failed")
        log.info("replica %s ready (pid %d)", self.name, os.getpid())

    async def check_health(self) -> None:
        """Ray calls this periodically; raising makes Ray replace the replica."""
        if not self.service.readiness.ready:
            raise RuntimeError(self.service.readiness.error or "not ready")

    async def handle(self, call: Call) -> Reply:
        """Answers one routed request (`answer`), naming this replica in the reply."""
        reply = await answer(self.service, call)
        return dataclasses.replace(reply, headers={**reply.headers, REPLICA_HEADER: self.name})

    async def metrics_text(self) -> tuple[str, str]:
        """(this replica's name, its Prometheus text): what the ingress merges into the answer
        to /metrics. A call of the ingress to every replica, not a request: not counted."""
        body, _ = self.service.render_metrics()
        return self.name, body.decode()

    async def live_keys(self, key_ids: list[str]) -> list[str]:
        """Which of `key_ids` this replica's key table (its store snapshot) still accepts:
        what the ingress asks every CLOSE_WATCH_S about its open sockets' keys. A call of the
        ingress, not a request: not counted."""
        keys = self.service.store.key_table()
        return [k for k in key_ids if k in keys]

    async def __del__(self) -> None:
        # Ray calls this when it stops the replica, after draining its ongoing requests.
        await self.service.close()
