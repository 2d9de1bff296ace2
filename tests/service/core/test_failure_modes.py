"""Failure modes over HTTP, on a real server: a deadline passing in the queue (504), a draining
service (503 shutting_down), a trunk that raises (500 without internals), a trunk that fails
to load (every protocol's readiness says so)."""
from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from service.transports.http.app import SERVICE, create_app
from tests.support.fakes import GatedTrunk
from tests.support.polling import until
from tests.support.servers import make_settings

pytestmark = pytest.mark.timeout(300)

INTERNAL = {"error": "internal server error", "code": "internal"}


def png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 24), color).save(out, "PNG")
    return out.getvalue()


async def post_png(client, color, bot="alpha"):
    return await client.post(f"/classify/{bot}", data=png(color),
                             headers={"Content-Type": "image/png"})


async def test_a_deadline_passing_in_the_queue_is_504_and_the_running_request_answers(
        make_client, trunk):
    gated = GatedTrunk(trunk)
    client = await make_client(trunk_obj=gated, request_timeout_s=1.0, feature_cache_size=0,
                               max_wait_ms=1.0)
    service = client.server.app[SERVICE]
    first = asyncio.create_task(post_png(client, (1, 2, 3)))
    await until(gated.entered.is_set, what="the first request in the trunk")
    second = asyncio.create_task(post_png(client, (4, 5, 6)))
    await until(lambda: service.engine.batcher.queue_depth == 1, what="the second request queued")
    await asyncio.sleep(1.2)  # past the queued request's deadline, the trunk still blocked
    gated.gate.set()
    resp = await second
    assert (resp.status, await resp.json()) == (504, {
        "error": "the request's deadline passed while it waited for the trunk",
        "code": "deadline_exceeded"})
    resp = await first  # its rows reached the trunk before its deadline: it answers
    assert resp.status == 200 and (await resp.json())["bot_id"] == "alpha"


async def test_a_draining_service_refuses_new_requests_and_finishes_the_running_one(
        make_client, trunk):
    gated = GatedTrunk(trunk)
    client = await make_client(trunk_obj=gated, feature_cache_size=0)
    service = client.server.app[SERVICE]
    running = asyncio.create_task(post_png(client, (7, 8, 9)))
    await until(gated.entered.is_set, what="the first request in the trunk")
    draining = asyncio.create_task(service.engine.close())
    await until(lambda: service.engine.batcher.closing, what="the engine draining")
    resp = await post_png(client, (10, 11, 12))
    assert (resp.status, await resp.json()) == (503, {
        "error": "the service is shutting down and accepts no new requests",
        "code": "shutting_down"})
    gated.gate.set()
    resp = await running
    assert resp.status == 200
    await draining


class RaisingTrunk(GatedTrunk):
    def features(self, images):
        raise RuntimeError("/secret/path/trunk.ckpt: kernel launch failed")


ROUTES = {
    "native": ("/classify/alpha", {"data": png((1, 1, 1)),
                                   "headers": {"Content-Type": "image/png"}}),
    "oip": ("/v2/models/alpha/infer", {"json": {"inputs": [{
        "name": "image_bytes", "datatype": "BYTES", "shape": [1],
        "data": [base64.b64encode(png((2, 2, 2))).decode()]}]}}),
    "tf-serving": ("/v1/models/alpha:predict", {"json": {"instances": [
        {"b64": base64.b64encode(png((3, 3, 3))).decode()}]}}),
}


@pytest.mark.parametrize("route", ROUTES)
async def test_a_trunk_that_raises_is_a_500_that_names_no_internals(make_client, trunk, route):
    client = await make_client(trunk_obj=RaisingTrunk(trunk), feature_cache_size=0)
    path, kwargs = ROUTES[route]
    resp = await client.post(path, **kwargs)
    text = await resp.text()
    assert (resp.status, await resp.json()) == (500, INTERNAL)
    assert "secret" not in text and "kernel" not in text


async def test_a_trunk_that_fails_to_load_is_reported_by_every_protocol(aiohttp_client, store,
                                                                        tmp_path):
    settings = make_settings(tmp_path, trunk_checkpoint=str(tmp_path / "missing.ckpt"))
    app = create_app(settings, store=store)
    client = await aiohttp_client(app)
    service = app[SERVICE]
    assert not await service.wait_ready()
    error = service.readiness.error
    assert error.startswith("trunk failed to load: ") and "missing.ckpt" in error

    resp = await client.get("/readyz")
    body = await resp.json()
    assert (resp.status, body["status"], body["error"]) == (503, "failed", error)
    resp = await client.get("/v2/health/ready")
    assert (resp.status, await resp.json()) == (503, {"ready": False})
    resp = await client.get("/v2/models/alpha/ready")
    assert (resp.status, await resp.json()) == (503, {"name": "alpha", "ready": False})
    resp = await client.get("/v1/models/alpha")
    assert (resp.status, await resp.json()) == (200, {"model_version_status": [{
        "version": "1", "state": "END",
        "status": {"error_code": "UNAVAILABLE", "error_message": error}}]})
    resp = await client.get("/healthz")
    assert resp.status == 200  # the process is alive; it only cannot serve
    resp = await post_png(client, (1, 2, 3))
    assert (resp.status, await resp.json()) == (503, {"error": error, "code": "not_ready"})
    assert resp.headers["Retry-After"] == "5"
