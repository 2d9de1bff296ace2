"""Domain errors of the service layer, and the ONE table that maps every layer's errors to HTTP
(and to gRPC status codes: the table's last column, used by the gRPC transport).

Nothing here imports aiohttp: the errors are raised by the batcher, the settings and the request
parsing helpers, and one aiohttp middleware (in `service.transports.http.app`) turns any exception
into
`{"error": "...", "code": "..."}` with the status and headers `error_status` gives.

The table also covers the errors of `backbone/` and `heads/`. They are matched by the qualified
name of each class in the exception's MRO (`"heads.errors.UnknownBot"`), so this module never
imports those packages (no TensorFlow import, no import cycle) and keeps working while a layer's
error classes are still being written. Subclasses map like their nearest listed base.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping


class ServiceError(Exception):
    """Base class of every error the service layer raises on purpose."""


class BadRequest(ServiceError):
    """A request parameter or body is malformed (`top_k=abc`, a multipart without images)."""


class NotFound(ServiceError):
    """No such route or operation (`:classify` where only `:predict` is served)."""


class PayloadTooLarge(ServiceError):
    """The request body, or the number of images in it, is over a configured limit."""


class AnswerTooLarge(ServiceError):
    """The answer a request asks for could be larger than `max_answer_bytes` (images x heads x
    predictions x the longest label): refused before any image is decoded."""


class UnsupportedMediaType(ServiceError):
    """The request's Content-Type is not an image or multipart/form-data."""


class Unauthorized(ServiceError):
    """No usable credential where one is needed: none, a malformed header, an unknown or
    revoked API key (401, with `WWW-Authenticate`)."""


class Forbidden(ServiceError):
    """A credential without the right (a key's scope, another tenant asked for), or the
    operator credential needed and none configured (no `MULTIHEAD_ADMIN_TOKEN`)."""


class Overloaded(ServiceError):
    """The batcher's queue is full; the client should retry after `retry_after_s` seconds.

    Args:
        retry_after_s: the server's estimate of when the queue will have room again.
        message: optional message; the default names the estimate.
    """

    def __init__(self, retry_after_s: float = 1.0, message: str | None = None) -> None:
        self.retry_after_s = float(retry_after_s)
        super().__init__(message or f"server overloaded, retry after {self.retry_after_s:.1f} s")

    def __reduce__(self):  # copy/pickle keep the estimate (args hold only the message)
        return (type(self), (self.retry_after_s, str(self)))


class RateLimited(Overloaded):
    """A tenant's quota (a token bucket of trunk images, `service.core.quota`) does not hold
    the request now; it will in `retry_after_s` seconds (429 + Retry-After)."""


class RegistrationRateLimited(RateLimited):
    """A tenant's `registrations_per_minute` does not hold another registration now; it will
    in `retry_after_s` seconds (429 registration_rate + Retry-After)."""


class QueueShareExceeded(Overloaded):
    """A tenant's queued images would pass its weighted share of the queue (or its own
    `max_queued`), or were pushed out of the queue to make room for a tenant within its share
    (429 + Retry-After). The server as a whole may still have room: other tenants are served."""


class RequestTimeout(ServiceError):
    """The client sent its request too slowly: its body arrived below the minimum rate (408;
    the transport closes the connection)."""


# The "error" of the 408 a connection gets when its request head is late (`header_timeout_s`,
# `service.transports.http.timeouts`), which is written before any request exists.
HEAD_TIMEOUT_ERROR = "request headers not received in time"


class SocketShareExceeded(Overloaded):
    """A tenant's open WebSockets would pass its weighted share of `max_websockets`, or its
    socket was closed to make room for a tenant within its share (429 + Retry-After)."""


class InflightShareExceeded(Overloaded):
    """A tenant's request bytes in flight would pass its weighted share of
    `max_inflight_bytes`, or its request (a body being read, a WebSocket) was pushed out to
    make room for a tenant within its share (429 + Retry-After; a body pushed out is not read
    on: HTTP closes the connection after the answer)."""


class CallShareExceeded(Overloaded):
    """A tenant's gRPC calls in flight would pass its weighted share of `max_grpc_calls`, or
    its call was pushed out to make room for a tenant within its share (RESOURCE_EXHAUSTED,
    429 on the REST side, + retry-after)."""


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before its rows reached the trunk."""


class DeadlineUnmeetable(DeadlineExceeded):
    """The request's rows would be answered after its deadline, by the batcher's estimate (the
    batch running and the rows taken before them, at the trunk's live times, that wait times
    the slack it was seen to need: `service.core.schedule`): refused before any decode, at
    admission or as its decode was to start."""


class InvalidDeadline(BadRequest):
    """A deadline that is not a number of milliseconds in range (`service.core.deadlines`)."""


class ShuttingDown(ServiceError):
    """The service is draining (SIGTERM / app cleanup) and accepts no new work."""


class ReplicaLost(ServiceError):
    """The process serving a request died before answering (a Ray replica killed or crashed);
    another replica answers a retry."""


class NotReady(ServiceError):
    """The trunk is still being built or warmed up (or failed to load: see /readyz)."""


class HeadUnavailable(ServiceError):
    """A registered bot's files cannot be loaded: the server's problem, not the client's."""


class BatchError(ServiceError):
    """A whole batch failed for a reason that is the server's, e.g. `run_batch` broke its contract
    (returned a wrong number of results). Every row of that batch gets it; other batches don't."""


# (HTTP status, code, gRPC status code name) per error class; most specific first is NOT required:
# lookup walks the MRO. The gRPC column follows the HTTP one: 400/415/422 INVALID_ARGUMENT, 404
# NOT_FOUND (an unknown operation UNIMPLEMENTED), 413 RESOURCE_EXHAUSTED as gRPC's own message
# size limit (but an image over the pixel limit is INVALID_ARGUMENT: no retry can help), 429 and 503
# overloaded RESOURCE_EXHAUSTED and 503 not ready / shutting down UNAVAILABLE (retry elsewhere or
# later), 504 DEADLINE_EXCEEDED, 5xx INTERNAL.
_TABLE: Mapping[str, tuple[int, str, str]] = {
    # service
    f"{__name__}.BadRequest": (400, "bad_request", "INVALID_ARGUMENT"),
    f"{__name__}.Unauthorized": (401, "unauthorized", "UNAUTHENTICATED"),
    f"{__name__}.Forbidden": (403, "forbidden", "PERMISSION_DENIED"),
    f"{__name__}.NotFound": (404, "not_found", "UNIMPLEMENTED"),
    f"{__name__}.PayloadTooLarge": (413, "payload_too_large", "RESOURCE_EXHAUSTED"),
    # gRPC: like its own message size limit.
    f"{__name__}.AnswerTooLarge": (413, "answer_too_large", "RESOURCE_EXHAUSTED"),
    f"{__name__}.UnsupportedMediaType": (415, "unsupported_media_type", "INVALID_ARGUMENT"),
    f"{__name__}.Overloaded": (503, "overloaded", "RESOURCE_EXHAUSTED"),
    # One tenant over its own quota or queue share: the client's doing (429), not the server's.
    f"{__name__}.RateLimited": (429, "rate_limited", "RESOURCE_EXHAUSTED"),
    f"{__name__}.RegistrationRateLimited": (429, "registration_rate", "RESOURCE_EXHAUSTED"),
    f"{__name__}.QueueShareExceeded": (429, "queue_share", "RESOURCE_EXHAUSTED"),
    f"{__name__}.SocketShareExceeded": (429, "socket_share", "RESOURCE_EXHAUSTED"),
    f"{__name__}.InflightShareExceeded": (429, "inflight_share", "RESOURCE_EXHAUSTED"),
    f"{__name__}.CallShareExceeded": (429, "call_share", "RESOURCE_EXHAUSTED"),
    f"{__name__}.ShuttingDown": (503, "shutting_down", "UNAVAILABLE"),
    f"{__name__}.ReplicaLost": (503, "replica_lost", "UNAVAILABLE"),
    f"{__name__}.NotReady": (503, "not_ready", "UNAVAILABLE"),
    f"{__name__}.HeadUnavailable": (500, "head_unavailable", "INTERNAL"),
    # A client too slow to send its request: the connection is closed after the answer.
    f"{__name__}.RequestTimeout": (408, "request_timeout", "DEADLINE_EXCEEDED"),
    f"{__name__}.DeadlineExceeded": (504, "deadline_exceeded", "DEADLINE_EXCEEDED"),
    f"{__name__}.DeadlineUnmeetable": (504, "deadline_unmeetable", "DEADLINE_EXCEEDED"),
    f"{__name__}.InvalidDeadline": (400, "invalid_deadline", "INVALID_ARGUMENT"),
    f"{__name__}.BatchError": (500, "internal", "INTERNAL"),
    # backbone (ImageTooLarge subclasses InvalidImage; the MRO walk finds it first)
    "backbone.errors.InvalidImage": (400, "invalid_image", "INVALID_ARGUMENT"),
    "backbone.errors.ImageTooLarge": (413, "image_too_large", "INVALID_ARGUMENT"),
    "backbone.errors.CheckpointError": (500, "trunk_unavailable", "INTERNAL"),
    # heads
    "heads.errors.UnknownBot": (404, "unknown_bot", "NOT_FOUND"),
    "store.errors.UnknownVersion": (404, "unknown_version", "NOT_FOUND"),
    # A malformed id ('../x', 'a b') is the client's syntax error, not a missing resource.
    "heads.errors.InvalidBotId": (400, "invalid_bot_id", "INVALID_ARGUMENT"),
    # An uploaded head that cannot be used: well-formed request, unprocessable content.
    "heads.errors.InvalidHead": (422, "invalid_head", "INVALID_ARGUMENT"),
    "heads.errors.HeadLoadError": (422, "invalid_head", "INVALID_ARGUMENT"),
    # A label against the label rules (too long, a control character): the client's syntax.
    "heads.errors.InvalidLabel": (400, "invalid_label", "INVALID_ARGUMENT"),
    # The store's database cannot be reached (a head that is not resident, a listing): retry.
    "store.errors.StoreUnavailable": (503, "store_unavailable", "UNAVAILABLE"),
    "heads.errors.TrunkMismatch": (422, "trunk_mismatch", "INVALID_ARGUMENT"),
    "heads.errors.InvalidTrainingData": (400, "invalid_training_data", "INVALID_ARGUMENT"),
    # tenants and keys (an id another tenant owns is taken: the answer names no tenant)
    "accounts.errors.InvalidTenant": (400, "invalid_tenant", "INVALID_ARGUMENT"),
    "accounts.errors.UnknownTenant": (404, "unknown_tenant", "NOT_FOUND"),
    "accounts.errors.InvalidLimits": (400, "invalid_limits", "INVALID_ARGUMENT"),
    "accounts.errors.TenantExists": (409, "tenant_exists", "ALREADY_EXISTS"),
    "accounts.errors.TenantNotEmpty": (409, "tenant_not_empty", "FAILED_PRECONDITION"),
    "accounts.errors.UnknownKey": (404, "unknown_key", "NOT_FOUND"),
    "accounts.errors.BotOwnedElsewhere": (409, "bot_id_taken", "ALREADY_EXISTS"),
    # a registration past the tenant's max_bots or max_head_bytes (no retry helps until the
    # tenant removes something or the operator raises the limit)
    "accounts.errors.TenantLimitExceeded": (403, "tenant_limit", "PERMISSION_DENIED"),
    # candidates: a mode other than shadow / canary:P; promote or discard with none there
    "accounts.errors.InvalidCandidate": (400, "invalid_candidate", "INVALID_ARGUMENT"),
    "accounts.errors.NoCandidate": (404, "no_candidate", "NOT_FOUND"),
}

_INTERNAL = (500, "internal", "INTERNAL")
INTERNAL_MESSAGE = "internal server error"


def copy_for_waiter(exc: BaseException) -> BaseException:
    """A copy of `exc` to raise in ONE waiting request.

    Raising one exception instance in several tasks makes them share and extend one
    `__traceback__` (and `__context__`); each waiter gets its own copy, which starts from the
    original's traceback (where it failed) and cause. An exception that cannot be copied is
    wrapped in a `BatchError` whose cause is the original.
    """
    try:
        clone = copy.copy(exc)
    except Exception:  # noqa: BLE001 - any constructor quirk: wrap instead of copying
        clone = BatchError(INTERNAL_MESSAGE)
        clone.__cause__ = exc
    else:
        clone.__cause__ = exc.__cause__
    clone.__traceback__ = exc.__traceback__
    return clone


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _lookup(exc: BaseException) -> tuple[int, str, str] | None:
    for cls in type(exc).__mro__:
        hit = _TABLE.get(_qualname(cls))
        if hit is not None:
            return hit
    return None


def retry_after_header(retry_after_s: float) -> str:
    """`Retry-After` value: whole seconds (RFC 9110 delay-seconds), rounded up, at least 1."""
    return str(max(1, math.ceil(retry_after_s)))


def error_status(exc: BaseException) -> tuple[int, str, dict[str, str]]:
    """Map any exception to `(http_status, code, headers)`.

    Known domain errors of the service, backbone and heads layers get their status and code;
    anything else is `(500, "internal", {})` and its message must not be shown to the client
    (use `error_body`).

    Example:
        >>> error_status(Overloaded(retry_after_s=2.2))
        (503, 'overloaded', {'Retry-After': '3'})
    """
    status, code, _ = _lookup(exc) or _INTERNAL
    headers: dict[str, str] = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = retry_after_header(getattr(exc, "retry_after_s", 1.0))
    elif isinstance(exc, NotReady):
        headers["Retry-After"] = retry_after_header(5.0)
    elif isinstance(exc, ReplicaLost) or code == "store_unavailable":
        headers["Retry-After"] = retry_after_header(1.0)
    elif isinstance(exc, Unauthorized):
        # RFC 6750: a 401 for a bearer-protected resource names the scheme.
        headers["WWW-Authenticate"] = 'Bearer realm="multihead"'
    return status, code, headers


def grpc_status(exc: BaseException) -> tuple[str, str]:
    """Map any exception to `(gRPC status code name, code)`, e.g. `("NOT_FOUND", "unknown_bot")`.

    The name is a `grpc.StatusCode` member's (this module does not import grpc); anything
    unknown is `("INTERNAL", "internal")`, and its message must not reach the client.

    Example:
        >>> grpc_status(Overloaded(retry_after_s=2.2))
        ('RESOURCE_EXHAUSTED', 'overloaded')
    """
    _, code, grpc_code = _lookup(exc) or _INTERNAL
    return grpc_code, code


def error_body(exc: BaseException) -> dict[str, str]:
    """The JSON body `{"error": message, "code": code}` for `exc`.

    Known errors carry their own message (which names the offending value); unknown ones get a
    generic message so internals (paths, tracebacks, TF op names) never reach the client.
    """
    known = _lookup(exc)
    if known is None:
        return {"error": INTERNAL_MESSAGE, "code": _INTERNAL[1]}
    return {"error": str(exc) or type(exc).__name__, "code": known[1]}
