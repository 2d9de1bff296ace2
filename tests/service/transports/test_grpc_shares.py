"""gRPC limits by tenant and by method (issue 34, item 5): a tenant runs at most its weighted
share of `max_grpc_calls` (RESOURCE_EXHAUSTED `call_share` beyond it) and a tenant within its
share is never refused for another's calls (the newest call of the tenant over its share makes
room); every RPC but the inference ones has a small message cap, checked before the message is
parsed. A real server (HTTP and gRPC on loopback, a real grpc channel), --auth keys."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from PIL import Image
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.transports.grpc.common import CODE_KEY, RETRY_AFTER_KEY
from service.transports.grpc.gate import SMALL_MESSAGE_BYTES
from service.transports.http.app import LISTENERS, SERVICE
from tests.backbone.helpers import encode
from tests.support.builders import tenants_with_bots
from tests.support.fakes import GatedTrunk
from tests.support.polling import until

pytestmark = pytest.mark.timeout(180)
OPERATOR = "operator-token-for-the-grpc-shares-test"
BOTS = {"acme": "acme-bot", "globex": "globex-bot"}
KSERVE = "/inference.GRPCInferenceService"


async def _serve(make_client, **settings):
    """(client, gRPC address, {tenant: its infer key}, Rpcs) of a server with two tenants."""
    client = await make_client(grpc_port=0, auth="keys", admin_token=OPERATOR, **settings)
    server = client.app[LISTENERS][0]
    await asyncio.wait_for(server.wait_started(), 60)
    store = client.app[SERVICE].store
    tokens = tenants_with_bots(store, BOTS, seed=10)
    return client, f"127.0.0.1:{server.port}", tokens, server._rpcs  # noqa: SLF001


def _infer_request(tenant: str, colour: int) -> service_pb2.ModelInferRequest:
    return _infer(BOTS[tenant], encode(Image.new("RGB", (32, 32), (colour, 1, 2))))


def _infer(model: str, data: bytes) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="image_bytes", datatype="BYTES",
                       shape=[1]).contents.bytes_contents.append(data)
    return request


async def _outcome(call) -> tuple[grpc.StatusCode, str | None]:
    """(status, domain code) of a call; the code from the trailing metadata."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        trailing = dict(exc.trailing_metadata() or ())
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert int(trailing.get(RETRY_AFTER_KEY, "1")) >= 1
        return exc.code(), trailing.get(CODE_KEY)
    return grpc.StatusCode.OK, None


async def test_a_tenant_over_its_share_of_calls_is_refused_and_its_newest_makes_room(
        make_client, trunk):
    gated = GatedTrunk(trunk, open=True)
    client, address, tokens, rpcs = await _serve(make_client, trunk_obj=gated,
                                                 max_grpc_calls=2, feature_cache_size=0)
    gated.gate.clear()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def infer(tenant: str, colour: int):
            return asyncio.ensure_future(_outcome(stub.ModelInfer(
                _infer_request(tenant, colour), timeout=60,
                metadata=[("authorization", f"Bearer {tokens[tenant]}")])))

        # acme alone: its two calls take every place (one in the gated trunk, one queued).
        acme = [infer("acme", 1)]
        await until(gated.entered.is_set, what="acme's first call in the trunk")
        acme.append(infer("acme", 2))
        await until(lambda: rpcs.calls.held("acme") == 2, what="acme's two calls in flight")
        # globex, within its share (one), runs: acme's newest call makes room.
        globex = infer("globex", 3)
        assert await acme[1] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "call_share")
        await until(lambda: rpcs.calls.held("globex") == 1, what="globex's call in flight")
        # acme holds its share (one) now: another call of its is refused.
        assert await infer("acme", 4) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "call_share")
        gated.gate.set()
        assert await acme[0] == (grpc.StatusCode.OK, None)
        assert await globex == (grpc.StatusCode.OK, None)
    assert rpcs.calls.used == 0


async def test_every_rpc_but_inference_has_a_small_message_cap_checked_before_parsing(
        make_client):
    client, address, tokens, _ = await _serve(make_client, max_body_bytes=1 << 20)
    metadata = [("authorization", f"Bearer {tokens['acme']}")]
    async with grpc.aio.insecure_channel(address) as channel:
        def raw(rpc: str, message: bytes):  # a message sent as bytes, parsed or not
            return _outcome(channel.unary_unary(
                f"{KSERVE}/{rpc}", request_serializer=None,
                response_deserializer=None)(message, metadata=metadata, timeout=30))

        def metadata_of(name: str) -> bytes:
            return service_pb2.ModelMetadataRequest(name=name).SerializeToString()

        over = metadata_of("x" * SMALL_MESSAGE_BYTES)
        assert await raw("ModelMetadata", over) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                    "payload_too_large")
        assert await raw("ServerLive", b"\0" * (SMALL_MESSAGE_BYTES + 1)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, "payload_too_large")
        assert await raw("ModelMetadata", b"\xff\xff\xff") == (grpc.StatusCode.INVALID_ARGUMENT,
                                                               "bad_request")
        # Within the cap: parsed and answered as before.
        assert await raw("ModelMetadata", metadata_of(BOTS["acme"])) == (grpc.StatusCode.OK,
                                                                         None)
        assert await raw("ServerLive", b"") == (grpc.StatusCode.OK, None)
        # An inference message keeps the server's limit (max_body_bytes): 512 KiB is read
        # and parsed (then refused for its contents, not its size).
        big = _infer(BOTS["acme"], b"\0" * (512 << 10)).SerializeToString()
        assert await raw("ModelInfer", big) == (
            grpc.StatusCode.INVALID_ARGUMENT, "invalid_image")
