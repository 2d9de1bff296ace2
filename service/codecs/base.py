"""Transport-neutral request, reply and endpoint types, and `dispatch` (see `service.codecs`)."""
from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from service.codecs.pipeline import caller_of
from service.core import logs
from service.core.auth import ACCESS, MANAGE, OPERATOR
from service.core.errors import ServiceError, error_body, error_status

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller
    from service.core.service import Service

log = logging.getLogger(__name__)

JSON = "application/json"


@dataclass(frozen=True)
class Request:
    """What a codec sees of one request, whatever the transport.

    Attributes:
        method: upper-case HTTP method.
        path: the request path (for messages and metrics only).
        params: path parameters of the matched route (`bot_id`, `version`, ...).
        query: query parameters (first value of each name).
        headers: header names lower-cased.
        read_body: reads the whole body (the transport enforces its size limit and admission);
            a codec calls it only after everything that can fail without it was checked.
    """

    method: str
    path: str
    params: Mapping[str, str] = field(default_factory=dict)
    query: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    read_body: Callable[[], Awaitable[bytes | bytearray]] | None = None

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def content_type(self) -> str:
        """The media type without parameters, lower-cased ('' when absent)."""
        raw = self.header("content-type") or ""
        return raw.split(";", 1)[0].strip().lower()

    async def body(self) -> bytes | bytearray:
        if self.read_body is None:
            return b""
        return await self.read_body()


@dataclass(frozen=True)
class Reply:
    """A response, whatever the transport: status, body bytes, content type, extra headers."""

    status: int = 200
    body: bytes = b""
    content_type: str = JSON
    headers: Mapping[str, str] = field(default_factory=dict)
    # What a transport that rebuilds the body may put in it (never sent): the /metrics reply's
    # `metrics_scope.Scope` for the Ray ingress's merge of every replica's metrics.
    scope: Any = None
    # Never sent either: the API key id a stream's upgrade was admitted with (None: no key),
    # which the Ray ingress watches for the socket's life (`service.core.connections`).
    key_id: str | None = None


def json_reply(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status, json.dumps(obj).encode(), JSON, dict(headers or {}))


def error_answer(exc: BaseException) -> tuple[int, dict[str, str], dict[str, str]]:
    """Any exception as (HTTP status, JSON error body, headers: Retry-After, WWW-Authenticate),
    from the one error table (`service.core.errors`), whatever renders it.

    Unknown exceptions are logged with their traceback and answered with a generic 500 that
    names no internals.
    """
    status, _, headers = error_status(exc)
    if status >= 500 and not isinstance(exc, ServiceError):
        log.error("internal error", exc_info=exc)
    return status, error_body(exc), headers


def error_reply(exc: BaseException) -> Reply:
    """Any exception as the JSON error body with its status and headers (`error_answer`)."""
    status, body, headers = error_answer(exc)
    return json_reply(body, status, headers)


Handler = Callable[["Caller", Request], Awaitable[Reply]]


class Session(Protocol):
    """An open stream of a streaming endpoint (a WebSocket): answers its messages, one at a
    time, in order (`service.codecs.stream`)."""

    async def answer(self, data: bytes) -> Any:
        """The JSON answer to one binary message; raises a domain error (answered as JSON
        with its status, the stream stays open)."""


# Opens a stream after the caller and admission steps: checks what can fail before the upgrade
# (an unknown bot, a bad parameter: JSON errors), and returns the stream's `Session`.
Opener = Callable[["Caller", Request], Awaitable[Session]]

# -- the API description of an endpoint (OpenAPI 3.0 schema objects, as plain data) ------------
#
# Every endpoint carries what `service.codecs.openapi` needs to describe it: its parameters, its
# request body, its answers and the statuses it answers with the JSON error body. Schemas are
# OpenAPI 3.0 schema objects (dicts); one with a "title" becomes a named component.

Schema = Mapping[str, Any]


@dataclass(frozen=True)
class Param:
    """A query or header parameter (path parameters come from the route template, their schema
    from `Endpoint.path_params`).

    Attributes:
        name: the parameter's name (a header name in its usual spelling).
        location: "query" or "header".
        schema: its OpenAPI schema.
        description: one sentence for the API description.
        required: whether a request must carry it.
    """

    name: str
    location: str
    schema: Schema
    description: str = ""
    required: bool = False


@dataclass(frozen=True)
class Body:
    """The request body an endpoint reads.

    Attributes:
        content: media type (or range, `image/*`) -> schema of the body in that type.
        description: what the body holds.
        required: whether a request must have one.
        encoding: multipart media type -> part name -> OpenAPI encoding object
            (e.g. `{"contentType": "image/*"}`).
    """

    content: Mapping[str, Schema]
    description: str = ""
    required: bool = True
    encoding: Mapping[str, Mapping[str, Schema]] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """One documented answer of an endpoint (an error answer is listed in `Endpoint.errors`).

    Attributes:
        description: when it is sent.
        content: media type -> schema of the body (empty: no body).
        headers: header name -> (description, required).
    """

    description: str
    content: Mapping[str, Schema] = field(default_factory=dict)
    headers: Mapping[str, tuple[str, bool]] = field(default_factory=dict)


def json_answer(description: str, schema: Schema) -> Answer:
    return Answer(description, {JSON: schema})


@dataclass(frozen=True)
class Endpoint:
    """One route of one protocol.

    Attributes:
        method: HTTP method.
        path: route template, `{name}` or `{name:regex}` for path parameters.
        name: operation id, unique across protocols (metrics, logs, API description).
        handle: parse -> service call -> render; it gets the `Service` as the caller sees it
            (`service.core.caller.Caller`: only the caller's tenant's bots).
        access: who may call it (`service.core.auth`: PUBLIC, INFER, MANAGE, METRICS,
            OPERATOR), checked by the request pipeline (`service.codecs.pipeline`; `dispatch`
            without a transport) before `handle`. Required: an endpoint without
            a rule is refused when the table is built.
        summary: one line for the API description.
        stream: a streaming endpoint's opener (a WebSocket route, `service.codecs.stream`): an
            upgrade request is answered by opening a stream; `handle` answers a request that
            is not an upgrade.

    What the API description (`service.codecs.openapi`) says of it, besides the above (none of
    it changes how a request is handled):
        tag: the protocol it belongs to (groups operations).
        description: longer text (Markdown).
        path_params: path parameter name -> its schema (default: a non-empty string).
        params: its query and header parameters.
        body: the request body it reads, or None.
        answers: status -> the answer with that status (the 2xx ones, and any non-error
            answer such as `/readyz`'s 503).
        errors: statuses it answers with the JSON error body (401 and 403 of an endpoint
            that needs a credential, 413 and 503 of one with a body are added by the
            description).
    """

    method: str
    path: str
    name: str
    handle: Handler
    access: str = ""
    summary: str = ""
    stream: Opener | None = field(default=None, compare=False)
    tag: str = ""
    description: str = field(default="", compare=False)
    path_params: Mapping[str, Schema] = field(default_factory=dict, compare=False)
    params: tuple[Param, ...] = field(default=(), compare=False)
    body: Body | None = field(default=None, compare=False)
    answers: Mapping[int, Answer] = field(default_factory=dict, compare=False)
    errors: tuple[int, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.access not in ACCESS:
            raise ValueError(f"endpoint {self.name}: access must be one of {ACCESS}, not "
                             f"{self.access!r}")

    @property
    def admin(self) -> bool:
        """Whether it changes bots, tenants or keys (a MANAGE or OPERATOR route other than a
        GET): never retried."""
        return self.access in (MANAGE, OPERATOR) and self.method != "GET"


async def dispatch(service: Service, endpoint: Endpoint, request: Request) -> Reply:
    """Runs one endpoint for one request without a transport (the codecs' tests): the caller,
    handler and error steps of the request pipeline (`service.codecs.pipeline`) on a request
    whose body is already there. The bot a path names goes to the request's access line."""
    if "bot_id" in request.params:
        logs.note(bots=(request.params["bot_id"],))
    try:
        return await endpoint.handle(caller_of(service, endpoint.access, request.headers),
                                     request)
    except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
        return error_reply(exc)

