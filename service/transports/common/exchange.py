"""What every transport does around a codec call, written once.

A transport (aiohttp, Ray's ingress and model replicas, gRPC) only moves bytes. Around the call
of an endpoint (`service.codecs.base.dispatch`) the same steps are left to it, and they are
here, so that every transport answers the same request the same way:

- the codecs' transport-neutral `Request`, from the pieces every transport has (method, path,
  path parameters, query and header pairs, a body reader): `build_request`;
- the body, read as chunks within the per-request size limit and the byte budget of requests
  in flight: `content_length`, `chunks` (a transport's stream of chunks; a client that leaves
  mid-body is BadRequest) and `admit_body` (admission before the first byte is read, then the
  whole body on demand);
- the answer to a request no endpoint matches: `no_route` (404, or 405 with `Allow`);
- request metrics and Server-Timing, keyed by the endpoint's NAME (`Endpoint.name`, e.g.
  `oip_infer`, as an RPC mapped to that endpoint is), every request that matched none under
  `UNMATCHED`; 404s and 405s are counted like any answer: `metric_label`, `record`.

    with Reservation(service.inflight) as held:
        read_body = admit_body(chunks(stream, ConnectionError), content_length(headers),
                               service.settings.max_body_bytes, held)
        request = build_request(method, path, params, query, headers, read_body)
        reply = await dispatch(service, endpoint, request)
    headers["Server-Timing"] = record(service.metrics, metric_label(endpoint), reply.status,
                                      start_s)
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping

from service.codecs.base import Endpoint, Reply, Request, json_reply
from service.core import admission
from service.core.admission import Reservation
from service.core.errors import BadRequest
from service.core.metrics import Metrics

# The metrics label of a request no endpoint matched (404, 405): one fixed label, so that
# scanners probing random paths cannot grow the label set.
UNMATCHED = "unmatched"
SERVER_TIMING = "Server-Timing"
# The metrics status of a request whose client went away before its answer (nginx's code):
# an HTTP disconnect, a gRPC cancel, a WebSocket closed, behind Ray's proxy alike.
CLIENT_CLOSED = 499

BodyReader = Callable[[], Awaitable["bytes | bytearray"]]


def build_request(method: str, path: str, params: Mapping[str, str],
                  query: Iterable[tuple[str, str]], headers: Iterable[tuple[str, str]],
                  read_body: BodyReader | None = None) -> Request:
    """The codecs' view of one request.

    Args:
        method: the HTTP method (upper case).
        path: the request path.
        params: path parameters of the matched route.
        query: query parameters as (name, value) pairs, repeated names included: the FIRST
            value of a name is kept (frameworks' multidicts disagree on which one `get` gives).
        headers: header (name, value) pairs; names are lower-cased, the last of a repeated
            name is kept.
        read_body: reads the whole body (see `admit_body`); None for a request without one.
    """
    first: dict[str, str] = {}
    for name, value in query:
        first.setdefault(name, value)
    return Request(method=method, path=path, params=dict(params), query=first,
                   headers={name.lower(): value for name, value in headers},
                   read_body=read_body)


def content_length(headers: Mapping[str, str]) -> int | None:
    """The declared body length (`headers` with lower-case names), None when not declared;
    anything but digits is BadRequest."""
    raw = headers.get("content-length")
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit():
        raise BadRequest(f"invalid Content-Length: {raw[:40]!r}")
    return int(raw)


async def chunks(stream: AsyncIterable[bytes],
                 cut_short: type[BaseException] | tuple[type[BaseException], ...]
                 ) -> AsyncIterator[bytes]:
    """The non-empty chunks of a transport's body stream; `cut_short` (the exception the
    framework raises when the client goes away mid-body) becomes BadRequest."""
    try:
        async for chunk in stream:
            if chunk:
                yield chunk
    except cut_short:
        raise BadRequest("the request body was cut short") from None


def admit_body(body: AsyncIterator[bytes], length: int | None, limit: int,
               held: Reservation) -> BodyReader:
    """Admits the body now, before any byte of it is read (`admission.admit`: a declared length
    over `limit` is 413, one that does not fit the budget 503), and returns the reader of the
    whole body (`admission.read_body`: in place for a declared length, counted as it streams
    when chunked). The bytes stay held by `held`."""
    admission.admit(length, limit, held)

    async def read_body() -> bytes | bytearray:
        return await admission.read_body(body, length, limit, held)

    return read_body


def no_route(allowed: Iterable[str] = ()) -> Reply:
    """The answer to a request no endpoint matched: 404 when its path has no endpoint, 405
    with `Allow` (sorted, as aiohttp gives it) when the path has endpoints for other methods."""
    methods = sorted(set(allowed))
    if methods:
        return json_reply({"error": "Method Not Allowed", "code": "method_not_allowed"},
                          405, {"Allow": ",".join(methods)})
    return json_reply({"error": "Not Found", "code": "not_found"}, 404)


def metric_label(endpoint: Endpoint | None) -> str:
    """The `route` label of a request's metrics: its endpoint's name, or UNMATCHED."""
    return endpoint.name if endpoint is not None else UNMATCHED


def record(metrics: Metrics, label: str, status: int, start_s: float | None) -> str:
    """Counts one answered request (`requests_total`, and `request_seconds` from `start_s`, a
    `time.perf_counter()` reading taken when the transport got it) and returns the value of
    its Server-Timing header. `start_s=None`: counted, not timed (a WebSocket's lifetime is not
    a request's latency)."""
    if start_s is None:
        metrics.observe_request(label, status, None)
        return ""
    elapsed_s = time.perf_counter() - start_s
    metrics.observe_request(label, status, elapsed_s)
    return f"app;dur={elapsed_s * 1000:.1f}"
