"""Open Inference Protocol v2 (KServe, Triton), with Triton's `binary_tensor_data` and
`classification` extensions: the typed calls and the REST endpoints. A bot is a "model"; its
active version is the only version served.

    GET  /v2                                    server metadata
    GET  /v2/health/live | /v2/health/ready     200, or 503 while the trunk loads
    GET  /v2/models/{bot}[/versions/{v}]        model metadata
    GET  /v2/models/{bot}[/versions/{v}]/ready
    POST /v2/models/{bot}[/versions/{v}]/infer

The inputs and outputs a request may hold, how they are parsed and rendered, are
`service.codecs.oip_tensors`'. Errors keep the `{"error": "...", "code": "..."}` body: the
protocol's `{"error": $string}` plus a field clients ignore. `model_version` of an answer is
the version that answered it: the live one, or the canary candidate's (whose classes, and so
the output's shape, may differ from the live version's).

The typed calls (`infer_call`, `model_metadata_call`, ...) serve the KServe gRPC service too
(`service.transports.grpc.kserve`), with the input rules of `oip_tensors`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from heads import Head
from service.codecs.base import (
    JSON,
    Answer,
    Body,
    Endpoint,
    Param,
    Reply,
    Request,
    json_answer,
    json_reply,
)
from service.codecs.common import (
    MODEL_PATH_PARAMS,
    Model,
    TensorSpec,
    classify_with,
    model_head,
    model_info,
    model_of,
    model_paths,
)
from service.codecs.oip_tensors import (
    ARRAY_INPUT,
    ARRAY_SHAPE,
    BYTES_INPUT,
    DEADLINE_PARAMETER,
    HEADER_LENGTH,
    OUTPUT,
    SHAPE_TEXT,
    InferRequest,
    InferResult,
    infer_response,
    infer_result,
    parse_infer_request,
)
from service.core import deadlines
from service.core.auth import INFER, PUBLIC
from service.core.candidates import MAX_ROUTE_KEY_CHARS, ROUTE_KEY_PARAMETER
from service.core.deadlines import MAX_MS as MAX_DEADLINE_MS
from service.core.errors import HeadUnavailable, NotReady

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller

SERVER_NAME = "multihead"
EXTENSIONS = ("binary_tensor_data", "classification")
PLATFORM = "multihead_inception_v4"


def server_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("multihead")
    except metadata.PackageNotFoundError:
        return "unknown"


# -- the typed calls: what REST and gRPC both call -------------------------------------------

@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


async def infer_call(service: Caller, head: Head, request: InferRequest) -> InferResult:
    """The inference: every image of `request` under `head` (from `model_head`), or under its
    bot's canary candidate for the requests the canary answers; by its `deadline_ms`
    parameter if sooner than the request's deadline (`service.core.deadlines`)."""
    if request.deadline_ms is not None:
        deadlines.tighten(request.deadline_ms)
    predictions = await classify_with(service, head, request.images, top_k=1,
                                      route_key=request.route_key)
    return infer_result(head, request, predictions)


def server_metadata_call() -> ServerMetadata:
    return ServerMetadata(SERVER_NAME, server_version(), EXTENSIONS)


def server_ready_call(service: Caller) -> bool:
    return service.ready


async def model_ready_call(service: Caller, model: Model) -> bool:
    """Whether the model can be scored now: the trunk is ready and the head loads."""
    try:
        await model_head(service, model)
    except (NotReady, HeadUnavailable):
        return False
    return True


async def model_metadata_call(service: Caller, model: Model) -> ModelMetadata:
    info = await model_info(service, model)
    # Either input, not both: the request's one input is recognised by its datatype.
    return ModelMetadata(info.bot_id, (str(info.version),), PLATFORM,
                         (TensorSpec(BYTES_INPUT, "BYTES", (-1,)),
                          TensorSpec(ARRAY_INPUT, "FP32", (-1, *ARRAY_SHAPE))),
                         (TensorSpec(OUTPUT, "FP32", (-1, info.n_classes)),))


# -- REST: parse -> typed call -> render ---------------------------------------------------------

async def server_metadata(service: Caller, request: Request) -> Reply:
    metadata = server_metadata_call()
    return json_reply({"name": metadata.name, "version": metadata.version,
                       "extensions": list(metadata.extensions)})


async def server_live(service: Caller, request: Request) -> Reply:
    return json_reply({"live": True})


async def server_ready(service: Caller, request: Request) -> Reply:
    ready = server_ready_call(service)
    return json_reply({"ready": ready}, status=200 if ready else 503)


def _tensor(spec: TensorSpec) -> dict:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


async def model_metadata(service: Caller, request: Request) -> Reply:
    metadata = await model_metadata_call(service, model_of(request))
    return json_reply({
        "name": metadata.name,
        "versions": list(metadata.versions),
        "platform": metadata.platform,
        "inputs": [_tensor(t) for t in metadata.inputs],
        "outputs": [_tensor(t) for t in metadata.outputs],
    })


async def model_ready(service: Caller, request: Request) -> Reply:
    model = model_of(request)
    ready = await model_ready_call(service, model)
    # NOTE: the name as asked; when ready it is the bot's id as registered (the same text).
    return json_reply({"name": model.bot_id, "ready": ready}, status=200 if ready else 503)


async def infer(service: Caller, request: Request) -> Reply:
    head = await model_head(service, model_of(request))  # 503 / 404 before the body is read
    body = await request.body()
    # Parsing megabytes of JSON numbers takes a while: off the event loop.
    parsed = await service.run_blocking(parse_infer_request, body, request.header(HEADER_LENGTH))
    header, blobs = infer_response(await infer_call(service, head, parsed))
    if not blobs:
        return Reply(200, header)
    return Reply(200, header + blobs, "application/octet-stream",
                 {HEADER_LENGTH: str(len(header))})


# -- API description ---------------------------------------------------------------------------

_TENSOR_METADATA = {
    "title": "OipTensorMetadata", "type": "object", "required": ["name", "datatype", "shape"],
    "properties": {"name": {"type": "string"}, "datatype": {"type": "string"},
                   "shape": {"type": "array", "items": {"type": "integer"}}}}
_BINARY_SIZE = {"binary_data_size": {"type": "integer", "minimum": 0,
                                     "description": "bytes of this tensor after the JSON header "
                                                    "(binary tensor extension)"}}
INFER_REQUEST_SCHEMA = {
    "title": "OipInferenceRequest", "type": "object", "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": {"type": "object", "properties": {
            "binary_data_output": {"type": "boolean",
                                   "description": "every output as binary data by default"},
            ROUTE_KEY_PARAMETER: {"type": "string", "maxLength": MAX_ROUTE_KEY_CHARS,
                                  "description": "the routing key of a bot's canary: the "
                                                 "same key, the same version (default: the "
                                                 "X-Multihead-Route-Key header, else the "
                                                 "first image's digest)"},
            DEADLINE_PARAMETER: {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                                 "maximum": MAX_DEADLINE_MS,
                                 "description": "the request's deadline in ms from now (the "
                                                "sooner of it and X-Multihead-Deadline-Ms): "
                                                "504 deadline_unmeetable at once when its "
                                                "images cannot run in time, "
                                                "deadline_exceeded when it passes"}}},
        "inputs": {
            "type": "array", "minItems": 1, "maxItems": 1,
            "description": f"one input: {BYTES_INPUT!r} BYTES [N] (encoded images, base64 in "
                           f"JSON) or {ARRAY_INPUT!r} FP32 {SHAPE_TEXT} (preprocessed to "
                           "[-1, 1]); any name, recognised by its datatype",
            "items": {"type": "object", "required": ["name", "datatype", "shape"],
                      "properties": {
                          "name": {"type": "string"},
                          "datatype": {"type": "string", "enum": ["BYTES", "FP32"]},
                          "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                          "data": {"type": "array",
                                   "description": "flat or nested (row-major): base64 strings "
                                                  "(BYTES) or numbers (FP32)"},
                          "parameters": {"type": "object", "properties": _BINARY_SIZE}}}},
        "outputs": {
            "type": "array", "minItems": 1,
            "items": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "enum": [OUTPUT]},
                "parameters": {"type": "object", "properties": {
                    "binary_data": {"type": "boolean"},
                    "classification": {"type": "integer", "minimum": 1,
                                       "description": "the top k as 'score:index:label' "
                                                      "strings (classification extension)"}}}}}},
        }}
INFER_RESPONSE_SCHEMA = {
    "title": "OipInferenceResponse", "type": "object",
    "required": ["model_name", "model_version", "outputs"],
    "properties": {
        "model_name": {"type": "string"}, "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {"type": "array", "items": {
            "type": "object", "required": ["name", "datatype", "shape"],
            "properties": {
                "name": {"type": "string"},
                "datatype": {"type": "string", "enum": ["FP32", "BYTES"]},
                "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "data": {"type": "array",
                         "description": "FP32 probabilities, or 'score:index:label' strings"},
                "parameters": {"type": "object", "properties": _BINARY_SIZE}}}}}}
_HEADER_LENGTH = Param(HEADER_LENGTH, "header", {"type": "integer", "minimum": 0},
                       "binary tensor extension: the JSON header's length in bytes; the tensors' "
                       "bytes follow it")
INFER_BODY = Body(
    content={JSON: INFER_REQUEST_SCHEMA,
             "application/octet-stream": {
                 "type": "string", "format": "binary",
                 "description": f"binary tensor extension: the JSON request ({HEADER_LENGTH} "
                                "bytes), then each tensor's bytes"}},
    description="an OIP v2 inference request")
_READY = {"type": "object", "additionalProperties": False, "required": ["ready"],
          "properties": {"ready": {"type": "boolean"}}}
_MODEL_READY = {"type": "object", "additionalProperties": False, "required": ["name", "ready"],
                "properties": {"name": {"type": "string"}, "ready": {"type": "boolean"}}}
_MODEL_ERRORS = (400, 404)


def _model_endpoints() -> list[Endpoint]:
    out = []
    for suffix, path in model_paths("/v2/models"):
        params = {k: v for k, v in MODEL_PATH_PARAMS.items() if "{" + k in path}
        out += [
            Endpoint("GET", path, f"oip_model_metadata{suffix}", model_metadata, access=INFER,
                     summary="OIP v2 model metadata of a bot", tag="oip-v2", path_params=params,
                     answers={200: json_answer("the bot as a model", {
                         "type": "object",
                         "required": ["name", "versions", "platform", "inputs", "outputs"],
                         "properties": {"name": {"type": "string"},
                                        "versions": {"type": "array",
                                                     "items": {"type": "string"}},
                                        "platform": {"type": "string"},
                                        "inputs": {"type": "array", "items": _TENSOR_METADATA},
                                        "outputs": {"type": "array",
                                                    "items": _TENSOR_METADATA}}})},
                     errors=_MODEL_ERRORS),
            Endpoint("GET", f"{path}/ready", f"oip_model_ready{suffix}", model_ready, access=INFER,
                     summary="OIP v2 model readiness of a bot", tag="oip-v2", path_params=params,
                     answers={200: json_answer("ready", _MODEL_READY),
                              503: json_answer("the trunk is loading, or the head cannot be "
                                               "loaded", _MODEL_READY)},
                     errors=_MODEL_ERRORS),
            Endpoint("POST", f"{path}/infer", f"oip_infer{suffix}", infer, access=INFER,
                     summary="OIP v2 inference with a bot", tag="oip-v2", path_params=params,
                     params=(_HEADER_LENGTH,), body=INFER_BODY,
                     answers={200: Answer(
                         "the probabilities (or top-k strings) of every image",
                         {JSON: INFER_RESPONSE_SCHEMA,
                          "application/octet-stream": {
                              "type": "string", "format": "binary",
                              "description": "binary tensor extension: the JSON response "
                                             f"({HEADER_LENGTH} bytes), then the tensors"}},
                         {HEADER_LENGTH: ("length of the JSON response, when binary tensors "
                                          "follow it", False)})},
                     errors=(400, 404, 500, 503, 504)),
        ]
    return out


ENDPOINTS = [
    Endpoint("GET", "/v2", "oip_server_metadata", server_metadata, access=PUBLIC,
             summary="OIP v2 server metadata", tag="oip-v2",
             answers={200: json_answer("the server", {
                 "type": "object", "required": ["name", "version", "extensions"],
                 "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                "extensions": {"type": "array",
                                               "items": {"type": "string"}}}})}),
    Endpoint("GET", "/v2/health/live", "oip_server_live", server_live, access=PUBLIC,
             summary="OIP v2 liveness", tag="oip-v2",
             answers={200: json_answer("live", {
                 "type": "object", "additionalProperties": False, "required": ["live"],
                 "properties": {"live": {"type": "boolean"}}})}),
    Endpoint("GET", "/v2/health/ready", "oip_server_ready", server_ready, access=PUBLIC,
             summary="OIP v2 readiness", tag="oip-v2",
             answers={200: json_answer("ready", _READY),
                      503: json_answer("the trunk is loading, or failed to", _READY)}),
    *_model_endpoints(),
]
