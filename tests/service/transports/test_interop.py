"""The interop routes end to end: Open Inference Protocol v2 (with Triton's binary tensor and
classification extensions) and TF Serving REST, on a real server around the real trunk.

Answers are checked against the native route and against the trunk + head applied directly.
"""
from __future__ import annotations

import asyncio
import base64
import json
import struct

import numpy as np
import pytest

from backbone import preprocess
from service.codecs.oip_tensors import HEADER_LENGTH
from tests.support.builders import random_head
from tests.support.fakes import GatedTrunk

pytestmark = pytest.mark.timeout(300)

BOT = "charlie"  # 5 classes


def reference(store, jpeg, features_of, bot_id=BOT):
    """float32 [n]: the head applied directly to the trunk's features of `jpeg`."""
    return store.get(bot_id).probabilities(features_of[jpeg][None])[0]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bytes_tensor(elements) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def binary_request(header: dict, *blobs: bytes) -> tuple[bytes, dict]:
    head = json.dumps(header).encode()
    return head + b"".join(blobs), {HEADER_LENGTH: str(len(head)),
                                    "Content-Type": "application/octet-stream"}


async def read_binary_response(resp) -> tuple[dict, list[bytes]]:
    """The JSON header and each output's binary data, in output order."""
    body = await resp.read()
    split = int(resp.headers[HEADER_LENGTH])
    header, offset, blobs = json.loads(body[:split]), split, []
    for output in header["outputs"]:
        size = output["parameters"]["binary_data_size"]
        blobs.append(body[offset:offset + size])
        offset += size
    assert offset == len(body)
    return header, blobs


def parse_bytes_tensor(raw: bytes) -> list[str]:
    out, offset = [], 0
    while offset < len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        out.append(raw[offset + 4:offset + 4 + size].decode())
        offset += 4 + size
    return out


def check_classification(strings, probabilities, labels, k):
    """Triton's "score:index:label" strings against the full probability row."""
    assert len(strings) == k
    parsed = [s.split(":", 2) for s in strings]
    indices = [int(i) for _, i, _ in parsed]
    np.testing.assert_allclose([float(v) for v, _, _ in parsed], probabilities[indices],
                               atol=1e-6)
    assert [label for _, _, label in parsed] == [labels[i] for i in indices]
    assert indices == list(np.argsort(-probabilities, kind="stable")[:k])


def oip_bytes_input(jpegs):
    return {"name": "image_bytes", "datatype": "BYTES", "shape": [len(jpegs)],
            "data": [b64(j) for j in jpegs]}


# -- metadata, health, versions --------------------------------------------------------------

async def test_server_metadata_and_health(make_client):
    client = await make_client()
    body = await (await client.get("/v2")).json()
    assert body["name"] == "multihead" and body["version"]
    assert {"binary_tensor_data", "classification"} <= set(body["extensions"])
    live = await client.get("/v2/health/live")
    assert live.status == 200 and (await live.json())["live"] is True
    ready = await client.get("/v2/health/ready")
    assert ready.status == 200 and (await ready.json())["ready"] is True


@pytest.mark.parametrize("path,status,check", [
    (f"/v2/models/{BOT}", 200, lambda b: b["name"] == BOT and b["versions"] == ["1"]
     and b["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 5]}]
     and {(i["name"], i["datatype"], tuple(i["shape"])) for i in b["inputs"]}
     == {("image_bytes", "BYTES", (-1,)), ("images", "FP32", (-1, 299, 299, 3))}),
    (f"/v2/models/{BOT}/versions/1", 200, lambda b: b["name"] == BOT),
    (f"/v2/models/{BOT}/ready", 200, lambda b: b == {"name": BOT, "ready": True}),
    (f"/v2/models/{BOT}/versions/1/ready", 200, lambda b: b["ready"] is True),
    (f"/v2/models/{BOT}/versions/2", 404, lambda b: b["code"] == "unknown_version"
     and "active version 1" in b["error"]),
    (f"/v2/models/{BOT}/versions/latest", 400, lambda b: b["code"] == "bad_request"),
    ("/v2/models/nobody", 404, lambda b: b["code"] == "unknown_bot" and "nobody" in b["error"]),
    ("/v2/models/nobody/ready", 404, lambda b: b["code"] == "unknown_bot"),
    (f"/v1/models/{BOT}", 200, lambda b: b == {"model_version_status": [
        {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK",
                                                          "error_message": ""}}]}),
    (f"/v1/models/{BOT}/versions/1", 200, lambda b: b["model_version_status"][0]["version"] == "1"),
    (f"/v1/models/{BOT}/versions/3", 404, lambda b: b["code"] == "unknown_version"),
    (f"/v1/models/{BOT}/metadata", 200, lambda b: b["model_spec"]["version"] == "1"
     and b["metadata"]["signature_def"]["signature_def"]["serving_default"]["outputs"]
     ["probabilities"]["tensor_shape"]["dim"][1]["size"] == "5"),
    ("/v1/models/nobody", 404, lambda b: b["code"] == "unknown_bot" and b["error"]),
])
async def test_metadata_routes(make_client, path, status, check):
    client = await make_client()
    resp = await client.get(path)
    body = await resp.json()
    assert resp.status == status, body
    assert check(body), body


async def test_readiness_follows_the_trunk(make_client, trunk):
    gated = GatedTrunk(trunk)
    client = await make_client(trunk_obj=gated, wait_ready=False, warmup=True, max_batch_size=1)
    assert (await client.get("/v2/health/live")).status == 200
    ready = await client.get("/v2/health/ready")
    assert ready.status == 503 and (await ready.json())["ready"] is False
    model = await client.get(f"/v2/models/{BOT}/ready")
    assert model.status == 503 and (await model.json())["ready"] is False
    status = await (await client.get(f"/v1/models/{BOT}")).json()
    assert status["model_version_status"][0]["state"] == "LOADING"
    early = await client.post(f"/v2/models/{BOT}/infer", json={"inputs": []})
    assert early.status == 503 and (await early.json())["code"] == "not_ready"
    gated.gate.set()
    for _ in range(500):
        if (await client.get("/v2/health/ready")).status == 200:
            break
        await asyncio.sleep(0.02)
    assert (await client.get(f"/v2/models/{BOT}/ready")).status == 200


# -- inference -------------------------------------------------------------------------------

async def test_infer_json_and_binary_equal_the_native_route(make_client, store, jpegs,
                                                            features_of):
    client = await make_client()
    images = jpegs[:2]
    labels = store.get(BOT).labels
    want = np.stack([reference(store, j, features_of) for j in images])  # [2, 5]

    native = []
    for jpeg in images:
        resp = await client.post(f"/classify/{BOT}?top_k=3", data=jpeg,
                                 headers={"Content-Type": "image/jpeg"})
        native.append((await resp.json())["results"][0]["predictions"])

    # JSON: base64 strings in, every output as JSON.
    resp = await client.post(f"/v2/models/{BOT}/infer", json={
        "id": "42", "inputs": [oip_bytes_input(images)],
        "outputs": [{"name": "probabilities"},
                    {"name": "probabilities", "parameters": {"classification": 3}}]})
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/json" and HEADER_LENGTH not in resp.headers
    body = await resp.json()
    assert body["id"] == "42" and body["model_name"] == BOT and body["model_version"] == "1"
    plain, classes = body["outputs"]
    assert plain["datatype"] == "FP32" and plain["shape"] == [2, 5]
    got_json = np.array(plain["data"], np.float32).reshape(2, 5)
    np.testing.assert_allclose(got_json, want, atol=1e-4)
    assert classes["datatype"] == "BYTES" and classes["shape"] == [2, 3]
    for row in range(2):
        check_classification(classes["data"][row * 3:row * 3 + 3], got_json[row], labels, 3)
        top = [s.split(":", 2) for s in classes["data"][row * 3:row * 3 + 3]]
        assert [t[2] for t in top] == [p["label"] for p in native[row]]
        np.testing.assert_allclose([float(t[0]) for t in top],
                                   [p["score"] for p in native[row]], atol=1e-4)

    # Binary extension both ways: raw image bytes in, raw tensors out.
    data, headers = binary_request({
        "inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [2, 1],
                    "parameters": {"binary_data_size": len(bytes_tensor(images))}}],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}},
                    {"name": "probabilities",
                     "parameters": {"binary_data": True, "classification": 9}}]},
        bytes_tensor(images))
    resp = await client.post(f"/v2/models/{BOT}/infer", data=data, headers=headers)
    assert resp.status == 200, await resp.text()
    header, (raw_probabilities, raw_classes) = await read_binary_response(resp)
    assert "id" not in header and header["outputs"][1]["shape"] == [2, 5]  # 9 capped at n
    got_binary = np.frombuffer(raw_probabilities, "<f4").reshape(2, 5)
    np.testing.assert_allclose(got_binary, got_json, atol=1e-6)
    strings = parse_bytes_tensor(raw_classes)
    for row in range(2):
        check_classification(strings[row * 5:row * 5 + 5], got_binary[row], labels, 5)

    # binary_data_output on the request: every output binary, no outputs listed.
    data, headers = binary_request({"inputs": [oip_bytes_input(images[:1])],
                                    "parameters": {"binary_data_output": True}})
    resp = await client.post(f"/v2/models/{BOT}/versions/1/infer", data=data, headers=headers)
    header, (raw,) = await read_binary_response(resp)
    np.testing.assert_allclose(np.frombuffer(raw, "<f4"), got_json[0], atol=1e-6)


async def test_fp32_input_equals_the_bytes_input(make_client, store, jpegs, features_of):
    client = await make_client()
    jpeg = jpegs[2]
    array = preprocess(jpeg)[None]  # [1, 299, 299, 3]
    want = reference(store, jpeg, features_of)

    async def infer(**kwargs):
        resp = await client.post(f"/v2/models/{BOT}/infer", **kwargs)
        assert resp.status == 200, await resp.text()
        return resp

    from_bytes = await (await infer(json={"inputs": [oip_bytes_input([jpeg])]})).json()
    by_bytes = np.array(from_bytes["outputs"][0]["data"], np.float32)

    data, headers = binary_request({
        "inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 299, 299, 3],
                    "parameters": {"binary_data_size": array.nbytes}}]},
        array.astype("<f4").tobytes())
    by_binary = np.array((await (await infer(data=data, headers=headers)).json())
                         ["outputs"][0]["data"], np.float32)

    flat = {"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 299, 299, 3],
                        "data": array.ravel().tolist()}]}
    by_json = np.array((await (await infer(json=flat)).json())["outputs"][0]["data"],
                       np.float32)

    for got in (by_bytes, by_binary, by_json):
        np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_allclose(by_binary, by_bytes, atol=1e-5)


async def test_tf_serving_predict_row_and_columnar(make_client, store, jpegs, features_of):
    client = await make_client()
    images = jpegs[3:5]
    labels = store.get(BOT).labels
    want = np.stack([reference(store, j, features_of) for j in images])

    def check(rows):
        assert len(rows) == 2
        for row, p in zip(rows, want):
            np.testing.assert_allclose(row["probabilities"], p, atol=1e-4)
            order = np.argsort(-p, kind="stable")[:2]
            assert row["classes"] == [labels[i] for i in order]
            np.testing.assert_allclose(row["scores"], p[order], atol=1e-4)

    resp = await client.post(f"/v1/models/{BOT}:predict?top_k=2", json={
        "instances": [{"b64": b64(images[0])}, {"image_bytes": {"b64": b64(images[1])}}]})
    assert resp.status == 200, await resp.text()
    check((await resp.json())["predictions"])

    resp = await client.post(f"/v1/models/{BOT}/versions/1:predict?top_k=2", json={
        "signature_name": "serving_default",
        "inputs": {"image_bytes": [{"b64": b64(j)} for j in images]}})
    assert resp.status == 200, await resp.text()
    outputs = (await resp.json())["outputs"]
    check([{name: outputs[name][i] for name in outputs} for i in range(2)])

    # A preprocessed image as a nested list, in row format.
    resp = await client.post(f"/v1/models/{BOT}:predict", json={
        "instances": [{"images": preprocess(images[0]).tolist()}]})
    assert resp.status == 200, await resp.text()
    np.testing.assert_allclose((await resp.json())["predictions"][0]["probabilities"], want[0],
                               atol=1e-4)


async def test_versioned_routes_serve_only_the_active_version(make_client, store, jpegs):
    client = await make_client()
    store.register(BOT, *random_head(4, seed=77))  # version 2 becomes the active one
    request = {"inputs": [oip_bytes_input(jpegs[:1])]}
    old = await client.post(f"/v2/models/{BOT}/versions/1/infer", json=request)
    assert old.status == 404 and (await old.json())["code"] == "unknown_version"
    new = await client.post(f"/v2/models/{BOT}/versions/2/infer", json=request)
    body = await new.json()
    assert new.status == 200 and body["model_version"] == "2"
    assert body["outputs"][0]["shape"] == [1, 4]
    old = await client.post(f"/v1/models/{BOT}/versions/1:predict",
                            json={"instances": [{"b64": b64(jpegs[0])}]})
    assert old.status == 404 and (await old.json())["code"] == "unknown_version"
    meta = await (await client.get(f"/v2/models/{BOT}")).json()
    assert meta["versions"] == ["2"] and meta["outputs"][0]["shape"] == [-1, 4]


# -- errors ----------------------------------------------------------------------------------

def _fp32_binary(value: float):
    array = np.full((1, 299, 299, 3), value, "<f4")
    return binary_request({"inputs": [{"name": "images", "datatype": "FP32",
                                       "shape": [1, 299, 299, 3],
                                       "parameters": {"binary_data_size": array.nbytes}}]},
                          array.tobytes())


def _bytes_binary(header_extra=b"", size_delta=0, declared=None):
    data = bytes_tensor([b"abc"])
    head = json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": len(data) + size_delta}}]}
                      ).encode()
    return head + data + header_extra, {HEADER_LENGTH: str(declared or len(head))}


INFER = f"/v2/models/{BOT}/infer"
PREDICT = f"/v1/models/{BOT}:predict"
PNG_B64 = b64(b"\x89PNG\r\n\x1a\n not really")


@pytest.mark.parametrize("path,request_kwargs,status,code,words", [
    (INFER, dict(data=b"{not json"), 400, "bad_request", "not valid JSON"),
    (INFER, dict(json=[1, 2]), 400, "bad_request", "JSON object"),
    (INFER, dict(json={"inputs": []}), 400, "bad_request", "exactly one input"),
    (INFER, dict(json={"inputs": [{"name": "a", "datatype": "INT32", "shape": [1],
                                   "data": [1]}]}), 400, "bad_request", "datatype 'INT32'"),
    (INFER, dict(json={"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1],
                                   "data": ["%%%"]}]}), 400, "bad_request", "base64"),
    (INFER, dict(json={"inputs": [{"name": "a", "datatype": "BYTES", "shape": [2],
                                   "data": [PNG_B64]}]}), 400, "bad_request", "1 elements"),
    (INFER, dict(json={"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1]}]}),
     400, "bad_request", "neither 'data'"),
    (INFER, dict(json={"inputs": [{"name": "a", "datatype": "FP32", "shape": [1, 3],
                                   "data": [0, 0, 0]}]}), 400, "bad_request", "[N, 299, 299, 3]"),
    (INFER, dict(json={"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1],
                                   "data": [PNG_B64]}], "outputs": [{"name": "logits"}]}),
     400, "bad_request", "unknown output 'logits'"),
    (INFER, dict(json={"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1],
                                   "data": [PNG_B64]}],
                       "outputs": [{"name": "probabilities",
                                    "parameters": {"classification": 0}}]}),
     400, "bad_request", "classification"),
    (INFER, dict(json={"id": 7, "inputs": [oip_bytes_input([b"x"])]}), 400, "bad_request",
     "'id'"),
    (INFER, dict(json={"inputs": [{"name": "a", "datatype": "BYTES", "shape": [1],
                                   "data": [PNG_B64]}]}), 400, "invalid_image", ""),
    (INFER, "fp32_out_of_range", 400, "bad_request", "[-1, 1]"),
    (INFER, "fp32_nan", 400, "bad_request", "NaN"),
    (INFER, "header_too_long", 400, "bad_request", HEADER_LENGTH),
    (INFER, "binary_size_past_end", 400, "bad_request", "runs past"),
    (INFER, "binary_left_over", 400, "bad_request", "belong to no input"),
    ("/v2/models/nobody/infer", dict(json={"inputs": []}), 404, "unknown_bot", "nobody"),
    (PREDICT, dict(data=b"[}"), 400, "bad_request", "not valid JSON"),
    (PREDICT, dict(json={"instances": [], "inputs": []}), 400, "bad_request", "exactly one"),
    (PREDICT, dict(json={"instances": ["aGVsbG8="]}), 400, "bad_request", "bare string"),
    (PREDICT, dict(json={"instances": [{"a": {"b64": PNG_B64}, "b": 1}]}), 400, "bad_request",
     "names 2 inputs"),
    (PREDICT, dict(json={"signature_name": "classify", "instances": [{"b64": PNG_B64}]}),
     400, "bad_request", "signature_name"),
    (PREDICT, dict(json={"instances": []}), 400, "bad_request", "no image"),
    (PREDICT, dict(json={"instances": [[[0.0, 0.0, 0.0]]]}), 400, "bad_request", "shape"),
    (f"/v1/models/{BOT}:classify", dict(json={"examples": []}), 404, "not_found", ":predict"),
    ("/v1/models/nobody:predict", dict(json={"instances": []}), 404, "unknown_bot", "nobody"),
])
async def test_malformed_requests(make_client, path, request_kwargs, status, code, words):
    client = await make_client()
    if isinstance(request_kwargs, str):
        data, headers = {
            "fp32_out_of_range": lambda: _fp32_binary(255.0),
            "fp32_nan": lambda: _fp32_binary(float("nan")),
            "header_too_long": lambda: _bytes_binary(declared=10_000),
            "binary_size_past_end": lambda: _bytes_binary(size_delta=5),
            "binary_left_over": lambda: _bytes_binary(header_extra=b"extra"),
        }[request_kwargs]()
        request_kwargs = dict(data=data, headers=headers)
    resp = await client.post(path, **request_kwargs)
    body = await resp.json()
    assert resp.status == status, body
    assert body["code"] == code and words in body["error"], body


async def test_limits_apply(make_client, jpegs):
    client = await make_client(max_images_per_request=1, max_body_bytes=64 * 1024)
    two = {"inputs": [oip_bytes_input([b"a", b"b"])]}
    resp = await client.post(INFER, json=two)
    assert resp.status == 413 and (await resp.json())["code"] == "payload_too_large"
    resp = await client.post(PREDICT, json={"instances": [{"b64": PNG_B64}] * 2})
    assert resp.status == 413 and (await resp.json())["code"] == "payload_too_large"
    data, headers = _fp32_binary(0.0)  # 1 MiB
    resp = await client.post(INFER, data=data, headers=headers)
    assert resp.status == 413 and (await resp.json())["code"] == "payload_too_large"
