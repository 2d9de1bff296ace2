"""What the gRPC services of one process share: how one RPC runs.

The gRPC transport is a transport like the aiohttp app: it moves messages and calls the typed
calls of the protocol codecs in `service.codecs` (the OIP v2 and TF Serving rules are written
there, once): a request message becomes the codec's typed request (the model as a
`service.codecs.common.Model`, the tensors in the codec's neutral form), the typed result becomes
the response message, and a domain error becomes a gRPC status through the one error table
(`service.core.errors.grpc_status`). No REST body or JSON is built on the way.

Every RPC runs through `Rpcs.run`:

- auth: the `authorization` metadata is checked as HTTP's header is, with the access rule of
  the RPC's REST twin (`Service.caller`); the handler gets the `Service` as that caller sees
  it (another tenant's bot is NOT_FOUND, as an unknown one), with the call's routing key for
  canaries (the `x-multihead-route-key` metadata, as HTTP's `X-Multihead-Route-Key` header);
- admission: the request message's bytes are taken from the process's in-flight byte budget
  (`Service.inflight`, shared with HTTP) until the answer is built; when they do not fit, the
  call fails with RESOURCE_EXHAUSTED (gRPC has already received the message by then: its size is
  bounded before that by the server's max_receive_message_length = `max_body_bytes`);
- the client's deadline: grpc cancels the handler when it passes (or when the client cancels),
  which withdraws the request's rows still queued for the trunk (a batch already running has
  its result dropped), and the client gets DEADLINE_EXCEEDED; a call whose deadline has passed
  when it starts is refused before any work; the server's own `request_timeout_s` applies as on
  HTTP (DEADLINE_EXCEEDED too);
- errors: status code and message from the error table (unknown errors: INTERNAL with a generic
  message, logged with their traceback); the domain code (`unknown_bot`, ...) and, when the
  server is overloaded, `retry-after` (seconds) go in the trailing metadata;
- metrics: `requests_total` / `request_seconds` with the name of the REST endpoint the RPC
  corresponds to as the route (`oip_infer` for ModelInfer, ...), and the HTTP status the same
  outcome has on the REST routes (504: the client's deadline passed, 499: the client cancelled);
- draining: once `drain()` began, new calls fail with UNAVAILABLE (ShuttingDown) while the calls
  in flight finish; `drain()` returns when none is left;
- logs and traces: the call's request id (`x-request-id` metadata when sane, else a new one;
  sent back in the trailing metadata), its span (child of a `traceparent` in the metadata) and
  its access line (`service.core.logs.request_scope`), under the RPC's full name
  (`/inference.GRPCInferenceService/ModelInfer`), which `MethodNames` (a server interceptor)
  hands to `Rpcs.run`.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import grpc
from google.protobuf.message import Message

from service.codecs.routes import ENDPOINTS
from service.core.admission import Reservation
from service.core.candidates import ROUTE_KEY_METADATA
from service.core.errors import (
    DeadlineExceeded,
    ServiceError,
    ShuttingDown,
    error_body,
    error_status,
    grpc_status,
)
from service.core.logs import RequestLog, request_scope
from service.transports.common.exchange import CLIENT_CLOSED

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller
    from service.core.service import Service

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

CODE_KEY = "multihead-code"  # trailing metadata: the error's domain code (as in the JSON body)
REQUEST_ID_KEY = "x-request-id"  # trailing metadata: the call's request id
RETRY_AFTER_KEY = "retry-after"  # trailing metadata: seconds, when overloaded
DEADLINE_PASSED = 504  # metrics status of a call cancelled by its deadline
# NOTE: the client's timer fires first (the server's deadline starts when it received the call)
# and its cancellation can arrive while the server still counts some milliseconds left.
DEADLINE_SLACK_S = 0.25


# The access rule of each RPC: its REST twin's (by endpoint name).
ACCESS = {endpoint.name: endpoint.access for endpoint in ENDPOINTS}


def authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The call's `authorization` metadata (as HTTP's header), or None."""
    return metadata(context).get("authorization")


def metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's text metadata (names lower-case, as gRPC sends them)."""
    return {key: value for key, value in context.invocation_metadata() or ()
            if isinstance(value, str)}


# The full name of the RPC being run (/package.Service/Method): grpc tells only interceptors.
_rpc_method: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "multihead_rpc_method", default=None)


class MethodNames(grpc.aio.ServerInterceptor):
    """A server interceptor that tells `Rpcs.run` the full name of the RPC it runs."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not inspect.iscoroutinefunction(handler.unary_unary):
            return handler  # not one of ours (an UNIMPLEMENTED method of a base servicer)
        inner, method = handler.unary_unary, handler_call_details.method

        async def unary_unary(request, context):
            token = _rpc_method.set(method)
            try:
                return await inner(request, context)
            finally:
                _rpc_method.reset(token)

        return handler._replace(unary_unary=unary_unary)


def _span_attributes(method: str) -> dict[str, str]:
    """The call span's attributes (OpenTelemetry's RPC conventions)."""
    service, _, name = method.lstrip("/").rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code of any exception, from the error table."""
    return grpc.StatusCode[grpc_status(exc)[0]]


def client_budget_s(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds left before the client's deadline, or None when it set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e9:  # no deadline: grpc reports None or "forever"
        return None
    return remaining


class Rpcs:
    """Runs the RPCs of one process's gRPC services over its `Service` (see the module doc)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuses new calls from now on; waits up to `timeout_s` for the calls in flight to
        finish. True when none is left."""
        self.draining = True
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def run(self, name: str, message: Message, context: grpc.aio.ServicerContext,
                  handle: Callable[[Caller], Awaitable[M]]) -> M:
        """`handle(caller)` under auth, admission, the client's deadline, the error table and
        metrics: `caller` is the `Service` as the call's `authorization` metadata sees it.

        Args:
            name: what metrics and logs call the call: the name of the REST endpoint it
                corresponds to (`oip_infer`, ...; see `Endpoint.name`); its access rule is
                that endpoint's.
        """
        method = _rpc_method.get() or f"/{name}"
        service = self.service
        with request_scope(service.tracing, service.settings.access_log, protocol="grpc",
                           method="GRPC", route=name, path=method, headers=metadata(context),
                           remote=context.peer(), span_name=method.lstrip("/"),
                           attributes=(_span_attributes(method) if service.tracing is not None
                                       else None)) as req:
            return await self._run(name, message, context, handle, req)

    async def _run(self, name: str, message: Message, context: grpc.aio.ServicerContext,
                   handle: Callable[[Caller], Awaitable[M]], req: RequestLog) -> M:
        start = time.perf_counter()
        status: int | None = 200  # None once recorded
        self.in_flight += 1
        self._idle.clear()
        try:
            if self.draining:
                raise ShuttingDown("the server is shutting down and accepts no new calls")
            caller = self.service.caller(authorization(context), ACCESS[name],
                                         route_key=metadata(context).get(ROUTE_KEY_METADATA))
            with Reservation(self.service.inflight) as held:
                held.take(message.ByteSize())
                budget = client_budget_s(context)
                if budget is not None and budget <= 0:
                    raise DeadlineExceeded("the call's deadline passed before it started")
                answer = await handle(caller)
                req.status = 200
                req.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
                context.set_trailing_metadata(((REQUEST_ID_KEY, req.request_id),))
                return answer
        except asyncio.CancelledError:
            budget = client_budget_s(context)
            status = (DEADLINE_PASSED if budget is not None and budget <= DEADLINE_SLACK_S
                      else CLIENT_CLOSED)
            req.status = status
            req.set_attribute("rpc.grpc.status_code", (
                grpc.StatusCode.DEADLINE_EXCEEDED if status == DEADLINE_PASSED
                else grpc.StatusCode.CANCELLED).value[0])
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a gRPC status
            status, _, headers = error_status(exc)
            body = error_body(exc)
            if status >= 500 and not isinstance(exc, ServiceError):
                log.error("internal error in %s", name, exc_info=exc)
            trailing = [(CODE_KEY, body["code"]), (REQUEST_ID_KEY, req.request_id)]
            if "Retry-After" in headers:
                trailing.append((RETRY_AFTER_KEY, headers["Retry-After"]))
            req.status = status
            req.set_attribute("rpc.grpc.status_code", status_code(exc).value[0])
            # Counted before the status leaves (abort sends it): a client that reads /metrics
            # right after its error sees the call, as after a success (counted on return).
            self.service.metrics.observe_request(name, status, time.perf_counter() - start)
            status = None
            await context.abort(status_code(exc), body["error"], tuple(trailing))
            raise AssertionError("unreachable: abort raises") from None
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()
            if status is not None:
                self.service.metrics.observe_request(name, status, time.perf_counter() - start)
