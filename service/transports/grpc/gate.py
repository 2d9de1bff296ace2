"""What a gRPC call is checked for before its message is read: its credential, then its
message's size.

grpc hands a server interceptor the call's method and metadata before the request message is
received: `Credentials` checks the `authorization` metadata there, with the access rule of the
RPC's REST twin. A call it refuses (no credential, or one not accepted, where the RPC needs
one: Unauthorized) is answered UNAUTHENTICATED by a stream-unary handler that never reads the
request stream, so its message (up to `max_body_bytes`) is neither received whole nor parsed.
The refusal still runs through the request pipeline (`Rpcs.run`): metrics (401), the access
line, the request id and the `multihead-code` trailing metadata as any refused call.

Only Unauthorized is decided here; the full check (scope, tenant, Forbidden) stays in the
pipeline, which runs again for every call this gate lets through.

Message size per method: `MessageCaps` (the next interceptor) caps each RPC's request message
BEFORE it is parsed. grpc's own receive limit is one per server (`max_body_bytes`, what an
inference message needs); the inference RPCs (`LARGE_RPCS`: ModelInfer, Predict, Classify,
Regress) keep it, every other RPC (ServerLive, ModelMetadata, GetModelStatus, ...) gets
`SMALL_MESSAGE_BYTES`: its handler is given the raw bytes (no request deserializer), whose
length is checked before the original deserializer parses them. A message over its cap is
answered RESOURCE_EXHAUSTED with the code `payload_too_large`, as grpc answers a message over
its own limit (what Triton and KServe clients expect for a message too large); one that does
not parse, INVALID_ARGUMENT (`bad_request`). Both through the request pipeline, as any refusal.
"""
from __future__ import annotations

from collections.abc import Mapping

import grpc
from google.protobuf.message import DecodeError

from service.core.auth import PUBLIC
from service.core.errors import BadRequest, PayloadTooLarge, ServiceError, Unauthorized
from service.transports.grpc.common import ACCESS, Rpcs, rpc_method

# The RPCs whose messages carry images: up to `max_body_bytes` (grpc's own receive limit).
LARGE_RPCS = frozenset({"ModelInfer", "Predict", "Classify", "Regress"})
# The largest request message of every other RPC (names, versions, ...).
SMALL_MESSAGE_BYTES = 64 * 1024


class Credentials(grpc.aio.ServerInterceptor):
    """Refuses a call without an accepted credential before its message is read (see the
    module doc).

    Args:
        rpcs: the process's `Rpcs` (its `Service` authenticates, its `run` answers).
        names: the REST twin's endpoint name of each RPC by method name (`ModelInfer`:
            `oip_infer`), filled once the services are registered; an RPC not there is let
            through.

    Attributes:
        refused: how many calls were refused here (tests).
    """

    def __init__(self, rpcs: Rpcs, names: Mapping[str, str]) -> None:
        self.rpcs = rpcs
        self.names = names
        self.refused = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        name = self.names.get(method.rpartition("/")[2])
        if handler is None or handler.unary_unary is None or name is None:
            return handler
        if ACCESS[name] == PUBLIC:
            return handler
        authorization = next((value for key, value in handler_call_details.invocation_metadata
                              or () if key == "authorization" and isinstance(value, str)), None)
        try:
            self.rpcs.service.auth.admit(authorization, ACCESS[name])
        except Unauthorized:
            self.refused += 1
            return self._refusal(name, method, handler)
        except Exception:  # noqa: BLE001 - Forbidden and the rest: the pipeline's to answer
            pass
        return handler

    def _refusal(self, name: str, method: str, handler):
        rpcs = self.rpcs

        async def refuse(requests, context):
            # NOTE: `requests` is never iterated: the message stays unread.
            return await _refuse(rpcs, name, method, context,
                                 Unauthorized("API key not accepted (unknown or revoked)"))

        return grpc.stream_unary_rpc_method_handler(
            refuse, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


async def _refuse(rpcs: Rpcs, name: str, method: str, context, error: ServiceError):
    """`error` answered through the request pipeline (metrics, access line, trailing metadata)
    for a call whose message was not parsed."""
    async def handle(caller):
        raise error

    with rpc_method(method):
        return await rpcs.run(name, None, context, handle)


class MessageCaps(grpc.aio.ServerInterceptor):
    """Caps each RPC's request message before it is parsed (see the module doc).

    Args:
        rpcs: the process's `Rpcs` (its `run` answers a refusal).
        names: the REST twin's endpoint name of each RPC by method name (`Credentials`'s).
        small_bytes: the cap of the RPCs not in LARGE_RPCS.
    """

    def __init__(self, rpcs: Rpcs, names: Mapping[str, str],
                 small_bytes: int = SMALL_MESSAGE_BYTES) -> None:
        self.rpcs = rpcs
        self.names = names
        self.small_bytes = small_bytes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        rpc = method.rpartition("/")[2]
        name = self.names.get(rpc)
        if handler is None or handler.unary_unary is None or name is None or rpc in LARGE_RPCS:
            return handler
        rpcs, cap, inner = self.rpcs, self.small_bytes, handler.unary_unary
        parse = handler.request_deserializer

        async def capped(raw: bytes, context):
            if len(raw) > cap:
                return await _refuse(rpcs, name, method, context, PayloadTooLarge(
                    f"a {rpc} message of {len(raw)} bytes is over its limit of {cap} bytes"))
            try:
                request = parse(raw) if parse is not None else raw
            except DecodeError:
                return await _refuse(rpcs, name, method, context, BadRequest(
                    f"the {rpc} message does not parse"))
            return await inner(request, context)

        return handler._replace(unary_unary=capped, request_deserializer=None)
