"""The TF Serving codec, and the parsing rules shared by the protocols (service.codecs.common),
as pure code against a fake Service (no server, no trunk). End to end: test_interop.py."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from backbone.spec import INPUT
from service.codecs import tfserving
from service.codecs.base import dispatch
from service.codecs.common import (
    b64decode,
    check_version,
    float_array,
    model_paths,
    parse_json_object,
)
from service.codecs.tfserving import parse_predict_request, render_predictions, status_report
from service.core.engine import Prediction
from service.core.errors import BadRequest
from service.core.lifecycle import Readiness
from store import UnknownVersion
from tests.support.fakes import FakeService, failed, loading, make_head, probabilities, req

IMAGE = np.full((299, 299, 3), 0.25, np.float32)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- common ----------------------------------------------------------------------------------

def test_model_paths_without_and_with_a_version():
    assert model_paths("/v9/m") == [
        ("", "/v9/m/{bot_id:[^{}/:]+}"),
        ("_version", "/v9/m/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}")]


@pytest.mark.parametrize("text,want", [
    ("+/+/", b"\xfb\xff\xbf"),       # standard alphabet
    ("-_-_", b"\xfb\xff\xbf"),       # URL-safe alphabet
    ("aGk=", b"hi"),
    ("", b""),
])
def test_b64decode_standard_and_urlsafe(text, want):
    assert b64decode(text, "x") == want


@pytest.mark.parametrize("value,words", [
    ("aGk", "where is not valid base64"),          # missing padding
    ("a b=", "where is not valid base64"),
    ("é===", "where is not valid base64"),
    (b"aGk=", "where must be a base64 string, got bytes"),
    (None, "where must be a base64 string, got NoneType"),
])
def test_b64decode_refuses(value, words):
    with pytest.raises(BadRequest) as info:
        b64decode(value, "where")
    assert str(info.value) == words


def test_float_array():
    array = float_array([[1, 2.5], [3, 4]], "d")
    assert array.dtype == np.float32 and array.tolist() == [[1, 2.5], [3, 4]]
    for bad in ([[1, 2], [3]], ["a"], {"a": 1}):
        with pytest.raises(BadRequest, match=r"^d must be numbers \(flat, or nested to the same "
                                             r"depth\)$"):
            float_array(bad, "d")


def test_parse_json_object():
    assert parse_json_object(b'{"a": 1}', "thing") == {"a": 1}
    assert parse_json_object('{"a": 1}', "thing") == {"a": 1}
    for raw in (b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(BadRequest, match=r"^thing is not valid JSON \(or nests too deep\)$"):
            parse_json_object(raw, "thing")
    for raw in (b"[]", b"1", b'"s"', b"null"):
        with pytest.raises(BadRequest, match="^thing must be a JSON object$"):
            parse_json_object(raw, "thing")


@pytest.mark.parametrize("raw", [None, "3", "03"])
def test_check_version_accepts_the_active_version_or_none(raw):
    check_version("acme", 3, raw)


def test_check_version_refuses_others():
    with pytest.raises(UnknownVersion) as info:
        check_version("acme", 3, "2")
    assert str(info.value) == "bot 'acme' version 2 is not served: only its active version 3 is"
    for raw in ("x", "-3", "3.0", ""):
        with pytest.raises(BadRequest, match="model version must be a number"):
            check_version("acme", 3, raw)


def test_check_version_refuses_a_superscript_digit_as_a_bad_request():
    with pytest.raises(BadRequest):
        check_version("acme", 3, "²")


def test_float_array_refuses_null():
    with pytest.raises(BadRequest):
        float_array([0.5, None], "d")


# -- parse_predict_request -------------------------------------------------------------------

def encoded(obj) -> list[bytes]:
    images, _ = parse_predict_request(obj)
    assert images.arrays is None
    return images.encoded


@pytest.mark.parametrize("obj,columnar", [
    ({"instances": [{"b64": b64(b"a")}, {"b64": b64(b"b")}]}, False),
    ({"instances": [{"image_bytes": {"b64": b64(b"a")}},
                    {"image_bytes": {"b64": b64(b"b")}}]}, False),
    ({"inputs": {"image_bytes": [{"b64": b64(b"a")}, {"b64": b64(b"b")}]}}, True),
    ({"inputs": [{"b64": b64(b"a")}, {"b64": b64(b"b")}]}, True),
    ({"signature_name": "serving_default", "inputs": [{"b64": b64(b"a")}, {"b64": b64(b"b")}]},
     True),
    ({"signature_name": "", "instances": [{"b64": b64(b"a")}, {"b64": b64(b"b")}]}, False),
], ids=["rows", "named-rows", "named-columns", "bare-columns", "signature", "empty-signature"])
def test_encoded_images_in_every_form(obj, columnar):
    images, got_columnar = parse_predict_request(obj)
    assert images.encoded == [b"a", b"b"] and images.arrays is None
    assert got_columnar is columnar


@pytest.mark.parametrize("obj", [
    {"inputs": {"b64": b64(b"a")}},
    {"inputs": {"image_bytes": {"b64": b64(b"a")}}},
], ids=["bare", "named"])
def test_one_b64_object_as_columnar_input_is_one_image(obj):
    images, columnar = parse_predict_request(obj)
    assert images.encoded == [b"a"] and columnar is True


@pytest.mark.parametrize("obj,columnar", [
    ({"instances": [IMAGE.tolist(), (IMAGE * 2).tolist()]}, False),
    ({"instances": [{"images": IMAGE.tolist()}, {"images": (IMAGE * 2).tolist()}]}, False),
    ({"inputs": {"images": [IMAGE.tolist(), (IMAGE * 2).tolist()]}}, True),
], ids=["rows", "named-rows", "named-columns"])
def test_float_images(obj, columnar):
    images, got_columnar = parse_predict_request(obj)
    assert images.encoded is None and got_columnar is columnar
    assert images.arrays.dtype == np.float32 and images.arrays.shape == (2, 299, 299, 3)
    np.testing.assert_array_equal(images.arrays, np.stack([IMAGE, IMAGE * 2]))


@pytest.mark.parametrize("obj,message", [
    ({"signature_name": "other", "instances": []},
     "unknown signature_name 'other': this model has 'serving_default'"),
    ({"signature_name": None, "instances": []},
     "unknown signature_name 'None': this model has 'serving_default'"),
    ({}, "send either 'instances' (row format) or 'inputs' (columnar), exactly one of them"),
    ({"instances": [], "inputs": []},
     "send either 'instances' (row format) or 'inputs' (columnar), exactly one of them"),
    ({"instances": {"b64": "YQ=="}}, "'instances' must be a list"),
    ({"instances": []}, "no image in the request"),
    ({"inputs": []}, "no image in the request"),
    ({"inputs": "YQ=="}, "'inputs' must be a list of images, or name one input holding it"),
    ({"inputs": {"image_bytes": 5}},
     "'inputs' must be a list of images, or name one input holding it"),
    ({"inputs": {"a": [], "b": []}},
     "'inputs' names 2 inputs; this model takes one ('image_bytes' or 'images')"),
    ({"instances": [{"b64": "YQ=="}, {"a": 1, "b": 2}]},
     "instance 1 names 2 inputs; this model takes one ('image_bytes' or 'images')"),
    ({"instances": [{}]}, "instance 0 names 0 inputs; this model takes one ('image_bytes' or "
                          "'images')"),
    ({"instances": ["YQ=="]},
     'instance 0 is a bare string: send image bytes as {"b64": "..."}'),
    ({"instances": [{"b64": "YQ=="}, 7]},
     'instance 1 must be {"b64": "..."} (encoded image) or a nested list [299, 299, 3] '
     '(preprocessed image)'),
    ({"instances": [{"b64": "YQ==", "x": 1}]},
     "instance 0 names 2 inputs; this model takes one ('image_bytes' or 'images')"),
    ({"instances": [{"b64": "!"}]}, "instance 0 b64 is not valid base64"),
    ({"inputs": [[1.0, 2.0]]},
     f"input 0 is a float image of shape [2], expected {INPUT.describe()}"),
    ({"inputs": [[[1.0], [2.0, 3.0]]]},
     "input 0 must be numbers (flat, or nested to the same depth)"),
    ({"inputs": [{"b64": "YQ=="}, IMAGE.tolist()]},
     'mix of encoded ({"b64": ...}) and float images in one request'),
], ids=lambda v: str(v)[:40])
def test_malformed_predict_requests(obj, message):
    with pytest.raises(BadRequest) as info:
        parse_predict_request(obj)
    assert str(info.value) == message


# -- rendering -------------------------------------------------------------------------------

P = [Prediction("acme", 2, [("dog", 0.5), ("owl", 0.3)], np.array([0.2, 0.5, 0.3], np.float32)),
     Prediction("acme", 2, [("cat", 0.6), ("owl", 0.3)], np.array([0.6, 0.1, 0.3], np.float32))]


def test_render_rows():
    assert render_predictions(P, columnar=False) == {"predictions": [
        {"probabilities": P[0].probabilities.tolist(), "classes": ["dog", "owl"],
         "scores": [0.5, 0.3]},
        {"probabilities": P[1].probabilities.tolist(), "classes": ["cat", "owl"],
         "scores": [0.6, 0.3]}]}


def test_render_columns():
    assert render_predictions(P, columnar=True) == {"outputs": {
        "probabilities": [P[0].probabilities.tolist(), P[1].probabilities.tolist()],
        "classes": [["dog", "owl"], ["cat", "owl"]],
        "scores": [[0.5, 0.3], [0.6, 0.3]]}}


@pytest.mark.parametrize("readiness,state,status", [
    (Readiness(status="ready"), "AVAILABLE", {"error_code": "OK", "error_message": ""}),
    (loading(), "LOADING", {"error_code": "OK", "error_message": ""}),
    (failed("trunk failed to load: boom"), "END",
     {"error_code": "UNAVAILABLE", "error_message": "trunk failed to load: boom"}),
], ids=["ready", "loading", "failed"])
def test_status_report(readiness, state, status):
    assert status_report(7, readiness) == {"model_version_status": [
        {"version": "7", "state": state, "status": status}]}


# -- endpoints against a fake Service --------------------------------------------------------

HEAD = make_head("acme", 2, ["cat", "dog", "owl"])


def service(**kwargs) -> FakeService:
    return FakeService(heads={"acme": HEAD}, **kwargs)


def endpoint(name: str):
    (found,) = [e for e in tfserving.ENDPOINTS if e.name == name]
    return found


async def call(svc, name: str, **kwargs):
    e = endpoint(name)
    reply = await dispatch(svc, e, req(e.method, e.path, **kwargs))
    return reply.status, json.loads(reply.body)


def test_routes():
    assert [(e.method, e.path, e.name) for e in tfserving.ENDPOINTS] == [
        ("GET", "/v1/models/{bot_id:[^{}/:]+}", "tfs_status"),
        ("GET", "/v1/models/{bot_id:[^{}/:]+}/metadata", "tfs_metadata"),
        ("POST", "/v1/models/{bot_id:[^{}/:]+}:{verb}", "tfs_predict"),
        ("GET", "/v1/models/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}", "tfs_status_version"),
        ("GET", "/v1/models/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}/metadata",
         "tfs_metadata_version"),
        ("POST", "/v1/models/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}:{verb}",
         "tfs_predict_version"),
    ]
    assert not any(e.admin for e in tfserving.ENDPOINTS)
    # ENDPOINTS is built at import time; called again here, a mutant of the builder runs.
    assert tfserving._model_endpoints() == tfserving.ENDPOINTS
    assert [e.handle for e in tfserving.ENDPOINTS] == [
        tfserving.tf_status, tfserving.tf_metadata, tfserving.tf_call] * 2
    assert all(e.summary.startswith("TF Serving ") for e in tfserving.ENDPOINTS)


@pytest.mark.parametrize("readiness,state", [(None, "AVAILABLE"), (loading(), "LOADING"),
                                             (failed("trunk failed to load: x"), "END")])
async def test_status_endpoint_follows_readiness(readiness, state):
    svc = service() if readiness is None else service(readiness=readiness)
    status, body = await call(svc, "tfs_status", params={"bot_id": "acme"})
    assert status == 200
    assert body == status_report(2, svc.readiness)
    assert body["model_version_status"][0]["state"] == state


@pytest.mark.parametrize("name", ["tfs_status_version", "tfs_metadata_version"])
@pytest.mark.parametrize("version,status,code", [("2", 200, None), ("1", 404, "unknown_version"),
                                                 ("v2", 400, "bad_request")])
async def test_versioned_routes_serve_only_the_active_version(name, version, status, code):
    got, body = await call(service(), name, params={"bot_id": "acme", "version": version})
    assert got == status
    assert body.get("code") == code


async def test_metadata():
    status, body = await call(service(), "tfs_metadata", params={"bot_id": "acme"})

    def tensor(name, dtype, shape):
        return {"dtype": dtype, "name": f"{name}:0",
                "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in shape],
                                 "unknown_rank": False}}

    assert status == 200 and body == {
        "model_spec": {"name": "acme", "signature_name": "", "version": "2"},
        "metadata": {"signature_def": {"signature_def": {"serving_default": {
            "inputs": {"image_bytes": tensor("image_bytes", "DT_STRING", [-1]),
                       "images": tensor("images", "DT_FLOAT", [-1, 299, 299, 3])},
            "outputs": {"probabilities": tensor("probabilities", "DT_FLOAT", [-1, 3]),
                        "classes": tensor("classes", "DT_STRING", [-1, -1]),
                        "scores": tensor("scores", "DT_FLOAT", [-1, -1])},
            "method_name": "tensorflow/serving/predict"}}}}}


def expected_rows(n_images: int, top_k: int) -> list[dict]:
    rows = []
    for i in range(n_images):
        p = probabilities(i, 0, 3)
        order = np.argsort(-p, kind="stable")[:top_k]
        rows.append({"probabilities": p.tolist(),
                     "classes": [HEAD.labels[c] for c in order],
                     "scores": [float(p[c]) for c in order]})
    return rows


async def test_predict_rows_with_the_default_top_k():
    svc = service()
    body = json.dumps({"instances": [{"b64": b64(b"a")}, {"b64": b64(b"b")}]}).encode()
    status, got = await call(svc, "tfs_predict", params={"bot_id": "acme", "verb": "predict"},
                             body=body)
    assert (status, got) == (200, {"predictions": expected_rows(2, 2)})
    ((images, bots, top_k),) = svc.classified
    assert images.encoded == [b"a", b"b"] and bots == ["acme"] and top_k == 2


async def test_predict_columnar_with_top_k_and_version():
    body = json.dumps({"inputs": {"image_bytes": [{"b64": b64(b"a")}]}}).encode()
    status, got = await call(service(), "tfs_predict_version",
                             params={"bot_id": "acme", "version": "2", "verb": "predict"},
                             query={"top_k": "1"}, body=body)
    rows = expected_rows(1, 1)
    assert (status, got) == (200, {"outputs": {k: [r[k] for r in rows]
                                               for k in ("probabilities", "classes", "scores")}})


@pytest.mark.parametrize("svc,params,query,body,status,code", [
    (service(), {"bot_id": "acme", "verb": "classify"}, {}, b"{}", 404, "not_found"),
    (service(readiness=loading()), {"bot_id": "acme", "verb": "predict"}, {}, b"{}", 503,
     "not_ready"),
    (service(), {"bot_id": "nobody", "verb": "predict"}, {}, b"{}", 404, "unknown_bot"),
    (service(), {"bot_id": "acme", "verb": "predict"}, {"top_k": "0"}, b"{}", 400,
     "bad_request"),
    (service(), {"bot_id": "acme", "verb": "predict"}, {}, b"[1]", 400, "bad_request"),
    (service(), {"bot_id": "acme", "verb": "predict"}, {}, b'{"instances": []}', 400,
     "bad_request"),
], ids=["verb", "loading", "unknown-bot", "top-k", "not-object", "no-image"])
async def test_predict_errors(svc, params, query, body, status, code):
    got, reply = await call(svc, "tfs_predict", params=params, query=query, body=body)
    assert (got, reply["code"]) == (status, code)
    assert not svc.classified


async def test_predict_with_another_verb_names_it():
    _, reply = await call(service(), "tfs_predict", params={"bot_id": "acme", "verb": "regress"},
                          body=b"{}")
    assert reply == {"error": "':regress' is not served: use ':predict'", "code": "not_found"}


@pytest.mark.parametrize("body,message", [
    (b"{", "predict request is not valid JSON (or nests too deep)"),
    (b"[]", "predict request must be a JSON object"),
])
async def test_predict_body_errors_name_the_predict_request(body, message):
    _, reply = await call(service(), "tfs_predict", params={"bot_id": "acme", "verb": "predict"},
                          body=body)
    assert reply == {"error": message, "code": "bad_request"}


def test_long_values_are_cut_in_messages():
    with pytest.raises(BadRequest) as info:
        parse_predict_request({"signature_name": "s" * 80, "instances": []})
    assert str(info.value) == f"unknown signature_name {'s' * 64!r}: this model has " \
                              f"'serving_default'"
    with pytest.raises(BadRequest) as info:
        check_version("acme", 3, "v" * 40)
    assert str(info.value) == f"model version must be a number, got '{'v' * 32}'"


async def test_a_long_verb_is_cut_in_the_message():
    _, reply = await call(service(), "tfs_predict", params={"bot_id": "acme", "verb": "v" * 40},
                          body=b"{}")
    assert reply["error"] == f"':{'v' * 32}' is not served: use ':predict'"
