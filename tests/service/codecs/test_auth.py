"""Tenants and keys on every route: the auth matrix, generated from the endpoint table.

One real server on loopback (the session's trunk, a real directory store holding two tenants,
`acme` and `globex`, each with a bot and keys) runs with `--auth keys` and an operator token.
Every endpoint of `service.codecs.routes.ENDPOINTS` is called with each credential: none, a
malformed header, an unknown key, a revoked key, the other tenant's infer and manage keys,
the own tenant's infer, manage and metrics keys, and the operator token; each answer is
checked against the endpoint's access rule. A streaming endpoint (the WebSocket) is opened
with a WebSocket client: allowed, it answers 101 and then an image sent on it; refused, its
upgrade request gets the JSON error before any upgrade. An endpoint without a request here
fails `test_every_endpoint_is_in_the_matrix`; one without a rule cannot be built (`Endpoint`).

Then the gRPC protocols with Triton's own client and the TF Serving stubs (the key as
metadata), and `--auth none`.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import json
import os
import random
import string
import uuid

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from PIL import Image
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
from tritonclient.utils import InferenceServerException

from accounts.tenants import new_token
from backbone.checkpoint import write_checkpoint
from service.codecs.routes import ENDPOINTS
from service.core.auth import INFER, MANAGE, METRICS, OPERATOR, PUBLIC
from service.transports.grpc.server import GrpcServer
from service.transports.http.app import LISTENERS, create_app
from store import HeadStore
from tests.backbone.helpers import encode
from tests.support.builders import random_head
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(300)

OPERATOR_TOKEN = "operator-s3cret-token"
OWN, OTHER = "acme", "globex"
OWN_BOT, OTHER_BOT = "acme-bot", "globex-bot"
PNG = encode(Image.new("RGB", (64, 64), (200, 30, 60)))
CREDENTIALS = ("none", "malformed", "unknown", "revoked", "other_infer", "other_manage",
               "own_infer", "own_manage", "own_metrics", "operator")
REFUSED = ("none", "malformed", "unknown", "revoked")  # 401 wherever a credential is needed


class World:
    """The server, its store, and a header per credential."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.store = HeadStore(tmp_path / "store")
        self.headers: dict[str, dict[str, str]] = {"none": {},
                                                     "malformed": {"Authorization": "Basic x"}}
        for tenant in (OWN, OTHER):
            self.store.add_tenant(tenant)
        self.store.register(OWN_BOT, *random_head(3, seed=1), tenant=OWN)
        self.store.register(OTHER_BOT, *random_head(4, seed=2), tenant=OTHER)
        tokens = {}
        for name, tenant, scope in (("own_infer", OWN, "infer"), ("own_manage", OWN, "manage"),
                                    ("own_metrics", OWN, "metrics"),
                                    ("other_infer", OTHER, "infer"),
                                    ("other_manage", OTHER, "manage"),
                                    ("revoked", OWN, "manage")):
            key, tokens[name] = self.store.add_key(tenant, scope)
            if name == "revoked":
                self.store.revoke_key(key.id)
        tokens["unknown"] = new_token()[1]
        tokens["operator"] = OPERATOR_TOKEN
        self.tokens = tokens
        for name, token in tokens.items():
            self.headers[name] = {"Authorization": f"Bearer {token}"}
        self.upload_dir = tmp_path / "uploads"

    def fresh_bot(self, versions: int = 2, *, candidate: bool = False) -> str:
        """A new bot of the own tenant, for a request that changes or removes it (with a
        candidate to promote or discard, if asked)."""
        bot_id = f"acme-{uuid.uuid4().hex[:8]}"
        for v in range(versions):
            self.store.register(bot_id, *random_head(3, seed=10 + v), tenant=OWN)
        if candidate:
            self.store.register(bot_id, *random_head(3, seed=20), tenant=OWN,
                                candidate="shadow")
        return bot_id

    def upload(self) -> tuple[bytes, str]:
        """A multipart head upload: (body, content type)."""
        weights, biases, labels = random_head(3, seed=5)
        prefix = write_checkpoint(str(self.upload_dir / uuid.uuid4().hex / "head.ckpt"),
                                  {"weights": weights, "biases": biases})
        boundary = uuid.uuid4().hex
        body = b""
        for name, filename, data in (
                ("index", "head.ckpt.index", open(f"{prefix}.index", "rb").read()),
                ("data", "head.ckpt.data-00000-of-00001",
                 open(f"{prefix}.data-00000-of-00001", "rb").read()),
                ("labels", "labels.txt", ("\n".join(labels) + "\n").encode())):
            body += (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                     f'filename="{filename}"\r\n\r\n').encode() + data + b"\r\n"
        return body + f"--{boundary}--\r\n".encode(), \
            f"multipart/form-data; boundary={boundary}"


def serving(tmp_path_factory, trunk, name: str):
    """A `World` with its server running (HTTP and gRPC, `--auth keys`), closed after."""
    w = World(tmp_path_factory.mktemp(name))
    settings = make_settings(w.tmp_path, auth="keys", admin_token=OPERATOR_TOKEN,
                             grpc_port=0)
    app = create_app(settings, trunk=trunk, store=w.store, listeners=[GrpcServer])
    w.server = ThreadedServer(app)
    w.grpc = app[LISTENERS][0]
    yield w
    w.server.close()
    w.store.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory, trunk):
    yield from serving(tmp_path_factory, trunk, "auth")


def js(obj) -> bytes:
    return json.dumps(obj).encode()


JSON_TYPE = {"Content-Type": "application/json"}
PNG_TYPE = {"Content-Type": "image/png"}
B64 = base64.b64encode(PNG).decode()
OIP_BODY = js({"inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [1],
                           "data": [B64]}]})
TFS_BODY = js({"instances": [{"b64": B64}]})


def bot_route(method, path, body=None, headers=None, *, fresh=False, candidate=False):
    """A request on one bot: `path` with `{bot}`; `fresh`: on a new own bot (it changes it);
    `candidate`: that bot has a candidate."""
    return {"method": method, "path": path, "body": body, "headers": headers or {},
            "fresh": fresh, "bot": True, "candidate": candidate}


def route(method, path, body=None, headers=None):
    return {"method": method, "path": path, "body": body, "headers": headers or {},
            "fresh": False, "bot": False}


# One request per endpoint name. `{bot}` is the target bot: the own tenant's.
REQUESTS = {
    "classify": bot_route("POST", "/classify/{bot}", PNG, PNG_TYPE),
    "classify_ws": bot_route("GET", "/ws/classify/{bot}"),
    "classify_many": bot_route("POST", "/classify?bots={bot}", PNG, PNG_TYPE),
    "list_bots": route("GET", "/bots"),
    "show_bot": bot_route("GET", "/bots/{bot}"),
    "put_bot": bot_route("PUT", "/bots/{bot}", "upload", fresh=True),
    "delete_bot": bot_route("DELETE", "/bots/{bot}", fresh=True),
    "rollback_bot": bot_route("POST", "/bots/{bot}/rollback", fresh=True),
    "promote_candidate": bot_route("POST", "/bots/{bot}/candidate/promote", fresh=True,
                                   candidate=True),
    "discard_candidate": bot_route("DELETE", "/bots/{bot}/candidate", fresh=True,
                                   candidate=True),
    "list_tenants": route("GET", "/tenants"),
    "put_tenant": route("PUT", "/tenants/{new_tenant}"),
    "patch_tenant": route("PATCH", "/tenants/{fresh_tenant}", js({"weight": 2, "rate": None}),
                          JSON_TYPE),
    "delete_tenant": route("DELETE", "/tenants/{fresh_tenant}"),
    "list_keys": route("GET", "/keys"),
    "post_key": route("POST", "/keys", js({"tenant": OWN, "scope": "infer"}), JSON_TYPE),
    "delete_key": route("DELETE", "/keys/{fresh_key}"),
    "get_audit": route("GET", "/audit"),
    "healthz": route("GET", "/healthz"),
    "readyz": route("GET", "/readyz"),
    "metrics": route("GET", "/metrics"),
    "openapi": route("GET", "/openapi.json"),
    "docs_page": route("GET", "/docs"),
    "docs_asset": route("GET", "/docs/docs.js"),
    "oip_server_metadata": route("GET", "/v2"),
    "oip_server_live": route("GET", "/v2/health/live"),
    "oip_server_ready": route("GET", "/v2/health/ready"),
    "oip_model_metadata": bot_route("GET", "/v2/models/{bot}"),
    "oip_model_ready": bot_route("GET", "/v2/models/{bot}/ready"),
    "oip_infer": bot_route("POST", "/v2/models/{bot}/infer", OIP_BODY, JSON_TYPE),
    "oip_model_metadata_version": bot_route("GET", "/v2/models/{bot}/versions/1"),
    "oip_model_ready_version": bot_route("GET", "/v2/models/{bot}/versions/1/ready"),
    "oip_infer_version": bot_route("POST", "/v2/models/{bot}/versions/1/infer", OIP_BODY,
                                   JSON_TYPE),
    "tfs_status": bot_route("GET", "/v1/models/{bot}"),
    "tfs_metadata": bot_route("GET", "/v1/models/{bot}/metadata"),
    "tfs_predict": bot_route("POST", "/v1/models/{bot}:predict", TFS_BODY, JSON_TYPE),
    "tfs_status_version": bot_route("GET", "/v1/models/{bot}/versions/1"),
    "tfs_metadata_version": bot_route("GET", "/v1/models/{bot}/versions/1/metadata"),
    "tfs_predict_version": bot_route("POST", "/v1/models/{bot}/versions/1:predict", TFS_BODY,
                                     JSON_TYPE),
}
# Each rule's endpoints must keep the shape their expectation assumes.
BOT_ROUTES = {name for name, r in REQUESTS.items() if r["bot"]}


def test_every_endpoint_is_in_the_matrix():
    assert sorted(REQUESTS) == sorted(e.name for e in ENDPOINTS)


def expected(endpoint, credential: str) -> int | str:
    """The status an endpoint answers a credential with (for a bot route, on the own
    tenant's bot), or "ok" for its own 2xx."""
    access = endpoint.access
    if access == PUBLIC:
        return "ok"
    if credential in REFUSED:
        return 401
    if credential == "operator":
        return "ok"
    scope = credential.rsplit("_", 1)[1]
    allowed = {INFER: ("infer", "manage"), MANAGE: ("manage",), METRICS: ("metrics",),
               OPERATOR: ()}[access]
    if scope not in allowed:
        return 403
    if credential.startswith("other") and endpoint.name in BOT_ROUTES:
        return 409 if endpoint.name == "put_bot" else 404  # the other tenant's bot is unknown
    return "ok"


async def call(world: World, endpoint, credential: str, bot: str | None = None):
    spec = REQUESTS[endpoint.name]
    target = bot or (world.fresh_bot(candidate=spec.get("candidate", False)) if spec["fresh"]
                     else OWN_BOT)
    path = spec["path"].format(
        bot=target, new_tenant=f"t-{uuid.uuid4().hex[:8]}",
        fresh_tenant=_fresh_tenant(world), fresh_key=_fresh_key(world))
    body, headers = spec["body"], {**spec["headers"], **world.headers[credential]}
    if body == "upload":
        body, headers["Content-Type"] = world.upload()
    if endpoint.stream is not None:
        status, answer_headers, raw = await _open_stream(str(world.server.url) + path, headers,
                                                         target)
        return status, answer_headers, raw, target
    async with aiohttp.ClientSession() as session:
        async with session.request(spec["method"], str(world.server.url) + path, data=body,
                                   headers=headers) as resp:
            raw = await resp.read()
            return resp.status, resp.headers, raw, target


# What a WebSocket client sends to upgrade (RFC 6455), for reading a refused upgrade's answer.
UPGRADE = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
           "Sec-WebSocket-Key": base64.b64encode(b"multihead-auth-1").decode()}


async def _open_stream(url: str, headers: dict[str, str], bot: str):
    """(status, headers, body) of a WebSocket upgrade: 101 once an image sent on the socket
    was answered by `bot`; else the refused upgrade's answer (the JSON error)."""
    async with aiohttp.ClientSession() as session:
        try:
            async with session.ws_connect(url, headers=headers) as ws:
                await ws.send_bytes(PNG)
                reply = await ws.receive_json(timeout=60)
                assert reply["bot_id"] == bot and len(reply["results"]) == 1, reply
                return 101, {}, b""
        except aiohttp.WSServerHandshakeError:
            pass
        async with session.get(url, headers={**headers, **UPGRADE}) as resp:
            assert resp.status != 101
            return resp.status, resp.headers, await resp.read()


def _fresh_tenant(world: World) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    world.store.add_tenant(name)
    return name


def _fresh_key(world: World) -> str:
    return world.store.add_key(OWN, "infer")[0].id


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


@pytest.mark.parametrize("credential", CREDENTIALS)
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e.name for e in ENDPOINTS])
async def test_every_route_answers_every_credential_by_its_rule(world, endpoint, credential):
    status, headers, raw, target = await call(world, endpoint, credential)
    want = expected(endpoint, credential)
    body = _json(raw)
    if want == "ok" and endpoint.stream is not None:
        assert status == 101, (status, raw[:300])
    elif want == "ok":
        assert 200 <= status < 300, (status, raw[:300])
    else:
        assert status == want, (status, raw[:300])
        assert body is not None and set(body) == {"error", "code"}, raw[:300]
        assert OPERATOR_TOKEN not in raw.decode() and "mhk_" not in raw.decode()
    if status == 401:
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert body["code"] == "unauthorized"
    if want == 404:
        # Exactly as an unknown bot: the same answer an unknown id gets, but for its name.
        _, _, unknown, _ = await call(world, endpoint, credential.replace("other", "own"),
                                      bot="nobody-bot")
        assert raw.replace(target.encode(), b"nobody-bot") == unknown
    if want == 409:
        assert body["code"] == "bot_id_taken" and OTHER not in raw.decode() \
            and OWN not in body["error"].replace(target, "")


@pytest.mark.parametrize("credential, sees", [
    ("own_infer", {OWN_BOT}), ("own_manage", {OWN_BOT}), ("other_infer", {OTHER_BOT}),
    ("operator", {OWN_BOT, OTHER_BOT})])
async def test_a_listing_shows_only_the_callers_tenant(world, credential, sees):
    async with aiohttp.ClientSession(headers=world.headers[credential]) as session:
        async with session.get(f"{world.server.url}/bots") as resp:
            listed = {b["bot_id"] for b in (await resp.json())["bots"]}
    assert resp.status == 200 and {OWN_BOT, OTHER_BOT} & listed == sees
    if credential != "operator":
        assert all(bot.startswith(("acme", "globex")) for bot in listed)
        assert not any(bot.startswith("globex" if OWN_BOT in sees else "acme")
                       for bot in listed)


async def test_a_bots_candidate_is_shown_to_who_may_manage_it(world):
    bot = world.fresh_bot(candidate=True)
    async with aiohttp.ClientSession() as session:
        async def shown(credential: str):
            async with session.get(f"{world.server.url}/bots/{bot}",
                                   headers=world.headers[credential]) as resp:
                body = await resp.json()
                return resp.status, body.get("candidate", "absent")

        for credential in ("own_manage", "operator"):
            status, candidate = await shown(credential)
            assert status == 200 and (candidate["version"], candidate["mode"]) == (3, "shadow")
            assert candidate["stats"]["images"] == 0
        assert await shown("own_infer") == (200, "absent")
        assert (await shown("other_manage"))[0] == 404


async def test_a_manage_key_registers_in_its_tenant_and_reads_only_its_audit(world):
    bot = f"acme-{uuid.uuid4().hex[:8]}"
    body, ctype = world.upload()
    async with aiohttp.ClientSession(headers=world.headers["own_manage"]) as session:
        async with session.put(f"{world.server.url}/bots/{bot}", data=body,
                               headers={"Content-Type": ctype}) as resp:
            assert resp.status == 201, await resp.text()
            assert (await resp.json())["tenant"] == OWN
        async with session.put(f"{world.server.url}/bots/{bot}?tenant={OTHER}", data=body,
                               headers={"Content-Type": ctype}) as resp:
            assert resp.status == 403  # a key cannot register into another tenant
        async with session.get(f"{world.server.url}/audit") as resp:
            records = (await resp.json())["records"]
    assert records and {r["tenant"] for r in records} == {OWN}
    mine = [r for r in records if r["bot_id"] == bot]
    assert [r["action"] for r in mine] == ["register"]
    assert mine[0]["actor"].startswith("key:") and mine[0]["digest"]
    assert all(r["detail"] is None for r in records)  # sources are server paths


async def test_readyz_is_minimal_without_the_right_to_metrics(world):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{world.server.url}/readyz") as resp:
            assert await resp.json() == {"status": "ready"}
        async with session.get(f"{world.server.url}/readyz",
                               headers=world.headers["own_metrics"]) as resp:
            full = await resp.json()
    assert full["status"] == "ready" and "checkpoint" in full["trunk"]


async def test_a_revoked_key_is_refused_at_once(world):
    key, token = world.store.add_key(OWN, "infer")
    url = f"{world.server.url}/bots/{OWN_BOT}"
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(url) as resp:
            assert resp.status == 200
        world.store.revoke_key(key.id)
        async with session.get(url) as resp:
            assert resp.status == 401


# -- gRPC: Triton's client and the TF Serving stubs, the key as metadata ------------------------

async def _grpc_address(world: World) -> str:
    await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        world.grpc.wait_started(), world.server._loop)), 60)
    return f"127.0.0.1:{world.grpc.port}"


def _triton_code(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except InferenceServerException as exc:
        return str(exc.status())
    return "OK"


async def test_tritons_grpc_client_passes_the_key_as_metadata(world):
    address = await _grpc_address(world)

    def check() -> None:
        client = triton.InferenceServerClient(address)
        own = {"authorization": f"Bearer {world.tokens['own_infer']}"}
        other = {"authorization": f"Bearer {world.tokens['other_infer']}"}
        try:
            assert client.is_model_ready(OWN_BOT, headers=own) is True
            inp = triton.InferInput("image_bytes", [1], "BYTES")
            inp.set_data_from_numpy(np.array([PNG], dtype=object))
            result = client.infer(OWN_BOT, [inp], headers=own)
            assert result.as_numpy("probabilities").shape == (1, 3)
            assert _triton_code(client.infer, OWN_BOT, [inp], headers=other) \
                == "StatusCode.NOT_FOUND"
            assert _triton_code(client.get_model_metadata, OWN_BOT, headers=other) \
                == "StatusCode.NOT_FOUND"
            assert _triton_code(client.infer, OWN_BOT, [inp]) == "StatusCode.UNAUTHENTICATED"
            assert client.is_server_live()  # liveness is public
        finally:
            client.close()

    await asyncio.get_running_loop().run_in_executor(None, check)


async def test_tf_serving_stubs_pass_the_key_as_metadata(world):
    address = await _grpc_address(world)

    def check() -> None:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = OWN_BOT
        request.inputs["image_bytes"].CopyFrom(_string_tensor(PNG))
        with grpc.insecure_channel(address) as channel:
            predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
            own = (("authorization", f"Bearer {world.tokens['own_infer']}"),)
            answer = predict(request, metadata=own, timeout=60)
            assert list(answer.outputs["probabilities"].tensor_shape.dim)[1].size == 3
            for metadata, code in (
                    ((("authorization", f"Bearer {world.tokens['other_manage']}"),),
                     grpc.StatusCode.NOT_FOUND),
                    ((("authorization", f"Bearer {world.tokens['revoked']}"),),
                     grpc.StatusCode.UNAUTHENTICATED),
                    ((("authorization", f"Bearer {world.tokens['own_metrics']}"),),
                     grpc.StatusCode.PERMISSION_DENIED)):
                with pytest.raises(grpc.RpcError) as error:
                    predict(request, metadata=metadata, timeout=60)
                assert error.value.code() == code

    await asyncio.get_running_loop().run_in_executor(None, check)


def _string_tensor(data: bytes):
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[data])
    tensor.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
    return tensor


# -- hostile Authorization headers ------------------------------------------------------------

FUZZ_CASES = int(os.environ.get("MULTIHEAD_FUZZ_CASES", "2000"))


def hostile_authorizations(seed: int, count: int, tokens: dict[str, str]) -> list[str]:
    """Authorization values: random text, wrong schemes, near-misses of real keys (one
    character changed, cut, doubled), of the operator token, and oversized ones."""
    rng = random.Random(seed)
    alphabet = string.printable + "é€\u200b\x00\x7f"
    real = [tokens["own_infer"], tokens["own_manage"], OPERATOR_TOKEN]
    out = []
    for _ in range(count):
        kind = rng.randrange(7)
        if kind == 0:
            value = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 80)))
        elif kind == 1:
            value = rng.choice(["Basic", "bearer", "BEARER", "Token", "Bearer:", ""]) + " " + \
                rng.choice(real)
        elif kind == 2:
            token = list(rng.choice(real))
            i = rng.randrange(len(token))
            token[i] = rng.choice(string.ascii_letters + string.digits + "_-")
            value = "Bearer " + "".join(token)
        elif kind == 3:
            token = rng.choice(real)
            value = "Bearer " + rng.choice([token[:rng.randrange(len(token))], token * 2,
                                            token + " ", " " + token, token + " x"])
        elif kind == 4:
            value = "Bearer mhk_" + "".join(rng.choice("0123456789abcdef_-xyz")
                                            for _ in range(rng.randrange(0, 70)))
        elif kind == 5:
            value = "Bearer " + "A" * rng.choice([1000, 7000])
        else:
            value = "Bearer " + "".join(rng.choice(alphabet) for _ in range(rng.randrange(80)))
        out.append(value)
    return out


async def test_hostile_authorization_headers_get_401_json_and_never_a_5xx(world):
    values = hostile_authorizations(0, FUZZ_CASES, world.tokens)
    url = f"{world.server.url}/bots/{OWN_BOT}"
    statuses: collections.Counter = collections.Counter()
    bad, unsendable = [], 0
    async with aiohttp.ClientSession() as session:
        async def one(value: str) -> None:
            nonlocal unsendable
            try:
                async with session.get(url, headers={"Authorization": value}) as resp:
                    body = await resp.read()
            except (ValueError, aiohttp.ClientError):
                unsendable += 1  # the client refused to send it (a newline, a NUL)
                return
            statuses[resp.status] += 1
            if resp.status >= 500:
                bad.append(f"{value[:60]!r} -> {resp.status} {body[:100]!r}")
            elif resp.status != 200:
                error = json.loads(body)
                if set(error) != {"error", "code"} or value[7:] and value[7:] in error["error"]:
                    bad.append(f"{value[:60]!r} -> {resp.status} {body[:100]!r}")

        for i in range(0, len(values), 16):
            await asyncio.gather(*(one(v) for v in values[i:i + 16]))
    assert not bad, bad[:10]
    assert statuses[401] > FUZZ_CASES // 2, statuses  # most are refused; none crashes
    assert set(statuses) <= {200, 400, 401, 431}, statuses
    async with aiohttp.ClientSession(headers=world.headers["own_infer"]) as session:
        async with session.get(url) as resp:  # and the server still answers a good key
            assert resp.status == 200


async def test_tritons_http_client_passes_the_key_as_a_header(world):
    import tritonclient.http as triton_http

    def check() -> None:
        client = triton_http.InferenceServerClient(f"127.0.0.1:{world.server.url.port}")
        own = {"Authorization": f"Bearer {world.tokens['own_infer']}"}
        other = {"Authorization": f"Bearer {world.tokens['other_infer']}"}
        try:
            assert client.is_model_ready(OWN_BOT, headers=own) is True
            inp = triton_http.InferInput("image_bytes", [1], "BYTES")
            inp.set_data_from_numpy(np.array([PNG], dtype=object))
            result = client.infer(OWN_BOT, [inp], headers=own)
            assert result.as_numpy("probabilities").shape == (1, 3)
            for headers, status in ((other, "404"), ({}, "401")):
                with pytest.raises(InferenceServerException) as error:
                    client.infer(OWN_BOT, [inp], headers=headers)
                assert str(error.value.status()) == status, error.value
            assert client.is_model_ready(OWN_BOT, headers=other) is False
            assert client.is_server_live()  # liveness is public
        finally:
            client.close()

    await asyncio.get_running_loop().run_in_executor(None, check)
