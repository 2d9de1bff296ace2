"""The bytes every transport moves around the request pipeline, read and answered alike.

A transport (aiohttp, Ray's ingress and model replicas, gRPC) runs each request through the
request pipeline (`service.codecs.pipeline`: request scope, caller, admission, handler, error,
metrics); what it adapts is here, so that every transport reads the same request the same way:

- the codecs' transport-neutral `Request`, from the pieces every transport has (method, path,
  path parameters, query and header pairs, a body reader): `build_request`;
- the body, read as chunks within the per-request size limit and the byte budget of requests
  in flight: `chunks` (a transport's stream of chunks; a client that leaves mid-body is
  BadRequest) and `IncomingBody` (its `admit` is the pipeline's admission step for a body: the
  declared length, `content_length`, admitted before the first byte is read; its `read`
  the whole body, on demand);
- the answer to a request no endpoint matches: `no_route` (404, or 405 with `Allow`), counted
  under `UNMATCHED` (`metric_label`).

    body = IncomingBody(chunks(stream, ConnectionError), headers, settings.max_body_bytes)
    await pipeline.run(service, incoming, step, outcome, access=endpoint.access,
                       admit=body.admit)  # step: endpoint.handle(caller, request(body.read))
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping

from service.codecs.base import Endpoint, Reply, Request, json_reply
from service.codecs.pipeline import UNMATCHED
from service.core import admission
from service.core.admission import Reservation
from service.core.errors import BadRequest, RequestTimeout

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
        read_body: reads the whole body (`IncomingBody.read`); None for a request without
            one.
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


async def paced(body: AsyncIterator[bytes], min_rate_bytes_s: float,
                grace_s: float) -> AsyncIterator[bytes]:
    """`body`'s chunks, as long as they keep a minimum average rate: after `grace_s` from the
    first read, the bytes received must stay at least `min_rate_bytes_s` per second since then
    (a chunk waited for longer than that allows is RequestTimeout: 408). So a body of n bytes
    takes at most `grace_s + n / min_rate_bytes_s` seconds; 0 turns the check off."""
    if min_rate_bytes_s <= 0:
        async for chunk in body:
            yield chunk
        return
    start, received = time.monotonic(), 0
    while True:
        wait_s = start + grace_s + received / min_rate_bytes_s - time.monotonic()
        try:
            async with asyncio.timeout(max(wait_s, 0.0)):
                chunk = await anext(body)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise RequestTimeout(
                f"request body too slow: {received} bytes in "
                f"{time.monotonic() - start:.0f} s, under {min_rate_bytes_s:.0f} bytes/s "
                f"after {grace_s:g} s") from None
        received += len(chunk)
        yield chunk


class IncomingBody:
    """A request's body, admitted before any byte of it is read, then read on demand.

    Args:
        body: the transport's chunks (`chunks`).
        headers: the request's headers, read with lower-case names (`content-length`).
        limit: the per-request size limit (`max_body_bytes`).
    """

    def __init__(self, body: AsyncIterator[bytes], headers: Mapping[str, str],
                 limit: int) -> None:
        self._body = body
        self._headers = headers
        self._limit = limit
        self._length: int | None = None
        self._held: Reservation | None = None

    def admit(self, held: Reservation) -> None:
        """The admission step (`service.codecs.pipeline`): a malformed Content-Length is 400,
        a declared length over the limit 413, one that does not fit the budget 503 (or 429
        beyond the tenant's share: `admission.admit`); the bytes stay held by `held`, which
        may be pushed out until the body is read."""
        self._length = content_length(self._headers)
        admission.admit(self._length, self._limit, held)
        self._held = held
        held.allow_push()  # until the body is read (`admission.read_body`)

    async def read(self) -> bytes | bytearray:
        """The whole body (`admission.read_body`: in place for a declared length, counted as
        it streams when chunked); only after `admit`."""
        if self._held is None:
            raise RuntimeError("read before admit")
        return await admission.read_body(self._body, self._length, self._limit, self._held)


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
