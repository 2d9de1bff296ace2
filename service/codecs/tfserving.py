"""TensorFlow Serving's REST API. A bot is a "model"; its active version is the only one served.

    GET  /v1/models/{bot}[/versions/{v}]            model status
    GET  /v1/models/{bot}[/versions/{v}]/metadata   signature_def of `serving_default`
    POST /v1/models/{bot}[/versions/{v}]:predict    row ("instances") or columnar ("inputs")

An image is `{"b64": "..."}` (encoded bytes) or a nested list [299, 299, 3] (preprocessed),
either bare or under one input name (`{"image_bytes": {"b64": ...}}`). Each prediction has
`probabilities` (all classes), `classes` and `scores` (the top `?top_k=`, default from the
settings).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from backbone.spec import INPUT
from service.codecs.base import JSON, Body, Endpoint, Reply, Request, json_answer, json_reply
from service.codecs.common import (
    MODEL_PATH_PARAMS,
    TOP_K,
    active_head,
    active_info,
    b64decode,
    classify_with,
    float_array,
    model_paths,
    parse_json_object,
    parse_top_k,
)
from service.codecs.oip import ARRAY_INPUT, ARRAY_SHAPE, BYTES_INPUT, OUTPUT
from service.core.engine import Images, Prediction
from service.core.errors import BadRequest, NotFound

if TYPE_CHECKING:  # pragma: no cover
    from service.core.context import Service

SIGNATURE = "serving_default"


def _tf_tensor(name: str, dtype: str, shape: list[int]) -> dict:
    return {"dtype": dtype, "name": f"{name}:0",
            "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in shape],
                             "unknown_rank": False}}


def _tf_image(value: Any, where: str) -> bytes | np.ndarray:
    """`{"b64": ...}` -> encoded bytes; a nested list -> float32 [299, 299, 3]."""
    if isinstance(value, dict) and set(value) == {"b64"}:
        return b64decode(value["b64"], f"{where} b64")
    if isinstance(value, list):
        image = float_array(value, where)
        if image.shape != ARRAY_SHAPE:
            raise BadRequest(f"{where} is a float image of shape {list(image.shape)}, expected "
                             f"{INPUT.describe()}")
        return image
    if isinstance(value, str):
        raise BadRequest(f"{where} is a bare string: send image bytes as {{\"b64\": \"...\"}}")
    raise BadRequest(f"{where} must be {{\"b64\": \"...\"}} (encoded image) or a nested list "
                     f"{list(ARRAY_SHAPE)} (preprocessed image)")


def _unwrap_named(value: Any, where: str) -> Any:
    """`{"<input name>": v}` -> v; a b64 object or anything else is returned as is."""
    if isinstance(value, dict) and set(value) != {"b64"}:
        if len(value) != 1:
            raise BadRequest(f"{where} names {len(value)} inputs; this model takes one "
                             f"({BYTES_INPUT!r} or {ARRAY_INPUT!r})")
        return next(iter(value.values()))
    return value


def _tf_images(values: list, where: str) -> Images:
    images = [_tf_image(v, f"{where} {i}") for i, v in enumerate(values)]
    if not images:
        raise BadRequest("no image in the request")
    if all(isinstance(i, bytes) for i in images):
        return Images(encoded=images)
    if all(isinstance(i, np.ndarray) for i in images):
        return Images(arrays=np.stack(images))
    raise BadRequest("mix of encoded ({\"b64\": ...}) and float images in one request")


def parse_predict_request(obj: dict) -> tuple[Images, bool]:
    """A TF Serving `:predict` body -> (images, columnar?). Raises BadRequest."""
    signature = obj.get("signature_name", "")
    if signature not in ("", SIGNATURE):
        raise BadRequest(f"unknown signature_name {str(signature)[:64]!r}: this model has "
                         f"{SIGNATURE!r}")
    if ("instances" in obj) == ("inputs" in obj):
        raise BadRequest("send either 'instances' (row format) or 'inputs' (columnar), "
                         "exactly one of them")
    if "instances" in obj:
        instances = obj["instances"]
        if not isinstance(instances, list):
            raise BadRequest("'instances' must be a list")
        return _tf_images([_unwrap_named(v, f"instance {i}") for i, v in enumerate(instances)],
                          "instance"), False
    value = _unwrap_named(obj["inputs"], "'inputs'")
    if isinstance(value, dict):  # one b64 object: a single image
        value = [value]
    if not isinstance(value, list):
        raise BadRequest("'inputs' must be a list of images, or name one input holding it")
    return _tf_images(value, "input"), True


def status_report(version: int, readiness) -> dict:
    """`model_version_status` of a bot's active version from the service's readiness."""
    state, status = "AVAILABLE", {"error_code": "OK", "error_message": ""}
    if readiness.error:
        state, status = "END", {"error_code": "UNAVAILABLE", "error_message": readiness.error}
    elif not readiness.ready:
        state = "LOADING"
    return {"model_version_status": [{"version": str(version), "state": state,
                                      "status": status}]}


def render_predictions(predictions: list[Prediction], columnar: bool) -> dict:
    rows = [{OUTPUT: p.probabilities.tolist(),
             "classes": [label for label, _ in p.labels_scores],
             "scores": [score for _, score in p.labels_scores]} for p in predictions]
    if columnar:
        return {"outputs": {name: [row[name] for row in rows]
                            for name in (OUTPUT, "classes", "scores")}}
    return {"predictions": rows}


async def tf_status(service: Service, request: Request) -> Reply:
    info = await active_info(service, request)
    return json_reply(status_report(info.version, service.readiness))


async def tf_metadata(service: Service, request: Request) -> Reply:
    info = await active_info(service, request)
    signature = {
        # Either input, not both: a request carries one of them.
        "inputs": {BYTES_INPUT: _tf_tensor(BYTES_INPUT, "DT_STRING", [-1]),
                   ARRAY_INPUT: _tf_tensor(ARRAY_INPUT, "DT_FLOAT", [-1, *ARRAY_SHAPE])},
        "outputs": {OUTPUT: _tf_tensor(OUTPUT, "DT_FLOAT", [-1, info.n_classes]),
                    "classes": _tf_tensor("classes", "DT_STRING", [-1, -1]),
                    "scores": _tf_tensor("scores", "DT_FLOAT", [-1, -1])},
        "method_name": "tensorflow/serving/predict",
    }
    return json_reply({
        "model_spec": {"name": info.bot_id, "signature_name": "", "version": str(info.version)},
        "metadata": {"signature_def": {"signature_def": {SIGNATURE: signature}}},
    })


async def tf_call(service: Service, request: Request) -> Reply:
    verb = request.params["verb"]
    if verb != "predict":
        raise NotFound(f"':{verb[:32]}' is not served: use ':predict'")
    service.require_engine()
    head = await active_head(service, request)
    top_k = parse_top_k(request.query, service.settings.top_k_default)
    body = await request.body()
    images, columnar = await service.run_blocking(
        lambda: parse_predict_request(parse_json_object(body, "predict request")))
    predictions = await classify_with(service, head, images, top_k=top_k)
    return json_reply(render_predictions(predictions, columnar))


# -- API description ---------------------------------------------------------------------------

_NUMBERS = {"type": "array", "items": {"type": "number"}}
_STRINGS = {"type": "array", "items": {"type": "string"}}
STATUS_SCHEMA = {
    "title": "TfsModelStatus", "type": "object", "additionalProperties": False,
    "required": ["model_version_status"],
    "properties": {"model_version_status": {"type": "array", "items": {
        "type": "object", "required": ["version", "state", "status"],
        "properties": {
            "version": {"type": "string"},
            "state": {"type": "string", "enum": ["AVAILABLE", "LOADING", "END"]},
            "status": {"type": "object", "required": ["error_code", "error_message"],
                       "properties": {"error_code": {"type": "string"},
                                      "error_message": {"type": "string"}}}}}}}}
PREDICT_REQUEST_SCHEMA = {
    "title": "TfsPredictRequest", "type": "object",
    "description": "row format (`instances`) or columnar (`inputs`), exactly one of them. An "
                   "image is {\"b64\": \"...\"} (encoded bytes) or a nested list "
                   f"{list(ARRAY_SHAPE)} (preprocessed to [-1, 1]), bare or under one input "
                   f"name ({BYTES_INPUT!r}, {ARRAY_INPUT!r}).",
    "properties": {
        "signature_name": {"type": "string", "enum": ["", SIGNATURE]},
        "instances": {"type": "array", "minItems": 1, "items": {}},
        "inputs": {}},
    "oneOf": [{"required": ["instances"]}, {"required": ["inputs"]}]}
PREDICT_RESPONSE_SCHEMA = {
    "title": "TfsPredictResponse", "type": "object",
    "oneOf": [
        {"required": ["predictions"], "additionalProperties": False, "properties": {
            "predictions": {"type": "array", "items": {
                "type": "object", "additionalProperties": False,
                "required": [OUTPUT, "classes", "scores"],
                "properties": {OUTPUT: _NUMBERS, "classes": _STRINGS,
                               "scores": _NUMBERS}}}}},
        {"required": ["outputs"], "additionalProperties": False, "properties": {
            "outputs": {"type": "object", "additionalProperties": False,
                        "required": [OUTPUT, "classes", "scores"],
                        "properties": {OUTPUT: {"type": "array", "items": _NUMBERS},
                                       "classes": {"type": "array", "items": _STRINGS},
                                       "scores": {"type": "array", "items": _NUMBERS}}}}}]}
_VERB = {"type": "string", "enum": ["predict"],
         "description": "only `predict` is served (`classify` and `regress`: 404)"}


def _model_endpoints() -> list[Endpoint]:
    out = []
    for suffix, path in model_paths("/v1/models"):
        params = {k: v for k, v in MODEL_PATH_PARAMS.items() if "{" + k in path}
        out += [
            Endpoint("GET", path, f"tfs_status{suffix}", tf_status,
                     summary="TF Serving model status of a bot", tag="tf-serving",
                     path_params=params,
                     answers={200: json_answer("the active version's status", STATUS_SCHEMA)},
                     errors=(400, 404)),
            Endpoint("GET", f"{path}/metadata", f"tfs_metadata{suffix}", tf_metadata,
                     summary="TF Serving signature of a bot", tag="tf-serving",
                     path_params=params,
                     answers={200: json_answer("the `serving_default` signature", {
                         "type": "object", "required": ["model_spec", "metadata"],
                         "properties": {"model_spec": {"type": "object"},
                                        "metadata": {"type": "object"}}})},
                     errors=(400, 404)),
            Endpoint("POST", path + ":{verb}", f"tfs_predict{suffix}", tf_call,
                     summary="TF Serving :predict with a bot", tag="tf-serving",
                     path_params={**params, "verb": _VERB}, params=(TOP_K,),
                     body=Body({JSON: PREDICT_REQUEST_SCHEMA}, "a TF Serving predict request"),
                     answers={200: json_answer("one prediction per image (row format), or "
                                               "columns (columnar request)",
                                               PREDICT_RESPONSE_SCHEMA)},
                     errors=(400, 404, 500, 503, 504)),
        ]
    return out


ENDPOINTS = _model_endpoints()
