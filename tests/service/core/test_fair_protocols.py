"""Quotas on every protocol, end to end: a real server on loopback (the session's trunk, a real
directory store, HTTP and gRPC listeners) where tenant `limited` has a quota of 2 images and a
rate too small to refill during the test, and tenant `free` has none.

Once `limited` has spent its 2 images (two distinct images: a feature-cache hit costs nothing),
every way of classifying with its bot answers 429 `rate_limited` with a Retry-After (gRPC:
RESOURCE_EXHAUSTED with the code and retry-after in the trailing metadata; the WebSocket: the
JSON error), while `free` is served, and a repeated image (a cache hit) is still served to
`limited`. A change of the tenant's settings in the store, from another store object as from
another process, applies to the running server.
"""
from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from PIL import Image
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
from tritonclient.utils import InferenceServerException

from accounts.tenants import TenantLimits
from service.transports.grpc.server import GrpcServer
from service.transports.http.app import LISTENERS, create_app
from store import HeadStore
from tests.backbone.helpers import encode
from tests.support.builders import random_head
from tests.support.prometheus import metric
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(300)

LIMITED, FREE = "limited", "free"
LIMITED_BOT, FREE_BOT = "limited-bot", "free-bot"
TINY_RATE = 0.001  # images per second: nothing refills while the test runs


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return encode(Image.fromarray(rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)))


@pytest.fixture(scope="module")
def world(tmp_path_factory, trunk):
    tmp = tmp_path_factory.mktemp("quota")
    store = HeadStore(tmp / "store")
    store.add_tenant(LIMITED, limits=TenantLimits(rate=TINY_RATE, burst=2))
    store.add_tenant(FREE)
    store.register(LIMITED_BOT, *random_head(3, seed=1), tenant=LIMITED)
    store.register(FREE_BOT, *random_head(3, seed=2), tenant=FREE)
    app = create_app(make_settings(tmp, grpc_port=0), trunk=trunk, store=store,
                     listeners=[GrpcServer])
    server = ThreadedServer(app)
    server.store, server.root, server.grpc = store, tmp / "store", app[LISTENERS][0]
    yield server
    server.close()
    store.close()


async def _post(session, url, data, content_type="image/png"):
    async with session.post(url, data=data, headers={"Content-Type": content_type}) as resp:
        return resp.status, resp.headers.get("Retry-After"), await resp.json()


async def test_a_tenant_over_its_quota_gets_429_on_every_protocol_and_others_are_served(world):
    base = world.url
    async with aiohttp.ClientSession() as session:
        for seed in (1, 2):  # the burst: two trunk images
            status, _, body = await _post(session, f"{base}/classify/{LIMITED_BOT}", png(seed))
            assert status == 200, body
        refusals = {
            "native": await _post(session, f"{base}/classify/{LIMITED_BOT}", png(3)),
            "fan_out": await _post(session, f"{base}/classify?bots={LIMITED_BOT}", png(4)),
            "oip": await _post(
                session, f"{base}/v2/models/{LIMITED_BOT}/infer", json.dumps({"inputs": [{
                    "name": "image_bytes", "datatype": "BYTES", "shape": [1],
                    "data": [base64.b64encode(png(5)).decode()]}]}), "application/json"),
            "tf_serving": await _post(
                session, f"{base}/v1/models/{LIMITED_BOT}:predict",
                json.dumps({"instances": [{"b64": base64.b64encode(png(6)).decode()}]}),
                "application/json"),
        }
        for name, (status, retry_after, body) in refusals.items():
            assert (status, body["code"]) == (429, "rate_limited"), (name, body)
            assert int(retry_after) >= 1 and LIMITED in body["error"], (name, retry_after)
        async with session.ws_connect(f"{base}/ws/classify/{LIMITED_BOT}") as ws:
            await ws.send_bytes(png(7))
            answer = await ws.receive_json(timeout=60)
            assert (answer["status"], answer["code"]) == (429, "rate_limited")
            assert answer["retry_after_s"] >= 1
            await ws.send_bytes(png(1))  # a cache hit costs nothing: served
            assert "results" in await ws.receive_json(timeout=60)
        # The other tenant is not affected, and a cache hit of `limited` is served.
        status, _, _ = await _post(session, f"{base}/classify/{FREE_BOT}", png(3))
        assert status == 200
        status, _, _ = await _post(session, f"{base}/classify/{LIMITED_BOT}", png(2))
        assert status == 200
        async with session.get(f"{base}/metrics") as resp:
            text = await resp.text()
    assert metric(text, f'multihead_tenant_refusals_total{{code="rate_limited",'
                        f'tenant="{LIMITED}"}}') >= 5
    assert metric(text, f'multihead_tenant_images_total{{tenant="{LIMITED}"}}') == 2

    await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        world.grpc.wait_started(), world._loop)), 60)
    address = f"127.0.0.1:{world.grpc.port}"

    def grpc_calls() -> None:
        client = triton.InferenceServerClient(address)
        try:
            inp = triton.InferInput("image_bytes", [1], "BYTES")
            inp.set_data_from_numpy(np.array([png(8)], dtype=object))
            with pytest.raises(InferenceServerException) as refused:
                client.infer(LIMITED_BOT, [inp])
            assert str(refused.value.status()) == "StatusCode.RESOURCE_EXHAUSTED"
        finally:
            client.close()
        from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

        request = predict_pb2.PredictRequest()
        request.model_spec.name = LIMITED_BOT
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[png(9)])
        tensor.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
        request.inputs["image_bytes"].CopyFrom(tensor)
        with grpc.insecure_channel(address) as channel:
            predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
            with pytest.raises(grpc.RpcError) as refused:
                predict(request, timeout=60)
        trailing = dict(refused.value.trailing_metadata())
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert trailing["multihead-code"] == "rate_limited"
        assert int(trailing["retry-after"]) >= 1

    await asyncio.get_running_loop().run_in_executor(None, grpc_calls)


async def test_a_settings_change_in_another_store_object_applies_to_the_running_server(world):
    """Lifting the quota from a second store object on the same directory (as `multihead
    tenants set` in another process does) applies within the server's change poll."""
    with HeadStore(world.root) as other:
        other.set_tenant_limits(LIMITED, rate=None, burst=None)  # back to the serve default
    async with aiohttp.ClientSession() as session:
        served = None
        for seed in range(100, 160):  # distinct images: each would need a token
            status, _, body = await _post(session, f"{world.url}/classify/{LIMITED_BOT}",
                                          png(seed))
            if status == 200:
                served = seed
                break
            assert (status, body["code"]) == (429, "rate_limited")
            await asyncio.sleep(0.1)
        assert served is not None, "the lifted quota never reached the server"
        for seed in range(served + 1, served + 6):  # and stays lifted
            status, _, _ = await _post(session, f"{world.url}/classify/{LIMITED_BOT}", png(seed))
            assert status == 200


def test_a_tenant_s_own_limits_win_and_the_serve_defaults_fill_the_rest(tmp_path):
    from service.core.service import Service

    with HeadStore(tmp_path / "store") as store:
        store.add_tenant("own", limits=TenantLimits(weight=3.0, burst=7))
        service = Service(make_settings(tmp_path, tenant_weight=2.0, tenant_rate=5.0,
                                        tenant_max_queued=40), store=store)
        tenancy = service.tenancy
        assert (tenancy.weight("own"), tenancy.rate("own"),
                tenancy.max_queued("own")) == (3.0, (5.0, 7), 40)
        assert (tenancy.weight("default"), tenancy.rate("default")) == (
            2.0, (5.0, None))
        store.set_tenant_limits("own", weight=None, max_queued=9)  # seen after the re-read
        assert (tenancy.weight("own"), tenancy.max_queued("own")) == (2.0, 9)
