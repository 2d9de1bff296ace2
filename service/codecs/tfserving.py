"""TensorFlow Serving's REST API. A bot is a "model"; its active version is the only one served.

    GET  /v1/models/{bot}[/versions/{v}]            model status
    GET  /v1/models/{bot}[/versions/{v}]/metadata   signature_def of `serving_default`
    POST /v1/models/{bot}[/versions/{v}]:predict    row ("instances") or columnar ("inputs")

An image is `{"b64": "..."}` (encoded bytes) or a nested list [299, 299, 3] (preprocessed),
either bare or under one input name (`{"image_bytes": {"b64": ...}}`). Each prediction has
`probabilities` (all classes), `classes` and `scores` (the top `?top_k=`, default from the
settings). TF Serving's `:predict` answer names no version: the `X-Multihead-Version` header
says which one answered (the active one, or the bot's canary candidate).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backbone.spec import INPUT
from heads import Head
from service.codecs.base import (
    JSON,
    Answer,
    Body,
    Endpoint,
    Reply,
    Request,
    json_answer,
    json_reply,
)
from service.codecs.common import (
    MODEL_PATH_PARAMS,
    TOP_K,
    Model,
    TensorSpec,
    b64decode,
    classify_with,
    float_array,
    model_head,
    model_info,
    model_of,
    model_paths,
    parse_json_object,
    parse_top_k,
)
from service.codecs.oip_tensors import ARRAY_INPUT, ARRAY_SHAPE, BYTES_INPUT, OUTPUT
from service.core.auth import INFER
from service.core.engine import Images, Prediction
from service.core.errors import BadRequest, NotFound
from store import BotInfo

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller

SIGNATURE = "serving_default"


OUTPUTS = (OUTPUT, "classes", "scores")  # a prediction's outputs, in the order rendered
PREDICT_METHOD = "tensorflow/serving/predict"
# `:predict` answers: the version that answered (TF Serving's answer body names none).
VERSION_HEADER = "X-Multihead-Version"


# -- the typed calls: what REST and gRPC both parse into and render from ---------------------

@dataclass(frozen=True)
class VersionStatus:
    """`model_version_status` of a bot's active version."""

    version: int
    state: str  # AVAILABLE, LOADING or END
    error_code: str  # OK or UNAVAILABLE
    error_message: str


@dataclass(frozen=True)
class Signature:
    """The `serving_default` signature of a bot: tensors by key (datatypes as DT_* names)."""

    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    method_name: str = PREDICT_METHOD


def version_status(version: int, readiness) -> VersionStatus:
    """The active version's status from the service's readiness."""
    if readiness.error:
        return VersionStatus(version, "END", "UNAVAILABLE", readiness.error)
    return VersionStatus(version, "AVAILABLE" if readiness.ready else "LOADING", "OK", "")


def signature_of(n_classes: int) -> Signature:
    # Either input, not both: a request carries one of them.
    return Signature(
        inputs={BYTES_INPUT: TensorSpec(BYTES_INPUT, "DT_STRING", (-1,)),
                ARRAY_INPUT: TensorSpec(ARRAY_INPUT, "DT_FLOAT", (-1, *ARRAY_SHAPE))},
        outputs={OUTPUT: TensorSpec(OUTPUT, "DT_FLOAT", (-1, n_classes)),
                 "classes": TensorSpec("classes", "DT_STRING", (-1, -1)),
                 "scores": TensorSpec("scores", "DT_FLOAT", (-1, -1))})


def check_signature(name: Any) -> None:
    if name not in ("", SIGNATURE):
        raise BadRequest(f"unknown signature_name {str(name)[:64]!r}: this model has "
                         f"{SIGNATURE!r}")


def check_one_input(count: int, where: str) -> None:
    """A request names one input (`count`: how many it names)."""
    if count != 1:
        raise BadRequest(f"{where} names {count} inputs; this model takes one "
                         f"({BYTES_INPUT!r} or {ARRAY_INPUT!r})")


def _tf_image(value: Any, where: str) -> bytes | np.ndarray:
    """An image: encoded bytes (REST `{"b64": ...}`, gRPC DT_STRING) or a float image
    [299, 299, 3] (REST nested list, gRPC DT_FLOAT)."""
    if isinstance(value, dict) and set(value) == {"b64"}:
        return b64decode(value["b64"], f"{where} b64")
    if isinstance(value, bytes):
        return value
    if isinstance(value, list | np.ndarray):
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
        check_one_input(len(value), where)
        return next(iter(value.values()))
    return value


def images_of(values: Sequence[Any], where: str) -> Images:
    """The images of a request, each as `_tf_image` takes it; `where` names them ("instance",
    "input") in messages."""
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
    check_signature(obj.get("signature_name", ""))
    if ("instances" in obj) == ("inputs" in obj):
        raise BadRequest("send either 'instances' (row format) or 'inputs' (columnar), "
                         "exactly one of them")
    if "instances" in obj:
        instances = obj["instances"]
        if not isinstance(instances, list):
            raise BadRequest("'instances' must be a list")
        return images_of([_unwrap_named(v, f"instance {i}") for i, v in enumerate(instances)],
                         "instance"), False
    value = _unwrap_named(obj["inputs"], "'inputs'")
    if isinstance(value, dict):  # one b64 object: a single image
        value = [value]
    if not isinstance(value, list):
        raise BadRequest("'inputs' must be a list of images, or name one input holding it")
    return images_of(value, "input"), True


def prediction_columns(predictions: Sequence[Prediction]) -> dict[str, list]:
    """Every output as a column, one entry per image: `probabilities` (all classes), `classes`
    and `scores` (the top k)."""
    return {OUTPUT: [p.probabilities.tolist() for p in predictions],
            "classes": [[label for label, _ in p.labels_scores] for p in predictions],
            "scores": [[score for _, score in p.labels_scores] for p in predictions]}


async def status_call(service: Caller, model: Model) -> VersionStatus:
    info = await model_info(service, model)
    return version_status(info.version, service.readiness)


async def metadata_call(service: Caller, model: Model) -> tuple[BotInfo, Signature]:
    info = await model_info(service, model)
    return info, signature_of(info.n_classes)


async def predict_call(service: Caller, head: Head, images: Images,
                       top_k: int) -> list[Prediction]:
    """The prediction: every image under `head` (from `model_head`), the top `top_k` labels."""
    return await classify_with(service, head, images, top_k=top_k)


# -- REST: parse -> typed call -> render ---------------------------------------------------------

def _tf_tensor(spec: TensorSpec) -> dict:
    return {"dtype": spec.datatype, "name": f"{spec.name}:0",
            "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in spec.shape],
                             "unknown_rank": False}}


def status_report(version: int, readiness) -> dict:
    """`model_version_status` of a bot's active version from the service's readiness."""
    status = version_status(version, readiness)
    return {"model_version_status": [{
        "version": str(status.version), "state": status.state,
        "status": {"error_code": status.error_code, "error_message": status.error_message}}]}


def render_predictions(predictions: list[Prediction], columnar: bool) -> dict:
    columns = prediction_columns(predictions)
    if columnar:
        return {"outputs": columns}
    return {"predictions": [{name: columns[name][i] for name in OUTPUTS}
                            for i in range(len(predictions))]}


async def tf_status(service: Caller, request: Request) -> Reply:
    status = await status_call(service, model_of(request))
    return json_reply(status_report(status.version, service.readiness))


async def tf_metadata(service: Caller, request: Request) -> Reply:
    info, signature = await metadata_call(service, model_of(request))
    return json_reply({
        "model_spec": {"name": info.bot_id, "signature_name": "", "version": str(info.version)},
        "metadata": {"signature_def": {"signature_def": {SIGNATURE: {
            "inputs": {k: _tf_tensor(v) for k, v in signature.inputs.items()},
            "outputs": {k: _tf_tensor(v) for k, v in signature.outputs.items()},
            "method_name": signature.method_name}}}},
    })


def check_verb(verb: str) -> None:
    """Only `predict` is served: `classify`, `regress` (the REST verbs and the RPCs of the same
    names) and anything else are NotFound, before any other check."""
    if verb != "predict":
        raise NotFound(f"':{verb[:32]}' is not served: use ':predict'")


async def tf_call(service: Caller, request: Request) -> Reply:
    check_verb(request.params["verb"])
    head = await model_head(service, model_of(request))
    top_k = parse_top_k(request.query, service.top_k_default)
    body = await request.body()
    images, columnar = await service.run_blocking(
        lambda: parse_predict_request(parse_json_object(body, "predict request")))
    predictions = await predict_call(service, head, images, top_k)
    return json_reply(render_predictions(predictions, columnar),
                      headers={VERSION_HEADER: str(predictions[0].version)})


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
            Endpoint("GET", path, f"tfs_status{suffix}", tf_status, access=INFER,
                     summary="TF Serving model status of a bot", tag="tf-serving",
                     path_params=params,
                     answers={200: json_answer("the active version's status", STATUS_SCHEMA)},
                     errors=(400, 404)),
            Endpoint("GET", f"{path}/metadata", f"tfs_metadata{suffix}", tf_metadata, access=INFER,
                     summary="TF Serving signature of a bot", tag="tf-serving",
                     path_params=params,
                     answers={200: json_answer("the `serving_default` signature", {
                         "type": "object", "required": ["model_spec", "metadata"],
                         "properties": {"model_spec": {"type": "object"},
                                        "metadata": {"type": "object"}}})},
                     errors=(400, 404)),
            Endpoint("POST", path + ":{verb}", f"tfs_predict{suffix}", tf_call, access=INFER,
                     summary="TF Serving :predict with a bot", tag="tf-serving",
                     path_params={**params, "verb": _VERB}, params=(TOP_K,),
                     body=Body({JSON: PREDICT_REQUEST_SCHEMA}, "a TF Serving predict request"),
                     answers={200: Answer(
                         "one prediction per image (row format), or columns (columnar "
                         "request)", {JSON: PREDICT_RESPONSE_SCHEMA},
                         {VERSION_HEADER: ("the version that answered: the active one, or "
                                           "the bot's canary candidate", True)})},
                     errors=(400, 404, 500, 503, 504)),
        ]
    return out


ENDPOINTS = _model_endpoints()
