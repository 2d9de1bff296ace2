"""gRPC checks the credential from the metadata before it reads a message (issue 34, item 5):
a call without an accepted key is refused UNAUTHENTICATED before its message is received, so a
message over the server's receive limit is refused for its key, not for its size, and is never
parsed. A real server (HTTP and gRPC on loopback) with --auth keys."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from accounts.tenants import DEFAULT_TENANT
from service.transports.http.app import LISTENERS, SERVICE
from tests.support.prometheus import metric

pytestmark = pytest.mark.timeout(180)
MIB = 1 << 20
OPERATOR = "operator-token-for-the-gate-test"


def _infer(address: str, size: int, token: str | None) -> grpc.StatusCode:
    request = service_pb2.ModelInferRequest(model_name="alpha")
    request.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(b"\0" * size)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 64 * MIB)]) as channel:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                request, metadata=metadata, timeout=60)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_a_call_without_an_accepted_key_is_refused_before_its_message_is_read(
        make_client):
    client = await make_client(grpc_port=0, auth="keys", admin_token=OPERATOR,
                               max_body_bytes=MIB,
                               max_inflight_bytes=64 * MIB)
    server = client.app[LISTENERS][0]
    await asyncio.wait_for(server.wait_started(), 60)
    address = f"127.0.0.1:{server.port}"
    _, token = client.app[SERVICE].store.add_key(DEFAULT_TENANT, "infer")
    loop = asyncio.get_running_loop()

    async def infer(size: int, credential: str | None) -> grpc.StatusCode:
        return await loop.run_in_executor(None, _infer, address, size, credential)

    # 20 MB, 20 times the receive limit: refused for its key, never received whole nor parsed
    # (a message read first would be RESOURCE_EXHAUSTED for its size).
    assert await infer(20 * MIB, None) == grpc.StatusCode.UNAUTHENTICATED
    assert await infer(20 * MIB, "mh_unknown.key") == grpc.StatusCode.UNAUTHENTICATED
    assert server.credentials.refused == 2
    # An accepted key: the message is read, and its size limit holds.
    assert await infer(20 * MIB, token) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await infer(100, token) == grpc.StatusCode.INVALID_ARGUMENT  # not an image
    assert server.credentials.refused == 2
    # The refusals are counted as any refused call (the pipeline answered them).
    text = await (await client.get("/metrics", headers={
        "Authorization": f"Bearer {OPERATOR}"})).text()
    assert metric(text, 'multihead_requests_total{route="oip_infer",status="401"}') == 2
