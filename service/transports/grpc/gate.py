"""The credential check of a gRPC call before its message is read.

grpc hands a server interceptor the call's method and metadata before the request message is
received: `Credentials` checks the `authorization` metadata there, with the access rule of the
RPC's REST twin. A call it refuses (no credential, or one not accepted, where the RPC needs
one: Unauthorized) is answered UNAUTHENTICATED by a stream-unary handler that never reads the
request stream, so its message (up to `max_body_bytes`) is neither received whole nor parsed.
The refusal still runs through the request pipeline (`Rpcs.run`): metrics (401), the access
line, the request id and the `multihead-code` trailing metadata as any refused call.

Only Unauthorized is decided here; the full check (scope, tenant, Forbidden) stays in the
pipeline, which runs again for every call this gate lets through.
"""
from __future__ import annotations

from collections.abc import Mapping

import grpc

from service.core.auth import PUBLIC
from service.core.errors import Unauthorized
from service.transports.grpc.common import ACCESS, Rpcs, rpc_method


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
            async def handle(caller):
                raise Unauthorized("API key not accepted (unknown or revoked)")

            with rpc_method(method):
                return await rpcs.run(name, None, context, handle)

        return grpc.stream_unary_rpc_method_handler(
            refuse, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
