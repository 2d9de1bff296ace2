"""The request pipeline: what every transport runs around a codec call, written once.

    request scope -> caller -> admission -> handler -> error -> metrics

- request scope (`service.core.logs.request_scope`): the request's id (`X-Request-Id` /
  `x-request-id` when sane, else a new one), its span when tracing is on, its access line; the
  bot a path names is noted at once (a 401 line names it too);
- caller (`Service.caller`): the credential (`authorization`) checked against the endpoint's
  access rule, and the routing key for canaries (`X-Multihead-Route-Key`), read from the
  request's headers or metadata; skipped for a request no endpoint matched;
- early refusal: a tenant whose quota cannot hold what the request costs at least (one image;
  a native upload's declared length / 640 x 480 x 3: `head_images`; the inference endpoints,
  `REFUSED_EARLY`) beside its requests already past this point and not yet charged, or whose
  registrations per minute are spent so (`put_bot`), is refused here, before its body is read;
  else the request holds its claim on the bucket until it is charged (`Tenancy.refuse_early`,
  `Quotas.claim`);
- deadline: the request's `X-Multihead-Deadline-Ms` header (or metadata), else its tenant's
  default deadline, once its caller is known (`service.core.deadlines`: 400 invalid_deadline
  when malformed), kept for the step;
- admission (`service.core.admission`): the bytes the request holds in the process's in-flight
  budget (`Service.inflight`), under its caller's tenant (`tenant_of`: its share of the
  budget), until its answer is built (a body's declared length, a gRPC
  message's size, a WebSocket's largest message for the socket's whole life), taken by the
  transport's `admit` step; the transport's own refusals (gRPC's drain, what Ray's ingress
  refused) are raised there too, after the caller: a caller without the right gets 401/403
  whatever the size of what it sent;
- handler: the transport's step (the codec call, reading a body on demand);
- error: any exception becomes the transport's error answer through the one error table
  (`service.core.errors`; `service.codecs.base.error_reply` for HTTP); a tenant's refusal is
  held first (`service.core.admission.RefusalPacer`: a 429 its Retry-After up to 1 s, a
  400/404/409/413 0.1 s), and its refusals beyond its shares counted
  (`tenant_refusals_total`);
- metrics: `requests_total` / `request_seconds` under the endpoint's NAME (`Endpoint.name`, as
  an RPC mapped to that endpoint is; `UNMATCHED` for a request no endpoint matched),
  Server-Timing, 499 when the client left (`CLIENT_CLOSED`, nginx's code) or what the transport
  says a cancellation is (gRPC: 504 when the client's deadline passed). A stream's upgrade
  (101) and a stream cancelled are counted, not timed: a socket's lifetime is not a latency.

What differs between transports is only how an answer is rendered and sent: the `Outcome` seam
(HTTP: a response with headers; gRPC: the typed message, or a status with trailing metadata).

    answer = await run(service, Incoming("http", "POST", "classify", path, headers, span_name,
                                         params=params),
                       step, outcome, access=endpoint.access, admit=admit)
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from service.core import deadlines, logs
from service.core.admission import Reservation, refusal_pace_s
from service.core.candidates import ROUTE_KEY_METADATA
from service.core.decoding import REFERENCE_DECODE_BYTES
from service.core.errors import (
    CallShareExceeded,
    InflightShareExceeded,
    RateLimited,
    SocketShareExceeded,
    error_status,
)
from service.core.logs import RequestLog, request_scope

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller
    from service.core.metrics import Metrics
    from service.core.service import Service

T = TypeVar("T")

# The metrics label of a request no endpoint matched (404, 405): one fixed label, so that
# scanners probing random paths cannot grow the label set.
UNMATCHED = "unmatched"
SERVER_TIMING = "Server-Timing"
# The metrics status of a request whose client went away before its answer (nginx's code):
# an HTTP disconnect, a gRPC cancel, a WebSocket closed, behind Ray's proxy alike.
CLIENT_CLOSED = 499
# The answer that starts a stream (a WebSocket's upgrade).
SWITCHING_PROTOCOLS = 101


@dataclass(frozen=True)
class Incoming:
    """What the pipeline needs to know of one request, whatever the transport.

    Attributes:
        protocol: `http` or `grpc` (the access line's protocol).
        method: the HTTP method, or `GRPC`.
        route: the endpoint's name, `UNMATCHED`, or the name of a route that is not an
            endpoint (the web page): the metrics label and the access line's route.
        path: the request path (never the query), or the RPC's full name.
        headers: the request's headers or metadata, read with lower-case names
            (`x-request-id`, `traceparent`, `authorization`, the routing key).
        span_name: the request span's name (`POST /classify/{bot_id}`).
        remote: the client's address, when the transport knows it.
        params: the matched route's path parameters (a `bot_id` goes to the access line).
        attributes: the span's attributes, asked for only when tracing is on.
        stream: a streaming endpoint's request (its upgrade and cancellation are counted, not
            timed).
        stop_reading: stops reading what is left of the request's body, called when a refusal
            of its tenant is held (`RefusalPacer`): a refused upload does not keep streaming
            into the server while its answer waits (HTTP's; None: nothing to stop).
    """

    protocol: str
    method: str
    route: str
    path: str
    headers: Mapping[str, str]
    span_name: str
    remote: str | None = None
    params: Mapping[str, str] = field(default_factory=dict)
    attributes: Callable[[], Mapping[str, Any]] | None = None
    stream: bool = False
    stop_reading: Callable[[], None] | None = None


class Outcome(Protocol[T]):
    """How a transport renders and sends an answer: the pipeline's one seam."""

    def error(self, exc: Exception) -> T:
        """The answer to an error (the one error table; unknown errors are logged there)."""

    def status(self, answer: T) -> int:
        """The HTTP status of an answer (for a gRPC answer, the one the same outcome has on
        the REST routes)."""

    def cancelled(self, req: RequestLog) -> int:
        """The status a cancelled request is counted with (`CLIENT_CLOSED`, or gRPC's 504
        for a deadline that passed)."""

    async def done(self, answer: T, req: RequestLog, timing: str | None) -> T:
        """The answer, finished: the request id and `timing` (the Server-Timing value; None
        when not timed) where the transport carries them. May send it (gRPC aborts with an
        error status: it raises)."""


Step = Callable[["Caller | None", Reservation], Awaitable[T]]


def caller_of(service: Service, access: str, headers: Mapping[str, str]) -> Caller:
    """`Service.caller` for a request with these headers or metadata: its `authorization`
    under `access`, and its routing key for canaries."""
    return service.caller(headers.get("authorization"), access,
                          route_key=headers.get(ROUTE_KEY_METADATA))


# The endpoints a tenant's empty bucket refuses before their bodies are read
# (`Tenancy.refuse_early`): those that take images of its quota (the gRPC twins carry the same
# names), and a bot's registration.
REFUSED_EARLY = {**dict.fromkeys(("classify", "classify_many", "oip_infer", "oip_infer_version",
                                  "tfs_predict", "tfs_predict_version"), "images"),
                 "put_bot": "registrations"}

# The native uploads, whose bodies are the images' encoded bytes (raw, or multipart parts), and
# the most bytes of a multipart body that are not an image's (boundaries, part headers).
UPLOAD_ROUTES = frozenset({"classify", "classify_many"})
MULTIPART_SLACK_BYTES = 64 * 1024


def head_images(incoming: Incoming) -> float:
    """What a request will cost at least, in images of its tenant's quota, from its head: a
    native upload's declared length / 640 x 480 x 3 (its encoded bytes cost at least that:
    `service.core.decoding.cost_of`), less a multipart body's slack; else 1 (a JSON tensor's
    length says nothing of its images' cost, a gRPC message's is not known yet)."""
    if incoming.route not in UPLOAD_ROUTES:
        return 1.0
    try:
        length = int(incoming.headers.get("content-length") or 0)
    except (TypeError, ValueError):
        return 1.0
    if "multipart/" in (incoming.headers.get("content-type") or "").lower():
        length -= MULTIPART_SLACK_BYTES
    return max(1.0, length / REFERENCE_DECODE_BYTES)


# The refusals of a tenant beyond its share of what one process holds at once (bytes in flight,
# open WebSockets, gRPC calls), counted per tenant in `tenant_refusals_total` by their codes.
SHARE_REFUSALS = (InflightShareExceeded, SocketShareExceeded, CallShareExceeded)


def tenant_of(caller: Caller | None) -> str:
    """The tenant a request's bytes and calls count under: its key's, else "" (the operator,
    anyone with --auth none, a request without a caller)."""
    return getattr(caller, "tenant", None) or ""


def record(metrics: Metrics, label: str, status: int, start_s: float | None) -> str:
    """Counts one answered request (`requests_total`, and `request_seconds` from `start_s`, a
    `time.perf_counter()` reading taken when the transport got it) and returns the value of
    its Server-Timing header. `start_s=None`: counted, not timed."""
    if start_s is None:
        metrics.observe_request(label, status, None)
        return ""
    elapsed_s = time.perf_counter() - start_s
    metrics.observe_request(label, status, elapsed_s)
    return f"app;dur={elapsed_s * 1000:.1f}"


async def run(service: Service, incoming: Incoming, step: Step[T], outcome: Outcome[T], *,
              access: str | None = None,
              admit: Callable[[Reservation], None] | None = None) -> T:
    """Serves one request through the pipeline (see the module doc).

    Args:
        step: the handler: `step(caller, held)`, `caller` the `Service` as this request's
            caller sees it (None without `access`), `held` its reservation in the in-flight
            budget (a body read on demand is counted in it).
        outcome: how the transport renders and sends the answer.
        access: the endpoint's access rule (`service.core.auth`); None: no caller (a request
            no endpoint matched, the web page).
        admit: the admission step: takes the request's bytes into `held`, or raises the
            transport's refusal.
    """
    with request_scope(service.tracing, service.settings.access_log,
                       protocol=incoming.protocol, method=incoming.method, route=incoming.route,
                       path=incoming.path, headers=incoming.headers, remote=incoming.remote,
                       span_name=incoming.span_name,
                       attributes=(incoming.attributes() if service.tracing is not None
                                   and incoming.attributes is not None else None)) as req:
        start = time.perf_counter()
        try:
            answer = await _answer(service, incoming, step, access, admit)
        except asyncio.CancelledError:
            # The client went away (or shutdown cancelled what was left): its rows still
            # queued for the trunk were withdrawn on the way out.
            req.status = outcome.cancelled(req)
            record(service.metrics, incoming.route, req.status,
                   None if incoming.stream else start)
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes the transport's answer
            answer = outcome.error(exc)
        req.status = status = outcome.status(answer)
        timed = not (incoming.stream and status == SWITCHING_PROTOCOLS)
        # NOTE: counted before the answer leaves (gRPC's abort sends it): a client that reads
        # /metrics right after its answer sees its request.
        timing = record(service.metrics, incoming.route, status, start if timed else None)
        return await outcome.done(answer, req, timing or None)


async def _answer(service: Service, incoming: Incoming, step: Step[T], access: str | None,
                  admit: Callable[[Reservation], None] | None) -> T:
    if "bot_id" in incoming.params:
        logs.note(bots=(incoming.params["bot_id"],))
    caller = None if access is None else caller_of(service, access, incoming.headers)
    tenant = tenant_of(caller)
    try:
        deadline = (deadlines.from_headers(incoming.headers,
                                           default_ms=service.tenancy.deadline_ms(tenant))
                    if caller is not None else None)
        kind = REFUSED_EARLY.get(incoming.route)
        with contextlib.ExitStack() as claim:
            if tenant and kind is not None:
                try:
                    claim.enter_context(service.tenancy.refuse_early(
                        tenant, kind, head_images(incoming)))
                except RateLimited as exc:
                    if kind == "images":
                        service.metrics.observe_refusal(tenant, error_status(exc)[1])
                    raise
            with Reservation(service.inflight, tenant) as held, deadlines.scope(deadline):
                if admit is not None:
                    admit(held)
                return await step(caller, held)
    except Exception as exc:  # a tenant's refusal: answered late (`RefusalPacer`)
        if tenant:
            status, code, _ = error_status(exc)
            if isinstance(exc, SHARE_REFUSALS):  # its share of what a process holds: counted
                service.metrics.observe_refusal(tenant, code)
            if incoming.stop_reading is not None:
                incoming.stop_reading()
            await service.pacer.pace(tenant, refusal_pace_s(
                status, getattr(exc, "retry_after_s", None)))
        raise
