"""What the gRPC services of one process share: how one RPC runs.

The gRPC transport is a transport like the aiohttp app: it moves messages and calls the typed
calls of the protocol codecs in `service.codecs` (the OIP v2 and TF Serving rules are written
there, once): a request message becomes the codec's typed request (the model as a
`service.codecs.common.Model`, the tensors in the codec's neutral form), the typed result becomes
the response message, and a domain error becomes a gRPC status through the one error table
(`service.core.errors.grpc_status`). No REST body or JSON is built on the way.

Every RPC runs through `Rpcs.run`, i.e. through the request pipeline
(`service.codecs.pipeline`) with `GrpcOutcome` as its seam (a typed message, or a status with
trailing metadata):

- auth: the `authorization` metadata is checked as HTTP's header is, with the access rule of
  the RPC's REST twin (`Service.caller`); the handler gets the `Service` as that caller sees
  it (another tenant's bot is NOT_FOUND, as an unknown one), with the call's routing key for
  canaries (the `x-multihead-route-key` metadata, as HTTP's `X-Multihead-Route-Key` header);
- admission: the call takes its place among the calls in flight in this process
  (`max_grpc_calls`), shared by tenants like the sockets (`service.core.shares.Shares`): a
  tenant with calls in flight runs at most its weighted share of them (RESOURCE_EXHAUSTED,
  code `call_share`, with `retry-after`), and a tenant within its share that finds them all
  taken cancels the newest call of the tenant most over its share (which fails with
  `call_share`); only when no tenant is over its share is the call refused `overloaded` (a
  tenant alone that would pass them all gets `call_share`: its own calls fill them). Then
  the request message's bytes are taken from the process's in-flight byte budget
  (`Service.inflight`, shared with HTTP, by tenant: `service.core.admission`) until the answer
  is built; when they do not fit, the call fails with RESOURCE_EXHAUSTED (gRPC has already
  received the message by then: its size is bounded before that by the method's receive limit:
  `gate.MessageCaps`);
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
- draining: once `drain()` began, new calls fail with UNAVAILABLE (ShuttingDown; the
  pipeline's admission step, after auth) while the calls in flight finish; `drain()` returns
  when none is left;
- logs and traces: the call's request id (`x-request-id` metadata when sane, else a new one;
  sent back in the trailing metadata), its span (child of a `traceparent` in the metadata) and
  its access line (`service.core.logs.request_scope`), under the RPC's full name
  (`/inference.GRPCInferenceService/ModelInfer`), which `MethodNames` (a server interceptor)
  hands to `Rpcs.run`.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import Message

from service.codecs import pipeline
from service.codecs.base import error_answer
from service.codecs.pipeline import Incoming
from service.codecs.routes import ENDPOINTS
from service.core import deadlines
from service.core.admission import RETRY_AFTER_S, Reservation
from service.core.errors import (
    CallShareExceeded,
    DeadlineExceeded,
    Overloaded,
    ShuttingDown,
    grpc_status,
)
from service.core.logs import RequestLog
from service.core.shares import Shares

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller
    from service.core.service import Service

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
    """The call's text metadata (names lower-case, as gRPC sends them). The call's own
    deadline, when it has one, is given as `X-Multihead-Deadline-Ms` (the time it has left)
    unless the client set that header itself (`service.core.deadlines`)."""
    found = {key: value for key, value in context.invocation_metadata() or ()
             if isinstance(value, str)}
    remaining = context.time_remaining()
    if remaining is not None and deadlines.HEADER not in found:
        found[deadlines.HEADER] = f"{min(max(remaining * 1e3, 1e-3), deadlines.MAX_MS):.3f}"
    return found


# The full name of the RPC being run (/package.Service/Method): grpc tells only interceptors.
_rpc_method: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "multihead_rpc_method", default=None)


@contextlib.contextmanager
def rpc_method(method: str) -> Iterator[None]:
    """Tells `Rpcs.run` within it that it runs the RPC `method` (/package.Service/Method)."""
    token = _rpc_method.set(method)
    try:
        yield
    finally:
        _rpc_method.reset(token)


class MethodNames(grpc.aio.ServerInterceptor):
    """A server interceptor that tells `Rpcs.run` the full name of the RPC it runs."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not inspect.iscoroutinefunction(handler.unary_unary):
            return handler  # not one of ours (an UNIMPLEMENTED method of a base servicer)
        inner, method = handler.unary_unary, handler_call_details.method

        async def unary_unary(request, context):
            with rpc_method(method):
                return await inner(request, context)

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


@dataclass(frozen=True)
class Failure:
    """An error as gRPC sends it: a status code, a message, trailing metadata."""

    status: int  # the HTTP status the same outcome has on the REST routes (metrics, logs)
    code: grpc.StatusCode
    message: str
    domain_code: str  # as in the JSON error body (`unknown_bot`)
    retry_after: str | None = None  # seconds, when overloaded


class GrpcOutcome:
    """How the pipeline's answers leave on gRPC (`pipeline.Outcome`): the typed message with
    the request id in the trailing metadata, or an error's status (the one error table) with
    its domain code, request id and `retry-after` as trailing metadata; a cancelled call is
    504 when its deadline passed, else 499."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    def error(self, exc: Exception) -> Failure:
        status, body, headers = error_answer(exc)
        return Failure(status, status_code(exc), body["error"], body["code"],
                       headers.get("Retry-After"))

    def status(self, answer: Any) -> int:
        return answer.status if isinstance(answer, Failure) else 200

    def cancelled(self, req: RequestLog) -> int:
        budget = client_budget_s(self.context)
        status = (DEADLINE_PASSED if budget is not None and budget <= DEADLINE_SLACK_S
                  else pipeline.CLIENT_CLOSED)
        req.set_attribute("rpc.grpc.status_code", (
            grpc.StatusCode.DEADLINE_EXCEEDED if status == DEADLINE_PASSED
            else grpc.StatusCode.CANCELLED).value[0])
        return status

    async def done(self, answer: Any, req: RequestLog, timing: str | None) -> Any:
        if isinstance(answer, Failure):
            req.set_attribute("rpc.grpc.status_code", answer.code.value[0])
            trailing = [(CODE_KEY, answer.domain_code), (REQUEST_ID_KEY, req.request_id)]
            if answer.retry_after is not None:
                trailing.append((RETRY_AFTER_KEY, answer.retry_after))
            await self.context.abort(answer.code, answer.message, tuple(trailing))
            raise AssertionError("unreachable: abort raises")
        req.set_attribute("rpc.grpc.status_code", grpc.StatusCode.OK.value[0])
        self.context.set_trailing_metadata(((REQUEST_ID_KEY, req.request_id),))
        return answer


class Call:
    """One call's place among the calls in flight (`Rpcs.calls`): its handler's task, and
    whether it was pushed out to make room for a tenant within its share."""

    __slots__ = ("tenant", "task", "pushed")

    def __init__(self) -> None:
        self.tenant = ""  # the caller's, once admitted
        self.task: asyncio.Future | None = None
        self.pushed = False

    def push_out(self) -> None:
        self.pushed = True
        if self.task is not None:
            self.task.cancel()

    async def run(self, work: Coroutine[Any, Any, M]) -> M:
        """`work` in a task of its own, which `push_out` cancels: then CallShareExceeded."""
        if self.pushed:
            work.close()  # never started
            raise _pushed(self.tenant)
        self.task = asyncio.ensure_future(work)
        try:
            return await self.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.pushed and (current is None or not current.cancelling()):
                raise _pushed(self.tenant) from None
            raise


def _pushed(tenant: str) -> CallShareExceeded:
    return CallShareExceeded(RETRY_AFTER_S, (
        f"tenant '{tenant}' is over its share of the gRPC calls in flight: this call made "
        "room for a tenant within its share; retry later"))


def _over_share(tenant: str, held: int, share: int) -> CallShareExceeded:
    return CallShareExceeded(RETRY_AFTER_S, (
        f"tenant '{tenant}' has {held} gRPC calls in flight, its share is {share} now; "
        f"retry after {RETRY_AFTER_S:.0f} s"))


class Rpcs:
    """Runs the RPCs of one process's gRPC services over its `Service` (see the module doc).

    Attributes:
        calls: the calls in flight by tenant (`service.core.shares.Shares`, one call one
            unit of `max_grpc_calls`).
    """

    def __init__(self, service: Service) -> None:
        self.service = service
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        capacity = service.settings.max_grpc_calls
        self.calls = Shares(capacity, service.tenancy.weight, over_share=_over_share,
                            full=lambda: Overloaded(RETRY_AFTER_S, (
                                f"server busy: {capacity} gRPC calls in flight; retry after "
                                f"{RETRY_AFTER_S:.0f} s")), alone_over_share=bool)

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

    async def run(self, name: str, message: Message | None, context: grpc.aio.ServicerContext,
                  handle: Callable[[Caller], Awaitable[M]]) -> M:
        """`handle(caller)` through the request pipeline: auth, admission (the drain, the
        message's bytes, the client's deadline), the error table and metrics; `caller` is the
        `Service` as the call's `authorization` metadata sees it.

        Args:
            name: what metrics and logs call the call: the name of the REST endpoint it
                corresponds to (`oip_infer`, ...; see `Endpoint.name`); its access rule is
                that endpoint's.
            message: the request message; None when the gate refused the call without
                parsing it (`gate`): then it takes no place among the calls nor bytes.
        """
        method = _rpc_method.get() or f"/{name}"
        incoming = Incoming("grpc", "GRPC", name, method, metadata(context), method.lstrip("/"),
                            context.peer(), attributes=lambda: _span_attributes(method))

        call = Call()

        def admit(held: Reservation) -> None:
            if self.draining:
                raise ShuttingDown("the server is shutting down and accepts no new calls")
            if message is not None:  # else refused by the gate, unread: no place taken
                call.tenant = held.tenant
                for push in self.calls.take(call.tenant, call, 1, call.push_out):
                    push()
                held.take(message.ByteSize())
            budget = client_budget_s(context)
            if budget is not None and budget <= 0:
                raise DeadlineExceeded("the call's deadline passed before it started")

        async def step(caller: Caller, held: Reservation) -> M:
            return await call.run(handle(caller))

        self.in_flight += 1
        self._idle.clear()
        try:
            return await pipeline.run(self.service, incoming, step, GrpcOutcome(context),
                                      access=ACCESS[name], admit=admit)
        finally:
            self.calls.release(call.tenant, call)
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()
