"""The OIP v2 codec as pure code: parse_infer_request, infer_response and the endpoints against a
fake Service (no server, no trunk). The same routes run end to end in test_interop.py."""
from __future__ import annotations

import base64
import functools
import json
import struct

import numpy as np
import pytest

from service.codecs import oip
from service.codecs.base import dispatch
from service.codecs.oip_tensors import (
    HEADER_LENGTH,
    InferRequest,
    OutputRequest,
    infer_response,
    infer_result,
    parse_infer_request,
)
from service.core.engine import Images, Prediction
from service.core.errors import BadRequest
from tests.support.fakes import FakeService, failed, loading, make_head, probabilities, req

SHAPE = [299, 299, 3]
PIXELS = 299 * 299 * 3


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body_of(obj: dict, binary: bytes = b"") -> tuple[bytes, str | None]:
    header = json.dumps(obj).encode()
    return header + binary, (str(len(header)) if binary else None)


def bytes_input(data=None, shape=None, params=None, **extra) -> dict:
    spec = {"name": "image_bytes", "datatype": "BYTES", **extra}
    spec["shape"] = shape if shape is not None else [len(data or [])]
    if data is not None:
        spec["data"] = data
    if params is not None:
        spec["parameters"] = params
    return spec


def request_of(*inputs, **extra) -> dict:
    return {"inputs": list(inputs), **extra}


def lengths(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def bad(body: bytes, header_length: str | None, *words: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_infer_request(body, header_length)
    for word in words:
        assert word in str(info.value), str(info.value)


# -- BYTES inputs ----------------------------------------------------------------------------

def test_bytes_input_as_json_base64_strings_and_b64_objects():
    body, _ = body_of(request_of(bytes_input([b64(b"one"), {"b64": b64(b"two")}])))
    parsed = parse_infer_request(body, None)
    assert parsed.images.encoded == [b"one", b"two"] and parsed.images.arrays is None
    assert parsed.id is None
    assert parsed.outputs == (OutputRequest(False, None),)


def test_bytes_input_of_shape_n_by_1_takes_nested_data():
    body, _ = body_of(request_of(bytes_input([[b64(b"a")], [b64(b"b")]], shape=[2, 1])))
    assert parse_infer_request(body, None).images.encoded == [b"a", b"b"]


@pytest.mark.parametrize("shape", [[2, 2], [1, 1, 1], [1, 2], []])
def test_bytes_input_shape_must_be_n_or_n_by_1(shape):
    body, _ = body_of(request_of(bytes_input([b64(b"a")], shape=shape)))
    bad(body, None, "one encoded image per element", str(shape))


def test_bytes_element_count_must_match_the_shape():
    body, _ = body_of(request_of(bytes_input([b64(b"a"), b64(b"b")], shape=[3])))
    bad(body, None, "has 2 elements, its shape [3] says 3")


@pytest.mark.parametrize("element", ["not base64!", 7, {"b64": "@@"}, {"b64": "QQ==", "x": 1}])
def test_bytes_elements_must_be_base64(element):
    body, _ = body_of(request_of(bytes_input([b64(b"ok"), element])))
    bad(body, None, "input 'image_bytes' element 1")


def test_binary_bytes_elements_are_split_by_their_lengths():
    blob = lengths(b"first", b"", b"third!")
    body, hl = body_of(request_of(bytes_input(shape=[3], params={"binary_data_size": len(blob)})),
                       blob)
    assert parse_infer_request(body, hl).images.encoded == [b"first", b"", b"third!"]


def test_binary_bytes_data_may_end_with_an_empty_element():
    blob = lengths(b"ok", b"")
    body, hl = body_of(request_of(bytes_input(shape=[2], params={"binary_data_size": len(blob)})),
                       blob)
    assert parse_infer_request(body, hl).images.encoded == [b"ok", b""]


def test_binary_bytes_lengths_are_unsigned():
    blob = struct.pack("<I", 0x80000000) + b"data"  # 2 GiB: as a signed int it would be < 0
    body, hl = body_of(request_of(bytes_input(shape=[1], params={"binary_data_size": len(blob)})),
                       blob)
    bad(body, hl, f"binary BYTES element of {0x80000000} bytes runs past")


def test_binary_bytes_element_running_past_its_data_is_refused():
    blob = struct.pack("<I", 10) + b"short"
    body, hl = body_of(request_of(bytes_input(shape=[1], params={"binary_data_size": len(blob)})),
                       blob)
    bad(body, hl, "binary BYTES element of 10 bytes runs past")


def test_binary_bytes_element_exactly_filling_its_data_is_accepted():
    blob = struct.pack("<I", 5) + b"exact"
    body, hl = body_of(request_of(bytes_input(shape=[1], params={"binary_data_size": len(blob)})),
                       blob)
    assert parse_infer_request(body, hl).images.encoded == [b"exact"]


@pytest.mark.parametrize("tail", [b"\x01", b"\x01\x00\x00"])
def test_binary_bytes_data_ending_inside_a_length_is_refused(tail):
    blob = lengths(b"ok") + tail
    body, hl = body_of(request_of(bytes_input(shape=[2], params={"binary_data_size": len(blob)})),
                       blob)
    bad(body, hl, "ends inside an element's 4-byte length")


def test_binary_bytes_element_count_must_match_the_shape():
    blob = lengths(b"a", b"b")
    body, hl = body_of(request_of(bytes_input(shape=[3], params={"binary_data_size": len(blob)})),
                       blob)
    bad(body, hl, "has 2 elements, its shape [3] says 3")


# -- FP32 inputs -----------------------------------------------------------------------------

def fp32_input(n: int, **extra) -> dict:
    return {"name": "images", "datatype": "FP32", "shape": [n, *SHAPE], **extra}


def test_fp32_input_as_little_endian_binary():
    values = np.linspace(-1, 1, 2 * PIXELS, dtype=np.float32)
    blob = values.astype("<f4").tobytes()
    body, hl = body_of(request_of(fp32_input(2, parameters={"binary_data_size": len(blob)})),
                       blob)
    images = parse_infer_request(body, hl).images
    assert images.encoded is None and images.arrays.shape == (2, *SHAPE)
    np.testing.assert_array_equal(images.arrays.ravel(), values)


def test_fp32_binary_size_must_be_four_bytes_per_value():
    blob = np.zeros(PIXELS - 1, "<f4").tobytes()
    body, hl = body_of(request_of(fp32_input(1, parameters={"binary_data_size": len(blob)})),
                       blob)
    bad(body, hl, f"binary_data_size is {len(blob)} bytes", f"needs {PIXELS * 4}")


FP32_VALUES = (np.arange(PIXELS, dtype=np.float32) % 4) / 4  # exact in float32 and in JSON


@functools.cache
def fp32_json_body(nested: bool) -> bytes:
    """Built once per process: the test then costs only the parse (mutmut runs it per mutant)."""
    data = [FP32_VALUES.reshape(SHAPE).tolist()] if nested else FP32_VALUES.tolist()
    return body_of(request_of(fp32_input(1, data=data)))[0]


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
def test_fp32_input_as_json_data(nested):
    images = parse_infer_request(fp32_json_body(nested), None).images
    assert images.arrays.dtype == np.float32 and images.arrays.shape == (1, *SHAPE)
    np.testing.assert_array_equal(images.arrays.ravel(), FP32_VALUES)


def test_fp32_json_value_count_must_match_the_shape():
    body, _ = body_of(request_of(fp32_input(1, data=[0.5] * 10)))
    bad(body, None, "has 10 values, its shape", f"says {PIXELS}")


def test_fp32_json_data_must_be_numbers():
    body, _ = body_of(request_of(fp32_input(1, data=["x"])))
    bad(body, None, "input 'images' data must be numbers")


@pytest.mark.parametrize("shape", [[1, 299, 299, 1], [1, 299, 299], [1, 3, 299, 299],
                                   [299, 299, 3]])
def test_fp32_shape_must_be_n_299_299_3(shape):
    blob = np.zeros(int(np.prod(shape)), "<f4").tobytes()
    spec = {"name": "images", "datatype": "FP32", "shape": shape,
            "parameters": {"binary_data_size": len(blob)}}
    body, hl = body_of(request_of(spec), blob)
    bad(body, hl, "an FP32 input is preprocessed images of shape [N, 299, 299, 3]", str(shape))


@pytest.mark.parametrize("datatype", ["INT8", None, "bytes"])
def test_other_datatypes_are_refused(datatype):
    body, _ = body_of(request_of({"name": "x", "datatype": datatype, "shape": [1],
                                  "data": [b64(b"a")]}))
    bad(body, None, f"has datatype {str(datatype)!r}", "send BYTES", "or FP32")


# -- the binary extension's framing ----------------------------------------------------------

# "0\x1f": str.strip() took the control character and int() refused what was left (a ValueError,
# found by the fuzz test).
@pytest.mark.parametrize("header_length", ["abc", "-1", "", "1.5", "99999", "0\x1f", "\x1c3"])
def test_header_length_must_be_a_length_within_the_body(header_length):
    body, _ = body_of(request_of(bytes_input([b64(b"a")])))
    bad(body, header_length, HEADER_LENGTH, f"at most the body's {len(body)}",
        f"got '{header_length}'")


def test_a_superscript_digit_header_length_is_a_bad_request():
    body, _ = body_of(request_of(bytes_input([b64(b"a")])))
    bad(body, "²", HEADER_LENGTH)


def test_header_length_equal_to_the_body_means_no_binary_data():
    body, _ = body_of(request_of(bytes_input([b64(b"a")])))
    assert parse_infer_request(body, str(len(body))).images.encoded == [b"a"]
    assert parse_infer_request(body, f" {len(body)}\t").images.encoded == [b"a"]


def test_header_length_splits_json_from_binary():
    body, hl = body_of(request_of(bytes_input(shape=[1], params={"binary_data_size": 5})),
                       lengths(b"x"))
    assert parse_infer_request(body, hl).images.encoded == [b"x"]
    bad(body, str(int(hl) - 1), "not valid JSON")


def test_binary_data_size_over_the_body_is_refused():
    body, hl = body_of(request_of(bytes_input(shape=[1], params={"binary_data_size": 6})),
                       lengths(b"x"))
    bad(body, hl, "binary_data_size 6 runs past the end of the body (5 bytes left")


def test_bytes_after_the_inputs_belong_to_nothing():
    body, hl = body_of(request_of(bytes_input(shape=[1], params={"binary_data_size": 5})),
                       lengths(b"x") + b"junk")
    bad(body, hl, "4 bytes after the JSON header belong to no input")


@pytest.mark.parametrize("size", [-1, 1.5, "5", True])
def test_binary_data_size_must_be_a_non_negative_integer(size):
    body, hl = body_of(request_of(bytes_input(shape=[1], params={"binary_data_size": size})),
                       lengths(b"x"))
    bad(body, hl, "binary_data_size must be a non-negative integer")


def test_binary_data_size_of_zero_is_an_empty_tensor():
    body, hl = body_of(request_of(bytes_input(shape=[0], params={"binary_data_size": 0})))
    assert parse_infer_request(body, hl).images.encoded == []


def test_data_and_binary_data_size_together_are_refused():
    body, hl = body_of(request_of(bytes_input([b64(b"x")], params={"binary_data_size": 5})),
                       lengths(b"x"))
    bad(body, hl, "has both 'data' and binary_data_size")


def test_an_input_needs_data_or_binary_data_size():
    body, _ = body_of(request_of(bytes_input(shape=[1])))
    bad(body, None, "has neither 'data' nor a binary_data_size parameter")


# -- the request's JSON ----------------------------------------------------------------------

@pytest.mark.parametrize("obj,words", [
    ([], ["must be a JSON object"]),
    ({"inputs": []}, ["exactly one input", "got 0 inputs"]),
    ({}, ["got no list of inputs"]),
    ({"inputs": {"name": "x"}}, ["got no list of inputs"]),
    ({"inputs": [1, 2]}, ["got 2 inputs"]),
    ({"inputs": [1]}, ["each input must be a JSON object"]),
    ({"inputs": [{"name": 1}]}, ["each input needs a string 'name'"]),
    ({"inputs": [{"name": "x", "shape": [-1]}]}, ["'shape' of non-negative integers"]),
    ({"inputs": [{"name": "x", "shape": [True]}]}, ["'shape' of non-negative integers"]),
    ({"inputs": [{"name": "x", "shape": "1"}]}, ["'shape' of non-negative integers"]),
    ({"inputs": [{"name": "x", "shape": [1.0]}]}, ["'shape' of non-negative integers"]),
    ({"inputs": [{"name": "x", "shape": [1], "parameters": []}]},
     ["input 'x' 'parameters' must be a JSON object"]),
    ({"id": 7, "inputs": []}, ["'id' must be a string"]),
    ({"parameters": 1, "inputs": []}, ["the request's 'parameters' must be a JSON object"]),
    ({"parameters": {"binary_data_output": 1}, "inputs": []},
     ["binary_data_output must be true or false"]),
], ids=lambda v: str(v)[:40])
def test_malformed_requests_are_bad_requests_naming_the_problem(obj, words):
    bad(json.dumps(obj).encode(), None, *words)


def test_invalid_json_is_a_bad_request():
    bad(b"{not json", None, "inference request is not valid JSON")


def test_long_input_names_are_cut_in_messages():
    body, _ = body_of(request_of({"name": "x" * 100, "datatype": "BYTES", "shape": [2],
                                  "data": [b64(b"a")]}))
    bad(body, None, f"input '{'x' * 64}' has 1 elements")


def test_request_id_is_kept():
    body, _ = body_of(request_of(bytes_input([b64(b"a")]), id="req-1"))
    assert parse_infer_request(body, None).id == "req-1"


# -- requested outputs -----------------------------------------------------------------------

def outputs_of(outputs, **extra):
    body, _ = body_of(request_of(bytes_input([b64(b"a")]), outputs=outputs, **extra))
    return parse_infer_request(body, None).outputs


def test_outputs_default_to_json_probabilities_or_the_request_default():
    body, _ = body_of(request_of(bytes_input([b64(b"a")]),
                                 parameters={"binary_data_output": True}))
    assert parse_infer_request(body, None).outputs == (OutputRequest(True, None),)


def test_outputs_take_binary_data_and_classification_parameters():
    assert outputs_of([
        {"name": "probabilities"},
        {"name": "probabilities", "parameters": {"binary_data": True}},
        {"name": "probabilities", "parameters": {"classification": 3, "binary_data": False}},
    ]) == (OutputRequest(False, None), OutputRequest(True, None), OutputRequest(False, 3))
    assert outputs_of([{"name": "probabilities", "parameters": {"binary_data": False}},
                       {"name": "probabilities"}],
                      parameters={"binary_data_output": True}) == (
        OutputRequest(False, None), OutputRequest(True, None))


@pytest.mark.parametrize("outputs,words", [
    ([], ["'outputs' must be a non-empty list when given"]),
    ({"name": "probabilities"}, ["'outputs' must be a non-empty list"]),
    ([{"name": "logits"}], ["unknown output 'logits'", "this model has 'probabilities'"]),
    (["probabilities"], ["unknown output 'probabilities'"]),
    ([{}], ["unknown output 'None'"]),
    ([{"name": "probabilities", "parameters": {"binary_data": "yes"}}],
     ["binary_data must be true or false"]),
    ([{"name": "probabilities", "parameters": {"classification": 0}}],
     ["classification must be an integer >= 1, got 0"]),
    ([{"name": "probabilities", "parameters": {"classification": True}}],
     ["classification must be an integer >= 1, got True"]),
    ([{"name": "probabilities", "parameters": {"classification": "2"}}],
     ["classification must be an integer >= 1, got 2"]),
    ([{"name": "probabilities", "parameters": 5}], ["output 'probabilities' 'parameters'"]),
], ids=lambda v: str(v)[:40])
def test_malformed_outputs(outputs, words):
    body, _ = body_of(request_of(bytes_input([b64(b"a")]), outputs=outputs))
    bad(body, None, *words)


def test_classification_of_one_is_accepted():
    assert outputs_of([{"name": "probabilities", "parameters": {"classification": 1}}]) == (
        OutputRequest(False, 1),)


# -- infer_response --------------------------------------------------------------------------

HEAD = make_head("acme", 4, ["cat", "dog", "owl"])
ROWS = [np.array([0.2, 0.5, 0.3], np.float32), np.array([0.6, 0.1, 0.3], np.float32)]
PREDICTIONS = [Prediction("acme", 4, [], p) for p in ROWS]


def respond(*outputs: OutputRequest, request_id: str | None = None):
    request = InferRequest(request_id, Images(encoded=[b"a", b"b"]), outputs)
    header, blobs = infer_response(infer_result(HEAD, request, PREDICTIONS))
    return json.loads(header), blobs


def test_response_with_json_probabilities():
    body, blobs = respond(OutputRequest(False, None))
    assert blobs == b""
    assert body == {"model_name": "acme", "model_version": "4", "outputs": [
        {"name": "probabilities", "datatype": "FP32", "shape": [2, 3],
         "data": np.concatenate(ROWS).tolist()}]}
    assert list(body) == ["model_name", "model_version", "outputs"]


def test_response_echoes_the_request_id():
    body, _ = respond(OutputRequest(False, None), request_id="r7")
    assert body["id"] == "r7" and list(body) == ["model_name", "model_version", "id", "outputs"]


def test_response_with_binary_probabilities():
    body, blobs = respond(OutputRequest(True, None))
    assert body["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [2, 3],
                                "parameters": {"binary_data_size": 24}}]
    assert blobs == np.stack(ROWS).astype("<f4").tobytes()


def test_response_with_classification_strings():
    body, blobs = respond(OutputRequest(False, 2))
    assert blobs == b""
    assert body["outputs"] == [{"name": "probabilities", "datatype": "BYTES", "shape": [2, 2],
                                "data": ["0.5:1:dog", "0.3:2:owl", "0.6:0:cat", "0.3:2:owl"]}]


def test_classification_is_clipped_to_the_class_count():
    body, _ = respond(OutputRequest(False, 10))
    out = body["outputs"][0]
    assert out["shape"] == [2, 3] and out["data"][:3] == ["0.5:1:dog", "0.3:2:owl", "0.2:0:cat"]


def test_response_with_binary_classification_strings_and_several_outputs_in_order():
    body, blobs = respond(OutputRequest(True, 1), OutputRequest(False, None),
                          OutputRequest(True, None))
    strings = lengths(b"0.5:1:dog", b"0.6:0:cat")
    floats = np.stack(ROWS).astype("<f4").tobytes()
    assert [o.get("parameters") for o in body["outputs"]] == [
        {"binary_data_size": len(strings)}, None, {"binary_data_size": len(floats)}]
    assert body["outputs"][0]["shape"] == [2, 1] and "data" not in body["outputs"][0]
    assert body["outputs"][1]["data"] == np.concatenate(ROWS).tolist()
    assert blobs == strings + floats


# -- endpoints against a fake Service --------------------------------------------------------

def endpoint(name: str):
    (found,) = [e for e in oip.ENDPOINTS if e.name == name]
    return found


async def call(service, name: str, **kwargs):
    e = endpoint(name)
    reply = await dispatch(service, e, req(e.method, e.path, **kwargs))
    return reply.status, reply


def test_routes():
    assert [(e.method, e.path, e.name) for e in oip.ENDPOINTS] == [
        ("GET", "/v2", "oip_server_metadata"),
        ("GET", "/v2/health/live", "oip_server_live"),
        ("GET", "/v2/health/ready", "oip_server_ready"),
        ("GET", "/v2/models/{bot_id:[^{}/:]+}", "oip_model_metadata"),
        ("GET", "/v2/models/{bot_id:[^{}/:]+}/ready", "oip_model_ready"),
        ("POST", "/v2/models/{bot_id:[^{}/:]+}/infer", "oip_infer"),
        ("GET", "/v2/models/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}",
         "oip_model_metadata_version"),
        ("GET", "/v2/models/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}/ready",
         "oip_model_ready_version"),
        ("POST", "/v2/models/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}/infer",
         "oip_infer_version"),
    ]
    assert not any(e.admin for e in oip.ENDPOINTS)
    # ENDPOINTS is built at import time; called again here, a mutant of the builder runs.
    assert oip._model_endpoints() == oip.ENDPOINTS[3:]
    assert [e.handle for e in oip.ENDPOINTS] == [
        oip.server_metadata, oip.server_live, oip.server_ready,
        *[oip.model_metadata, oip.model_ready, oip.infer] * 2]
    assert all(e.summary.startswith("OIP v2 ") for e in oip.ENDPOINTS)


def test_server_version_is_the_installed_package_version(monkeypatch):
    from importlib import metadata

    assert oip.server_version() == metadata.version("multihead")

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert oip.server_version() == "unknown"


async def test_server_metadata_and_liveness():
    status, reply = await call(FakeService(readiness=loading()), "oip_server_metadata")
    assert status == 200 and json.loads(reply.body) == {
        "name": "multihead", "version": oip.server_version(),
        "extensions": ["binary_tensor_data", "classification"]}
    status, reply = await call(FakeService(readiness=failed()), "oip_server_live")
    assert (status, json.loads(reply.body)) == (200, {"live": True})


@pytest.mark.parametrize("readiness,status", [(None, 200), (loading(), 503), (failed(), 503)])
async def test_server_readiness(readiness, status):
    service = FakeService() if readiness is None else FakeService(readiness=readiness)
    got, reply = await call(service, "oip_server_ready")
    assert (got, json.loads(reply.body)) == (status, {"ready": status == 200})


def service_with_acme(**kwargs) -> FakeService:
    return FakeService(heads={"acme": HEAD}, **kwargs)


async def test_model_metadata():
    status, reply = await call(service_with_acme(), "oip_model_metadata",
                               params={"bot_id": "acme"})
    assert status == 200 and json.loads(reply.body) == {
        "name": "acme", "versions": ["4"], "platform": "multihead_inception_v4",
        "inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [-1]},
                   {"name": "images", "datatype": "FP32", "shape": [-1, 299, 299, 3]}],
        "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]}]}


@pytest.mark.parametrize("params,status,code", [
    ({"bot_id": "acme", "version": "4"}, 200, None),
    ({"bot_id": "acme", "version": "3"}, 404, "unknown_version"),
    ({"bot_id": "acme", "version": "x"}, 400, "bad_request"),
    ({"bot_id": "nobody"}, 404, "unknown_bot"),
])
async def test_model_metadata_of_a_version(params, status, code):
    got, reply = await call(service_with_acme(), "oip_model_metadata_version", params=params)
    assert got == status
    if code:
        assert json.loads(reply.body)["code"] == code


@pytest.mark.parametrize("service,params,status,ready", [
    (service_with_acme(), {"bot_id": "acme"}, 200, True),
    (service_with_acme(), {"bot_id": "acme", "version": "4"}, 200, True),
    (service_with_acme(readiness=loading()), {"bot_id": "acme"}, 503, False),
    (service_with_acme(readiness=failed()), {"bot_id": "acme"}, 503, False),
    (service_with_acme(broken={"acme"}), {"bot_id": "acme"}, 503, False),
], ids=["ready", "version", "loading", "failed", "head-unavailable"])
async def test_model_readiness(service, params, status, ready):
    got, reply = await call(service, "oip_model_ready", params=params)
    assert (got, json.loads(reply.body)) == (status, {"name": "acme", "ready": ready})


@pytest.mark.parametrize("params,status,code", [
    ({"bot_id": "nobody"}, 404, "unknown_bot"),
    ({"bot_id": "acme", "version": "5"}, 404, "unknown_version"),
])
async def test_model_readiness_of_an_unknown_model_is_404(params, status, code):
    got, reply = await call(service_with_acme(), "oip_model_ready", params=params)
    assert (got, json.loads(reply.body)["code"]) == (status, code)


async def test_infer_json_answers_every_image_under_the_bot():
    service = service_with_acme()
    body, _ = body_of(request_of(bytes_input([b64(b"a"), b64(b"b")]), id="q"))
    status, reply = await call(service, "oip_infer", params={"bot_id": "acme"}, body=body)
    assert status == 200 and reply.content_type == "application/json" and not reply.headers
    assert json.loads(reply.body) == {
        "model_name": "acme", "model_version": "4", "id": "q",
        "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [2, 3],
                     "data": np.concatenate([probabilities(0, 0, 3),
                                             probabilities(1, 0, 3)]).tolist()}]}
    ((images, bots, top_k),) = service.classified
    assert images.encoded == [b"a", b"b"] and bots == ["acme"] and top_k == 1
    assert service.blocking == ["parse_infer_request"]


async def test_infer_binary_answer_carries_the_header_length():
    blob = lengths(b"a")
    body, hl = body_of(request_of(bytes_input(shape=[1], params={"binary_data_size": len(blob)}),
                                  parameters={"binary_data_output": True}), blob)
    status, reply = await call(service_with_acme(), "oip_infer_version",
                               params={"bot_id": "acme", "version": "4"},
                               headers={HEADER_LENGTH: hl}, body=body)
    assert status == 200 and reply.content_type == "application/octet-stream"
    split = int(reply.headers[HEADER_LENGTH])
    header = json.loads(reply.body[:split])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert reply.body[split:] == probabilities(0, 0, 3).astype("<f4").tobytes()


@pytest.mark.parametrize("service,params,status,code", [
    (service_with_acme(readiness=loading()), {"bot_id": "acme"}, 503, "not_ready"),
    (service_with_acme(), {"bot_id": "nobody"}, 404, "unknown_bot"),
    (service_with_acme(), {"bot_id": "acme", "version": "1"}, 404, "unknown_version"),
], ids=["loading", "unknown-bot", "other-version"])
async def test_infer_refuses_before_reading_the_body(service, params, status, code):
    def explode():
        raise AssertionError("body read")

    e = endpoint("oip_infer")
    request = req("POST", e.path, params=params)
    request = type(request)(request.method, request.path, request.params, {}, {}, explode)
    reply = await dispatch(service, e, request)
    assert (reply.status, json.loads(reply.body)["code"]) == (status, code)
    assert not service.classified


async def test_infer_with_a_malformed_body_is_400():
    status, reply = await call(service_with_acme(), "oip_infer", params={"bot_id": "acme"},
                               body=b"[]")
    assert (status, json.loads(reply.body)) == (400, {
        "error": "inference request must be a JSON object", "code": "bad_request"})



# -- exact messages and fields the mutation run showed unchecked -----------------------------

@pytest.mark.parametrize("obj,binary,message", [
    ({"inputs": [1]}, b"", "each input must be a JSON object"),
    ({"inputs": [{"name": None}]}, b"", "each input needs a string 'name'"),
    ({"id": 1, "inputs": []}, b"", "'id' must be a string"),
    ({"parameters": {"binary_data_output": "no"}, "inputs": []}, b"",
     "binary_data_output must be true or false"),
    (request_of(bytes_input([b64(b"a")]), outputs=[]), b"",
     "'outputs' must be a non-empty list when given"),
    (request_of(bytes_input([b64(b"a")]), outputs=[
        {"name": "probabilities", "parameters": {"binary_data": 1}}]), b"",
     "binary_data must be true or false"),
    (request_of(bytes_input(shape=[1], params={"binary_data_size": 5})), lengths(b"x") + b"junk",
     "4 bytes after the JSON header belong to no input's binary_data_size"),
    (request_of(bytes_input(shape=[1], params={"binary_data_size": 6})),
     struct.pack("<I", 9) + b"ab",
     "input 'image_bytes': binary BYTES element of 9 bytes runs past the input's "
     "binary_data_size"),
    (request_of({"name": "x", "datatype": "Q" * 40, "shape": [1], "data": []}), b"",
     f"input 'x' has datatype {'Q' * 16!r}: send BYTES (encoded images, shape [N]) or FP32 "
     f"(preprocessed, shape [N, 299, 299, 3])"),
    (request_of(bytes_input([b64(b"a")]), outputs=[{"name": "n" * 80}]), b"",
     f"unknown output {'n' * 64!r}: this model has 'probabilities'"),
    (request_of(bytes_input([b64(b"a")]), outputs=[
        {"name": "probabilities", "parameters": {"classification": "9" * 40}}]), b"",
     f"classification must be an integer >= 1, got {'9' * 32}"),
], ids=lambda v: (v.hex() or "no-binary") if isinstance(v, bytes) else str(v)[:30])
def test_exact_messages(obj, binary, message):
    body, hl = body_of(obj, binary)
    with pytest.raises(BadRequest) as info:
        parse_infer_request(body, hl)
    assert str(info.value) == message


def test_a_long_header_length_is_cut_in_the_message():
    with pytest.raises(BadRequest) as info:
        parse_infer_request(b"{}", "9" * 40)
    assert str(info.value).endswith(f"got '{'9' * 32}'")


def test_id_and_images_are_kept_with_requested_outputs():
    body, _ = body_of(request_of(bytes_input([b64(b"a")]), id="r",
                                 outputs=[{"name": "probabilities"}]))
    parsed = parse_infer_request(body, None)
    assert (parsed.id, parsed.images.encoded) == ("r", [b"a"])
