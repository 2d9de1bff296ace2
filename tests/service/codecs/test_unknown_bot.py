"""Another tenant's bot is an unknown bot, on every route that names a bot (issue 34, item 3).

One real server (`--auth keys`, the auth matrix's world: tenants `acme` and `globex`) is asked
the same request twice by an acme key, once naming a live globex bot (with two versions and a
candidate, so that every change would succeed for its owner) and once naming an id nobody
registered, of the same length. Both answers must be the same: status, JSON body (the id
aside), headers (but the request's own: date, request id, timings). The requests are every
endpoint of `ENDPOINTS` whose path names a bot (the auth matrix's request for it), plus a
`PUT /bots/{id}` with a `candidate` part and a `?bots=` that names an own bot first, with a
full-scope (manage) and a read-only (infer) key; then the gRPC methods of both protocols.
A refused change is audited alike ("refused", in acme's log, naming the id); the globex bot is
left as it was.
"""
from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import grpc
import pytest
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.codecs.routes import ENDPOINTS
from service.core.auth import INFER, MANAGE
from tests.service.codecs.test_auth import (
    OTHER,
    OWN,
    OWN_BOT,
    PNG,
    REQUESTS,
    UPGRADE,
    World,
    _string_tensor,
    serving,
)
from tests.support.builders import random_head

pytestmark = pytest.mark.timeout(300)

# Headers of the request itself, not of what it asked: they differ between any two requests.
VOLATILE = {"date", "x-request-id", "server-timing", "traceparent", "x-trace-id"}
CREDENTIALS = ("own_manage", "own_infer")
BOT_ENDPOINTS = [e for e in ENDPOINTS if "{bot_id" in e.path]
# Requests beyond the auth matrix's one per endpoint.
EXTRA = {
    "put_bot_candidate": {**REQUESTS["put_bot"], "body": "upload_candidate"},
    "classify_many_after_own": {**REQUESTS["classify_many"],
                                "path": "/classify?bots=" + OWN_BOT + ",{bot}"},
}
EXTRA_ENDPOINTS = [type("Extra", (), {"name": "put_bot_candidate", "access": MANAGE}),
                   type("Extra", (), {"name": "classify_many_after_own", "access": INFER})]
CASES = [(e.name, e.access, credential) for credential in CREDENTIALS
         for e in [*BOT_ENDPOINTS, *EXTRA_ENDPOINTS]
         # A new bot cannot take another tenant's id (ids are global): the residual, below.
         if (e.name, credential) != ("put_bot", "own_manage")]


@pytest.fixture(scope="module")
def world(tmp_path_factory, trunk):
    yield from serving(tmp_path_factory, trunk, "unknown")


def pair(world: World) -> tuple[str, str]:
    """(a new globex bot with 2 versions and a candidate, an unknown id of the same length)."""
    tag = uuid.uuid4().hex[:8]
    other, unknown = f"globex-{tag}", f"nobody-{tag}"
    for v in range(2):
        world.store.register(other, *random_head(3, seed=30 + v), tenant=OTHER)
    world.store.register(other, *random_head(3, seed=40), tenant=OTHER, candidate="shadow")
    return other, unknown


def with_candidate(body: bytes, content_type: str) -> bytes:
    boundary = content_type.split("boundary=")[1].encode()
    part = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="candidate"\r\n\r\n'
            b"shadow\r\n")
    return body.replace(b"--" + boundary + b"--", part + b"--" + boundary + b"--")


async def ask(world: World, name: str, credential: str, bot: str):
    """(status, headers without the volatile ones, body with `bot` as <bot>)."""
    spec = EXTRA.get(name) or REQUESTS[name]
    url = str(world.server.url) + spec["path"].format(bot=bot)
    body, headers = spec["body"], {**spec["headers"], **world.headers[credential]}
    if body in ("upload", "upload_candidate"):
        upload, headers["Content-Type"] = world.upload()
        body = with_candidate(upload, headers["Content-Type"]) if body != "upload" else upload
    if name == "classify_ws":
        headers.update(UPGRADE)
    async with aiohttp.ClientSession() as session:
        async with session.request(spec["method"], url, data=body, headers=headers) as resp:
            raw = await resp.read()
    kept = {k.lower(): v for k, v in resp.headers.items() if k.lower() not in VOLATILE}
    return resp.status, kept, raw.replace(bot.encode(), b"<bot>")


def refusals(world: World, bot: str) -> list[tuple]:
    return [(r.actor, r.action, r.tenant, r.detail) for r in world.store.audit(tenant=OWN)
            if r.bot_id == bot]


def test_every_route_that_names_a_bot_is_covered():
    assert {e.name for e in BOT_ENDPOINTS} <= set(REQUESTS)
    assert len(BOT_ENDPOINTS) >= 20  # native, admin, OIP, TF Serving, the WebSocket


@pytest.mark.parametrize("name, access, credential", CASES,
                         ids=[f"{n}-{c}" for n, _, c in CASES])
async def test_another_tenants_bot_answers_as_an_unknown_bot(world, name, access, credential):
    other, unknown = pair(world)
    before = world.store.info(other)
    status, headers, body = await ask(world, name, credential, other)
    want = await ask(world, name, credential, unknown)
    assert (status, body) == want[::2], (name, status, body[:300], want[0], want[2][:300])
    assert headers == want[1]
    assert status in (403, 404), (status, body[:300])  # never the other tenant's answer
    answer = json.loads(body)
    assert OTHER not in answer["error"] and "tenant" not in answer["error"]
    assert status == 403 or answer["code"] == "unknown_bot"
    # The globex bot is as it was; a refused change is audited alike for both ids.
    after = world.store.info(other)
    assert (after.version, after.versions, after.candidate) == \
        (before.version, before.versions, before.candidate)
    audited = refusals(world, other)
    assert [r[1:] for r in audited] == [r[1:] for r in refusals(world, unknown)]
    if access == MANAGE and credential == "own_manage":
        assert len(audited) == 1 and audited[0][1:3] == ("refused", OWN), audited
        assert audited[0][3].endswith("unknown bot")
    else:
        assert audited == []


async def test_a_new_bots_id_taken_by_another_tenant_names_no_owner(world):
    """The residual: a new bot cannot take an id another tenant owns (ids are global); the
    answer is what any taken id gets, names no tenant, and is audited."""
    other, _ = pair(world)
    status, _, body = await ask(world, "put_bot", "own_manage", other)
    answer = json.loads(body)
    assert status == 409 and answer == {"error": "bot id '<bot>' is taken: choose another id",
                                        "code": "bot_id_taken"}
    assert [r[1:] for r in refusals(world, other)] == [
        ("refused", OWN, "register: bot id taken")]
    # The operator registering the id into another tenant gets the same body.
    async with aiohttp.ClientSession(headers=world.headers["operator"]) as session:
        upload, content_type = world.upload()
        async with session.put(f"{world.server.url}/bots/{other}?tenant={OWN}", data=upload,
                               headers={"Content-Type": content_type}) as resp:
            assert resp.status == 409
            assert (await resp.read()).replace(other.encode(), b"<bot>") == body


def _grpc_calls(address: str, token: str, bot: str) -> list[tuple[str, str, str]]:
    """(method, status code, details with `bot` as <bot>) of each gRPC method on `bot`."""
    metadata = (("authorization", f"Bearer {token}"),)
    out = []
    with grpc.insecure_channel(address) as channel:
        kserve = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        predict = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        model = model_service_pb2_grpc.ModelServiceStub(channel)
        infer = service_pb2.ModelInferRequest(model_name=bot)
        tensor = infer.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(PNG)
        tf_predict = predict_pb2.PredictRequest()
        tf_predict.model_spec.name = bot
        tf_predict.inputs["image_bytes"].CopyFrom(_string_tensor(PNG))
        tf_metadata = get_model_metadata_pb2.GetModelMetadataRequest(
            metadata_field=["signature_def"])
        tf_metadata.model_spec.name = bot
        tf_status = get_model_status_pb2.GetModelStatusRequest()
        tf_status.model_spec.name = bot
        for method, call, request in (
                ("ModelReady", kserve.ModelReady, service_pb2.ModelReadyRequest(name=bot)),
                ("ModelMetadata", kserve.ModelMetadata,
                 service_pb2.ModelMetadataRequest(name=bot)),
                ("ModelInfer", kserve.ModelInfer, infer),
                ("Predict", predict.Predict, tf_predict),
                ("GetModelMetadata", predict.GetModelMetadata, tf_metadata),
                ("GetModelStatus", model.GetModelStatus, tf_status)):
            try:
                call(request, metadata=metadata, timeout=60)
                out.append((method, "OK", ""))
            except grpc.RpcError as exc:
                out.append((method, exc.code().name,
                            (exc.details() or "").replace(bot, "<bot>")))
    return out


@pytest.mark.parametrize("credential", CREDENTIALS)
async def test_grpc_answers_another_tenants_bot_as_an_unknown_one(world, credential):
    await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        world.grpc.wait_started(), world.server._loop)), 60)
    address = f"127.0.0.1:{world.grpc.port}"
    other, unknown = pair(world)
    token = world.tokens[credential]
    got = await asyncio.to_thread(_grpc_calls, address, token, other)
    want = await asyncio.to_thread(_grpc_calls, address, token, unknown)
    assert got == want
    assert {code for _, code, _ in got} == {"NOT_FOUND"}, got
    assert not any(OTHER in details or "tenant" in details for _, _, details in got)
