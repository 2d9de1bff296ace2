"""gRPC end to end: KServe v2 / Triton `GRPCInferenceService` and TF Serving's
`PredictionService` / `ModelService` on a real server on loopback (the session's real trunk, a
real store), driven by Triton's own `tritonclient.grpc` and by the stubs of
`tensorflow-serving-api`, unchanged. Answers are checked against `POST /classify` for the same
images on the same server.

The clients are synchronous (as users run them): they run in threads, the server in the test's
event loop. Images repeat on purpose within a test (the feature cache is on), so the trunk runs
a dozen rows in the whole module.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import socket

import aiohttp
import grpc
import numpy as np
import pytest
import tensorflow as tf
import tritonclient.grpc as triton
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from backbone import preprocess
from service.core.errors import ServiceError
from service.core.service import Service
from service.core.setting_fields import InvalidSettings
from service.core.settings import Settings
from service.transports.grpc.server import GrpcServer
from service.transports.http.app import LISTENERS, SERVICE
from tests.backbone.helpers import encode, pattern
from tests.support.fakes import GatedTrunk
from tests.support.polling import until
from tests.support.servers import make_settings

pytestmark = pytest.mark.timeout(300)

BOT = "charlie"  # 5 classes: top_k=5 on /classify is its whole distribution
N_CLASSES = 5
MIB = 1024 * 1024

_CLIENTS = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="test-grpc-client")


async def in_thread(fn, *args, **kwargs):
    """A blocking client call, off the event loop the server runs on."""
    return await asyncio.get_running_loop().run_in_executor(
        _CLIENTS, functools.partial(fn, *args, **kwargs))


@pytest.fixture
def make_grpc(make_client):
    """A real server (HTTP and gRPC on free loopback ports); returns (http client, gRPC address)
    once the gRPC server serves."""
    async def make(**overrides):
        client = await make_client(grpc_port=0, **overrides)
        server = client.app[LISTENERS][0]
        await asyncio.wait_for(server.wait_started(), 60)
        return client, f"127.0.0.1:{server.port}"

    return make


@pytest.fixture
def channels():
    """Opens gRPC channels and Triton clients; closes them after the test."""
    opened = []

    def channel(address):
        opened.append(grpc.insecure_channel(address))
        return opened[-1]

    def triton_client(address):
        opened.append(triton.InferenceServerClient(address))
        return opened[-1]

    yield channel, triton_client
    for c in opened:
        c.close()


async def classify_rest(client, images) -> np.ndarray:
    """float32 [N, 5]: /classify's scores for the images, in class index order."""
    form = aiohttp.FormData()
    for i, data in enumerate(images):
        form.add_field("image", data, filename=f"{i}.jpg", content_type="image/jpeg")
    resp = await client.post(f"/classify/{BOT}?top_k={N_CLASSES}", data=form)
    assert resp.status == 200, await resp.text()
    labels = client.app[SERVICE].store.get(BOT).labels
    out = np.zeros((len(images), N_CLASSES), np.float32)
    for row, result in zip(out, (await resp.json())["results"]):
        for p in result["predictions"]:
            row[labels.index(p["label"])] = p["score"]
    return out


def check_classification(strings, probabilities, labels, k):
    """Triton's "score:index:label" strings of one row against its probabilities."""
    parsed = [s.decode().split(":", 2) for s in strings]
    indices = [int(i) for _, i, _ in parsed]
    assert indices == list(np.argsort(-probabilities, kind="stable")[:k])
    np.testing.assert_allclose([float(v) for v, _, _ in parsed], probabilities[indices],
                               atol=1e-4)
    assert [label for _, _, label in parsed] == [labels[i] for i in indices]


def grpc_code(exc: BaseException) -> str:
    """'NOT_FOUND' from a tritonclient exception or a grpc.RpcError."""
    if isinstance(exc, InferenceServerException):
        return exc.status().removeprefix("StatusCode.")
    return exc.code().name


async def expect_error(code: str, fn, *args, text: str = "", **kwargs) -> BaseException:
    with pytest.raises((InferenceServerException, grpc.RpcError)) as info:
        await in_thread(fn, *args, **kwargs)
    exc = info.value
    message = exc.message() if isinstance(exc, InferenceServerException) else exc.details()
    assert grpc_code(exc) == code, message
    assert text in (message or ""), message
    return exc


def bytes_input(images, shape=None):
    inp = triton.InferInput("image_bytes", shape or [len(images)], "BYTES")
    inp.set_data_from_numpy(np.array(images, dtype=object).reshape(shape or [len(images)]))
    return inp


def fp32_input(arrays):
    inp = triton.InferInput("images", list(arrays.shape), "FP32")
    inp.set_data_from_numpy(arrays)
    return inp


def predict_request(tensor, name="image_bytes", model=BOT, **spec) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    request.inputs[name].CopyFrom(tensor)
    return request


# -- health, metadata, status ------------------------------------------------------------------

async def test_health_metadata_and_status(make_grpc, channels):
    _, address = await make_grpc()
    channel, triton_client = channels
    t = triton_client(address)
    assert await in_thread(t.is_server_live) is True
    assert await in_thread(t.is_server_ready) is True
    server = await in_thread(t.get_server_metadata)
    assert server.name == "multihead" and server.version
    assert {"binary_tensor_data", "classification"} <= set(server.extensions)
    model = await in_thread(t.get_model_metadata, BOT)
    assert model.name == BOT and list(model.versions) == ["1"]
    assert {(i.name, i.datatype, tuple(i.shape)) for i in model.inputs} == {
        ("image_bytes", "BYTES", (-1,)), ("images", "FP32", (-1, 299, 299, 3))}
    assert [(o.name, o.datatype, tuple(o.shape)) for o in model.outputs] == [
        ("probabilities", "FP32", (-1, N_CLASSES))]
    assert await in_thread(t.is_model_ready, BOT) is True
    assert await in_thread(t.is_model_ready, BOT, "1") is True
    await expect_error("NOT_FOUND", t.get_model_metadata, BOT, "2", text="active version 1")
    await expect_error("NOT_FOUND", t.get_model_metadata, "nobody", text="nobody")
    await expect_error("NOT_FOUND", t.is_model_ready, "nobody")
    await expect_error("INVALID_ARGUMENT", t.get_model_metadata, BOT, "latest")
    await expect_error("UNIMPLEMENTED", t.get_model_config, BOT)

    ch = channel(address)
    prediction = prediction_service_pb2_grpc.PredictionServiceStub(ch)
    meta_request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    meta_request.model_spec.name = BOT
    meta = await in_thread(prediction.GetModelMetadata, meta_request, timeout=30)
    assert meta.model_spec.name == BOT and meta.model_spec.version.value == 1
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert meta.metadata["signature_def"].Unpack(signatures)
    signature = signatures.signature_def["serving_default"]
    assert signature.method_name == "tensorflow/serving/predict"
    assert {name: tf.dtypes.as_dtype(i.dtype).name for name, i in signature.inputs.items()} == {
        "image_bytes": "string", "images": "float32"}
    assert [d.size for d in signature.outputs["probabilities"].tensor_shape.dim] == [-1, N_CLASSES]
    assert [d.size for d in signature.inputs["images"].tensor_shape.dim] == [-1, 299, 299, 3]
    meta_request.metadata_field[:] = ["nonsense"]
    await expect_error("INVALID_ARGUMENT", prediction.GetModelMetadata, meta_request, timeout=30)

    models = model_service_pb2_grpc.ModelServiceStub(ch)
    status_request = get_model_status_pb2.GetModelStatusRequest()
    status_request.model_spec.name = BOT
    status = await in_thread(models.GetModelStatus, status_request, timeout=30)
    (version,) = status.model_version_status
    assert version.version == 1
    assert version.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
    assert version.status.error_message == ""
    status_request.model_spec.version.value = 3
    await expect_error("NOT_FOUND", models.GetModelStatus, status_request, timeout=30)
    status_request.model_spec.name = "nobody"
    status_request.model_spec.ClearField("version")
    exc = await expect_error("NOT_FOUND", models.GetModelStatus, status_request, timeout=30)
    assert ("multihead-code", "unknown_bot") in exc.trailing_metadata()


# -- inference: Triton's client ----------------------------------------------------------------

async def test_triton_infer_equals_classify(make_grpc, channels, jpegs):
    client, address = await make_grpc()
    channel, triton_client = channels
    t = triton_client(address)
    images = jpegs[:2]
    labels = client.app[SERVICE].store.get(BOT).labels
    want = await classify_rest(client, images)  # the trunk runs here (later: feature cache)

    # BYTES in raw_input_contents (what set_data_from_numpy sends), every output by default.
    result = await in_thread(t.infer, BOT, [bytes_input(images)], request_id="7")
    got = result.as_numpy("probabilities")
    assert got.dtype == np.float32 and got.shape == (2, N_CLASSES)
    np.testing.assert_allclose(got, want, atol=1e-4)
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (BOT, "1", "7")

    # The classification extension, [N, 1] shaped input, version named.
    result = await in_thread(t.infer, BOT, [bytes_input(images, [2, 1])], model_version="1",
                             outputs=[triton.InferRequestedOutput("probabilities",
                                                                  class_count=3)])
    classes = result.as_numpy("probabilities")
    assert classes.shape == (2, 3)
    for row in range(2):
        check_classification(classes[row], want[row], labels, 3)

    # BYTES in the typed contents, through Triton's generated stub.
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel(address))
    typed = service_pb2.ModelInferRequest(model_name=BOT)
    typed.inputs.add(name="image_bytes", datatype="BYTES", shape=[2]).contents \
        .bytes_contents.extend(images)
    typed.outputs.add(name="probabilities")
    got = triton.InferResult(await in_thread(stub.ModelInfer, typed, timeout=60)) \
        .as_numpy("probabilities")
    np.testing.assert_allclose(got, want, atol=1e-4)

    # FP32 preprocessed images in typed fp32_contents (the trunk runs on these arrays) ...
    arrays = np.stack([preprocess(j) for j in images])  # [2, 299, 299, 3]
    typed = service_pb2.ModelInferRequest(model_name=BOT)
    typed.inputs.add(name="images", datatype="FP32", shape=arrays.shape).contents \
        .fp32_contents.extend(arrays.ravel())
    got = triton.InferResult(await in_thread(stub.ModelInfer, typed, timeout=60)) \
        .as_numpy("probabilities")
    np.testing.assert_allclose(got, want, atol=1e-4)
    # ... and raw, 4 images (4.3 MB: over gRPC's default 4 MB limit, within max_body_bytes).
    four = np.concatenate([arrays, arrays[::-1]])
    result = await in_thread(t.infer, BOT, [fp32_input(four)],
                             outputs=[triton.InferRequestedOutput("probabilities"),
                                      triton.InferRequestedOutput("probabilities",
                                                                  class_count=2)])
    want_four = np.concatenate([want, want[::-1]])
    np.testing.assert_allclose(result.as_numpy("probabilities"), want_four, atol=1e-4)
    response = result.get_response()
    assert [(o.datatype, list(o.shape)) for o in response.outputs] == [
        ("FP32", [4, N_CLASSES]), ("BYTES", [4, 2])]
    strings = triton.InferResult(service_pb2.ModelInferResponse(
        outputs=response.outputs[1:], raw_output_contents=response.raw_output_contents[1:]))
    for row, top in enumerate(strings.as_numpy("probabilities")):
        check_classification(top, want_four[row], labels, 2)


# -- inference: TF Serving stubs ---------------------------------------------------------------

async def test_tf_serving_predict_equals_classify(make_grpc, channels, jpegs):
    client, address = await make_grpc()
    channel, _ = channels
    images = jpegs[2:4]
    labels = client.app[SERVICE].store.get(BOT).labels
    want = await classify_rest(client, images)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel(address))

    strings = predict_request(tf.make_tensor_proto(images, dtype=tf.string),
                              signature_name="serving_default", version=1)
    response = await in_thread(stub.Predict, strings, timeout=60)
    assert (response.model_spec.name, response.model_spec.version.value,
            response.model_spec.signature_name) == (BOT, 1, "serving_default")
    assert set(response.outputs) == {"probabilities", "classes", "scores"}
    got = tf.make_ndarray(response.outputs["probabilities"])
    assert got.dtype == np.float32 and got.shape == (2, N_CLASSES)
    np.testing.assert_allclose(got, want, atol=1e-4)
    classes = tf.make_ndarray(response.outputs["classes"])
    scores = tf.make_ndarray(response.outputs["scores"])
    assert classes.shape == scores.shape == (2, 5)  # top_k_default 5, all of charlie's classes
    for row in range(2):
        order = np.argsort(-want[row], kind="stable")
        assert [c.decode() for c in classes[row]] == [labels[i] for i in order]
        np.testing.assert_allclose(scores[row], want[row][order], atol=1e-4)

    # top_k from the call's metadata (REST: ?top_k=), one output kept by output_filter.
    strings.output_filter.append("classes")
    response = await in_thread(stub.Predict, strings, timeout=60, metadata=[("top_k", "2")])
    assert set(response.outputs) == {"classes"}
    assert tf.make_ndarray(response.outputs["classes"]).shape == (2, 2)

    # DT_FLOAT preprocessed, in tensor_content (tf.make_tensor_proto) and in float_val.
    arrays = np.stack([preprocess(j) for j in images])
    floats = predict_request(tf.make_tensor_proto(arrays), name="images")
    got = tf.make_ndarray((await in_thread(stub.Predict, floats, timeout=60))
                          .outputs["probabilities"])
    np.testing.assert_allclose(got, want, atol=1e-4)
    one = tf.make_tensor_proto(arrays[1:])
    one.ClearField("tensor_content")
    one.float_val.extend(arrays[1].ravel())
    got = tf.make_ndarray((await in_thread(stub.Predict, predict_request(one), timeout=60))
                          .outputs["probabilities"])
    np.testing.assert_allclose(got, want[1:], atol=1e-4)


# -- errors ------------------------------------------------------------------------------------

async def test_errors_map_to_grpc_status_codes(make_grpc, channels):
    _, address = await make_grpc(max_body_bytes=MIB)
    channel, triton_client = channels
    t = triton_client(address)
    png = encode(pattern(3, size=(64, 48)), "PNG")
    probabilities = [triton.InferRequestedOutput("probabilities")]

    # Triton's client.
    await expect_error("NOT_FOUND", t.infer, "nobody", [bytes_input([png])], text="nobody")
    await expect_error("NOT_FOUND", t.infer, BOT, [bytes_input([png])], model_version="9")
    await expect_error("INVALID_ARGUMENT", t.infer, "../x", [bytes_input([png])])
    await expect_error("RESOURCE_EXHAUSTED", t.infer, BOT, [bytes_input([png] * 33)],
                       text="more than 32 images")  # max_images_per_request 32
    ints = triton.InferInput("image_bytes", [1], "INT32")
    ints.set_data_from_numpy(np.zeros(1, np.int32))
    await expect_error("INVALID_ARGUMENT", t.infer, BOT, [ints], text="datatype 'INT32'")
    await expect_error("INVALID_ARGUMENT", t.infer, BOT,
                       [fp32_input(np.zeros((1, 224, 224, 3), np.float32))],
                       text="shape [N, 299, 299, 3]")
    await expect_error("INVALID_ARGUMENT", t.infer, BOT, [bytes_input([b"not an image"])])
    await expect_error("INVALID_ARGUMENT", t.infer, BOT, [bytes_input([png])],
                       outputs=[triton.InferRequestedOutput("logits")], text="unknown output")
    await expect_error("INVALID_ARGUMENT", t.infer, BOT, [bytes_input([png])],
                       outputs=[triton.InferRequestedOutput("probabilities", class_count=-1)],
                       text="classification")
    big = np.zeros((1, 299, 299, 3), np.float32)  # 1.07 MB > max_body_bytes 1 MiB
    await expect_error("RESOURCE_EXHAUSTED", t.infer, BOT, [fp32_input(big)],
                       outputs=probabilities)

    # TF Serving's stubs (and what the codes carry in the trailing metadata).
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel(address))
    predict = functools.partial(stub.Predict, timeout=30)
    image = tf.make_tensor_proto([png], dtype=tf.string)
    exc = await expect_error("NOT_FOUND", predict, predict_request(image, model="nobody"))
    assert ("multihead-code", "unknown_bot") in exc.trailing_metadata()
    await expect_error("NOT_FOUND", predict, predict_request(image, version_label="stable"))
    await expect_error("INVALID_ARGUMENT", predict,
                       predict_request(tf.make_tensor_proto([[1, 2]], dtype=tf.int32)),
                       text="DT_INT32")
    await expect_error("INVALID_ARGUMENT", predict,
                       predict_request(tf.make_tensor_proto(np.zeros((1, 224, 224, 3),
                                                                     np.float32))),
                       text="[224, 224, 3]")
    exc = await expect_error("INVALID_ARGUMENT", predict,
                             predict_request(tf.make_tensor_proto([b"not an image"])))
    assert ("multihead-code", "invalid_image") in exc.trailing_metadata()
    await expect_error("INVALID_ARGUMENT", predict,
                       predict_request(image, signature_name="classify"), text="signature_name")
    await expect_error("INVALID_ARGUMENT", predict, predict_request(image),
                       metadata=[("top_k", "0")], text="top_k")
    await expect_error("RESOURCE_EXHAUSTED", predict, predict_request(tf.make_tensor_proto(big)))


async def test_not_ready_is_unavailable(make_grpc, channels, trunk):
    gated = GatedTrunk(trunk)
    _, address = await make_grpc(trunk_obj=gated, wait_ready=False, warmup=True)
    channel, triton_client = channels
    try:
        t = triton_client(address)
        assert await in_thread(t.is_server_live) is True
        assert await in_thread(t.is_server_ready) is False
        assert await in_thread(t.is_model_ready, BOT) is False
        png = encode(pattern(4, size=(64, 48)), "PNG")
        await expect_error("UNAVAILABLE", t.infer, BOT, [bytes_input([png])], text="loading")
        ch = channel(address)
        predict = prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict
        exc = await expect_error("UNAVAILABLE", predict, timeout=30, request=predict_request(
            tf.make_tensor_proto([png], dtype=tf.string)))
        assert ("multihead-code", "not_ready") in exc.trailing_metadata()
        status_request = get_model_status_pb2.GetModelStatusRequest()
        status_request.model_spec.name = BOT
        status = await in_thread(model_service_pb2_grpc.ModelServiceStub(ch).GetModelStatus,
                                 status_request, timeout=30)
        assert status.model_version_status[0].state == \
            get_model_status_pb2.ModelVersionStatus.LOADING
    finally:
        gated.gate.set()


# -- deadlines, admission, shutdown -------------------------------------------------------------

class CountingTrunk(GatedTrunk):
    """The gated real trunk, counting the rows it runs."""

    def __init__(self, trunk):
        super().__init__(trunk)
        self.rows = 0

    def features(self, images):
        self.rows += len(images)
        return super().features(images)


async def test_deadline_and_in_flight_budget(make_grpc, channels, trunk, jpegs):
    counting = CountingTrunk(trunk)
    jpeg, png = jpegs[4], encode(pattern(5, size=(32, 24)), "PNG")
    budget = len(jpeg) + len(png) + 1000  # room for one JPEG upload and a small image only
    assert len(png) + 1000 < len(jpeg)
    client, address = await make_grpc(trunk_obj=counting, max_inflight_bytes=budget,
                                      max_body_bytes=budget, max_ws_message_bytes=budget)
    service = client.app[SERVICE]
    channel, triton_client = channels
    t = triton_client(address)
    try:
        # An HTTP upload holds len(jpeg) of the budget while the trunk is busy with it.
        first = asyncio.create_task(client.post(f"/classify/{BOT}", data=jpeg,
                                                headers={"Content-Type": "image/jpeg"}))
        await in_thread(counting.entered.wait, 30)
        assert service.inflight.used_bytes == len(jpeg)

        # The same JPEG over gRPC does not fit what is left of the budget.
        await expect_error("RESOURCE_EXHAUSTED", t.infer, BOT, [bytes_input([jpeg])],
                           text="request bytes in flight")
        predict = prediction_service_pb2_grpc.PredictionServiceStub(channel(address)).Predict
        exc = await expect_error("RESOURCE_EXHAUSTED", predict, timeout=30,
                                 request=predict_request(tf.make_tensor_proto([jpeg])))
        assert ("retry-after", "1") in exc.trailing_metadata()

        # A small image fits, waits behind the busy trunk, and its deadline passes there.
        await expect_error("DEADLINE_EXCEEDED", t.infer, BOT, [bytes_input([png])],
                           client_timeout=0.5)
        # Withdrawn from the queue, its bytes given back: it never reaches the trunk.
        await until(lambda: service.engine.batcher.queue_depth == 0
                    and service.inflight.used_bytes == len(jpeg))
    finally:
        counting.gate.set()
    resp = await first
    assert resp.status == 200, await resp.text()
    assert counting.rows == 1  # the upload's row only
    assert service.inflight.used_bytes == 0
    metrics = await (await client.get("/metrics")).text()
    route = 'route="oip_infer"'  # the REST twin's endpoint name
    assert f'{route},status="503"}} 1.0' in metrics  # over budget
    assert f'{route},status="504"}} 1.0' in metrics  # deadline


async def test_shutdown_drains_calls_in_flight(make_grpc, channels, trunk, jpegs):
    gated = GatedTrunk(trunk)
    client, address = await make_grpc(trunk_obj=gated)
    _, triton_client = channels
    t, late = triton_client(address), triton_client(address)
    assert await in_thread(late.is_server_live)
    in_flight = asyncio.ensure_future(in_thread(t.infer, BOT, [bytes_input([jpegs[5]])]))
    closing = None
    try:
        await in_thread(gated.entered.wait, 30)
        closing = asyncio.create_task(client.close())  # aiohttp's shutdown: SIGTERM's path
        for _ in range(500):  # new calls are refused once the drain began
            try:
                await in_thread(late.is_server_live, client_timeout=5)
            except InferenceServerException as exc:
                assert grpc_code(exc) == "UNAVAILABLE", exc
                assert "shutting down" in exc.message()
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("calls were still accepted during shutdown")
        assert not in_flight.done() and not closing.done()
    finally:
        gated.gate.set()
        await asyncio.wait([in_flight], timeout=60)
        if closing is not None:
            await asyncio.wait([closing], timeout=60)
    result = in_flight.result()  # finished during the drain
    assert result.as_numpy("probabilities").shape == (1, N_CLASSES)
    assert closing.done() and closing.exception() is None


# -- settings and start-up -----------------------------------------------------------------------

def test_grpc_is_off_by_default_and_set_by_flag_or_environment():
    assert Settings().grpc_port is None
    assert Settings.from_env_and_args(None, {"MULTIHEAD_GRPC_PORT": "8001"}).grpc_port == 8001
    assert Settings.from_env_and_args(None, {"MULTIHEAD_GRPC_PORT": ""}).grpc_port is None
    for bad in (-1, 65536, 8080):  # 8080: the HTTP port
        with pytest.raises(InvalidSettings, match="grpc_port"):
            Settings(grpc_port=bad)


async def test_a_grpc_port_in_use_fails_the_start(store, trunk, tmp_path):
    with socket.socket() as taken:
        # As another gRPC server would hold it: SO_REUSEPORT lets a second one bind it too,
        # unless the server turns that off.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        service = Service(make_settings(tmp_path, grpc_port=taken.getsockname()[1]),
                          trunk=trunk, store=store)
        with pytest.raises(ServiceError, match="cannot listen for gRPC on 127.0.0.1:"):
            await GrpcServer(service).open()
        await service.close()


# -- one rule set: the RPCs are the REST endpoints' typed calls ---------------------------------

def test_every_rpc_is_counted_under_its_rest_twins_endpoint_name():
    from service.codecs.routes import ENDPOINTS
    from service.transports.grpc import kserve
    from service.transports.grpc import tfserving as grpc_tfserving

    names = {e.name for e in ENDPOINTS}
    per_model = {"ModelReady", "ModelMetadata", "ModelInfer", "Predict", "GetModelMetadata",
                 "GetModelStatus"}
    tables = {**kserve.ENDPOINT_NAMES, **grpc_tfserving.ENDPOINT_NAMES}
    assert set(tables) == per_model | {"ServerLive", "ServerReady", "ServerMetadata"}
    for rpc, name in tables.items():
        assert name in names, rpc
        assert (f"{name}_version" in names) == (rpc in per_model), rpc


def _rest_input(name, datatype, shape, values) -> dict:
    import base64

    data = [base64.b64encode(v).decode() if isinstance(v, bytes) else v for v in values]
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def _grpc_input(name, datatype, shape, values):
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype,
                                                            shape=shape)
    field = {"BYTES": "bytes_contents", "FP32": "fp32_contents"}.get(datatype, "int_contents")
    getattr(tensor.contents, field).extend(values)
    return tensor


FP32_IMAGE = [1, 299, 299, 3]


@pytest.mark.parametrize("inputs,outputs", [
    ([("x", "INT32", [1], [1])], None),
    ([("x", "FP32", [1, 224, 224, 3], [0.0])], None),
    ([("x", "FP32", FP32_IMAGE, [0.0] * 10)], None),
    ([("x", "BYTES", [2, 2], [b"a"] * 4)], None),
    ([("x", "BYTES", [3], [b"a", b"b"])], None),
    ([("x", "BYTES", [-1], [b"a"])], None),
    ([("x", "BYTES", [1], [b"a"]), ("y", "BYTES", [1], [b"b"])], None),
    ([], None),
    ([("x", "BYTES", [1], [b"a"])], [("logits", None)]),
    ([("x", "BYTES", [1], [b"a"])], [("probabilities", 0)]),
], ids=["datatype", "fp32-shape", "fp32-count", "bytes-rank", "bytes-count", "negative-dim",
        "two-inputs", "no-input", "unknown-output", "classification-0"])
def test_rest_and_grpc_refuse_the_same_input_with_the_same_message(inputs, outputs):
    """ModelInfer's request is read by the OIP codec's rules: the message REST gives."""
    import json

    from service.codecs import oip_tensors
    from service.core.errors import BadRequest, error_status, grpc_status
    from service.transports.grpc import kserve

    body = {"inputs": [_rest_input(*i) for i in inputs]}
    request = service_pb2.ModelInferRequest(model_name=BOT,
                                            inputs=[_grpc_input(*i) for i in inputs])
    for name, k in outputs or ():
        body.setdefault("outputs", []).append(
            {"name": name, **({"parameters": {"classification": k}} if k is not None else {})})
        out = request.outputs.add(name=name)
        if k is not None:
            out.parameters["classification"].int64_param = k
    with pytest.raises(BadRequest) as rest:
        oip_tensors.parse_infer_request(json.dumps(body).encode(), None)
    with pytest.raises(BadRequest) as rpc:
        kserve.infer_request(request)
    assert str(rpc.value) == str(rest.value)
    assert error_status(rpc.value)[0] == 400 and grpc_status(rpc.value)[0] == "INVALID_ARGUMENT"


def _predict(signature_name="", **tensors):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = BOT
    request.model_spec.signature_name = signature_name
    for name, tensor in tensors.items():
        request.inputs[name].CopyFrom(tensor)
    return request


_ONE = tf.make_tensor_proto([b"a"], dtype=tf.string)


@pytest.mark.parametrize("rest_body,request_", [
    ({"inputs": {"images": [np.zeros((224, 224, 3)).tolist()]}},
     _predict(images=tf.make_tensor_proto(np.zeros((1, 224, 224, 3), np.float32)))),
    ({"inputs": {"a": [{"b64": "YQ=="}], "b": [{"b64": "YQ=="}]}}, _predict(a=_ONE, b=_ONE)),
    ({"signature_name": "classify", "inputs": [{"b64": "YQ=="}]},
     _predict("classify", image_bytes=_ONE)),
    ({"inputs": {"images": [[1.0, 2.0]]}},
     _predict(images=tf.make_tensor_proto(np.zeros((1, 2), np.float32)))),
], ids=["float-shape", "two-inputs", "signature", "float-rank"])
def test_rest_and_grpc_refuse_the_same_predict_with_the_same_message(rest_body, request_):
    """Predict's request is read by the TF Serving codec's rules: the message REST gives."""
    from service.codecs import tfserving
    from service.core.errors import BadRequest
    from service.transports.grpc import tfserving as grpc_tfserving

    with pytest.raises(BadRequest) as rest:
        tfserving.parse_predict_request(rest_body)
    with pytest.raises(BadRequest) as rpc:
        grpc_tfserving.predict_images(request_)
    assert str(rpc.value) == str(rest.value)


DEADLINE_HEADER = "X-Multihead-Deadline-Ms"


async def test_deadlines_are_read_and_refused_alike_on_every_protocol(make_grpc, channels,
                                                                     jpegs):
    """A request's deadline (issue 32): `X-Multihead-Deadline-Ms` as an HTTP header or gRPC
    metadata, OIP's `parameters.deadline_ms` (REST and gRPC). A malformed one is 400
    invalid_deadline / INVALID_ARGUMENT; one that passes before the request's rows reach the
    trunk 504 deadline_exceeded / DEADLINE_EXCEEDED; one with time left is served."""
    import base64

    client, address = await make_grpc()
    _, triton_client = channels
    jpeg = jpegs[6]
    for value, status, code in (("abc", 400, "invalid_deadline"), ("0", 400, "invalid_deadline"),
                                ("-5", 400, "invalid_deadline"), ("nan", 400, "invalid_deadline"),
                                ("3600001", 400, "invalid_deadline"),
                                ("0.001", 504, "deadline_exceeded"), (" 30000 ", 200, None)):
        resp = await client.post(f"/classify/{BOT}", data=jpeg,
                                 headers={"Content-Type": "image/jpeg", DEADLINE_HEADER: value})
        assert resp.status == status, (value, await resp.text())
        if code is not None:
            assert (await resp.json())["code"] == code, value
    oip = {"inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [1],
                       "data": [base64.b64encode(jpeg).decode()]}]}
    for value, status, code in (("soon", 400, "invalid_deadline"), (True, 400, "invalid_deadline"),
                                (0, 400, "invalid_deadline"), (0.001, 504, "deadline_exceeded"),
                                (30000, 200, None)):
        resp = await client.post(f"/v2/models/{BOT}/infer",
                                 json={**oip, "parameters": {"deadline_ms": value}})
        assert resp.status == status, (value, await resp.text())
        if code is not None:
            assert (await resp.json())["code"] == code, value
    # The header and the parameter: the sooner wins.
    resp = await client.post(f"/v2/models/{BOT}/infer", headers={DEADLINE_HEADER: "0.001"},
                             json={**oip, "parameters": {"deadline_ms": 30000}})
    assert resp.status == 504, await resp.text()

    t = triton_client(address)
    await expect_error("INVALID_ARGUMENT", t.infer, BOT, [bytes_input([jpeg])],
                       headers={DEADLINE_HEADER.lower(): "abc"}, text="milliseconds")
    await expect_error("INVALID_ARGUMENT", t.infer, BOT, [bytes_input([jpeg])],
                       parameters={"deadline_ms": "soon"}, text="deadline_ms")
    await expect_error("DEADLINE_EXCEEDED", t.infer, BOT, [bytes_input([jpeg])],
                       parameters={"deadline_ms": 0.001})
    await expect_error("DEADLINE_EXCEEDED", t.infer, BOT, [bytes_input([jpeg])],
                       headers={DEADLINE_HEADER.lower(): "0.001"})
    result = await in_thread(t.infer, BOT, [bytes_input([jpeg])], client_timeout=30,
                             parameters={"deadline_ms": 30000})
    assert result.as_numpy("probabilities").shape == (1, N_CLASSES)


def test_the_grpc_calls_own_deadline_is_the_requests_deadline_header():
    """The call's time left is given as X-Multihead-Deadline-Ms, unless the client set that
    header itself; a call without a deadline has none."""
    from service.transports.grpc.common import metadata

    class Context:
        def __init__(self, remaining, given=()):
            self.remaining, self.given = remaining, given

        def invocation_metadata(self):
            return (("authorization", "Bearer x"), *self.given)

        def time_remaining(self):
            return self.remaining

    header = DEADLINE_HEADER.lower()
    assert metadata(Context(2.5))[header] == "2500.000"
    assert metadata(Context(2.5, ((header, "100"),)))[header] == "100"
    assert header not in metadata(Context(None))
    assert metadata(Context(-1.0))[header] == "0.001"  # passed: the smallest, refused as passed
