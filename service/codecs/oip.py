"""Open Inference Protocol v2 (KServe, Triton), with Triton's `binary_tensor_data` and
`classification` extensions. A bot is a "model"; its active version is the only version served.

    GET  /v2                                    server metadata
    GET  /v2/health/live | /v2/health/ready     200, or 503 while the trunk loads
    GET  /v2/models/{bot}[/versions/{v}]        model metadata
    GET  /v2/models/{bot}[/versions/{v}]/ready
    POST /v2/models/{bot}[/versions/{v}]/infer

One input, recognised by its datatype (any name is accepted):
  `image_bytes` BYTES [N] (or [N, 1]): encoded images, base64 strings in JSON `data`, or raw
      through the binary extension (each element: 4-byte little-endian length, then bytes);
  `images` FP32 [N, 299, 299, 3]: images already preprocessed to [-1, 1] (JSON `data` flat or
      nested, or little-endian binary).
One output, `probabilities` FP32 [N, n] in class index order; with `"classification": k` in
its parameters it is BYTES [N, min(k, n)] of "score:index:label" strings instead, as Triton
returns. Errors keep the `{"error": "...", "code": "..."}` body: the protocol's `{"error":
$string}` plus a field clients ignore.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backbone.spec import INPUT
from heads import Head, top_indices
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
    active_head,
    active_info,
    b64decode,
    classify_with,
    float_array,
    is_number,
    model_paths,
    parse_json_object,
)
from service.core.engine import Images, Prediction
from service.core.errors import BadRequest, HeadUnavailable, NotReady

if TYPE_CHECKING:  # pragma: no cover
    from service.core.context import Service

SERVER_NAME = "multihead"
EXTENSIONS = ("binary_tensor_data", "classification")
PLATFORM = "multihead_inception_v4"
BYTES_INPUT = "image_bytes"  # BYTES [N]: encoded images (JPEG, PNG, ...)
ARRAY_INPUT = "images"  # FP32 [N, 299, 299, 3] in [-1, 1]
OUTPUT = "probabilities"  # FP32 [N, n]
ARRAY_SHAPE = INPUT.shape
HEADER_LENGTH = "Inference-Header-Content-Length"
_SHAPE_TEXT = f"[N, {', '.join(map(str, ARRAY_SHAPE))}]"


def server_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("multihead")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class OutputRequest:
    """One requested output: as binary data or JSON, and as top-`classification` strings."""

    binary: bool
    classification: int | None


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    images: Images
    outputs: tuple[OutputRequest, ...]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parameters(obj: dict, where: str) -> dict:
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where} 'parameters' must be a JSON object")
    return params


def _flatten(data: Any) -> list:
    if isinstance(data, list):
        return [x for item in data for x in _flatten(item)]
    return [data]


def _split_bytes_elements(raw: bytes, where: str) -> list[bytes]:
    """Binary BYTES tensor: repeated (uint32 little-endian length, bytes)."""
    elements, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise BadRequest(f"{where}: binary BYTES data ends inside an element's 4-byte length")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise BadRequest(f"{where}: binary BYTES element of {size} bytes runs past the "
                             f"input's binary_data_size")
        elements.append(raw[offset:offset + size])
        offset += size
    return elements


def _input_images(spec: Any, binary: bytes, offset: int) -> tuple[Images, int]:
    """One `$request_input` -> images, and the offset after its binary data (if any)."""
    if not isinstance(spec, dict):
        raise BadRequest("each input must be a JSON object")
    name = spec.get("name")
    if not isinstance(name, str):
        raise BadRequest("each input needs a string 'name'")
    where = f"input '{name[:64]}'"
    datatype, shape = spec.get("datatype"), spec.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise BadRequest(f"{where} needs a 'shape' of non-negative integers")
    # NOTE: the element count is computed only once the rank is checked (at most 4 dims), in
    # Python integers: np.prod overflows int64 (or raises) on shapes a client may send.
    params = _parameters(spec, where)
    size = params.get("binary_data_size")
    raw = None
    if size is not None:
        if not _is_int(size) or size < 0:
            raise BadRequest(f"{where}: binary_data_size must be a non-negative integer")
        if "data" in spec:
            raise BadRequest(f"{where} has both 'data' and binary_data_size")
        if offset + size > len(binary):
            raise BadRequest(f"{where}: binary_data_size {size} runs past the end of the body "
                             f"({len(binary) - offset} bytes left after the JSON header)")
        raw = binary[offset:offset + size]
        offset += size
    elif "data" not in spec:
        raise BadRequest(f"{where} has neither 'data' nor a binary_data_size parameter")

    if datatype == "BYTES":
        if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
            raise BadRequest(f"{where}: a BYTES input holds one encoded image per element, shape "
                             f"[N] or [N, 1]; got {shape}")
        count = math.prod(shape)
        if raw is not None:
            encoded = _split_bytes_elements(raw, where)
        else:
            encoded = []
            for i, element in enumerate(_flatten(spec["data"])):
                if isinstance(element, dict) and set(element) == {"b64"}:
                    element = element["b64"]
                encoded.append(b64decode(element, f"{where} element {i}"))
        if len(encoded) != count:
            raise BadRequest(f"{where} has {len(encoded)} elements, its shape {shape} says "
                             f"{count}")
        return Images(encoded=encoded), offset
    if datatype == "FP32":
        if tuple(shape[1:]) != ARRAY_SHAPE or len(shape) != 4:
            raise BadRequest(f"{where}: an FP32 input is preprocessed images of shape "
                             f"{_SHAPE_TEXT}, got {shape}")
        count = math.prod(shape)
        if raw is not None:
            if len(raw) != count * 4:
                raise BadRequest(f"{where}: binary_data_size is {len(raw)} bytes, shape {shape} "
                                 f"of FP32 needs {count * 4}")
            array = np.frombuffer(raw, dtype="<f4")
        else:
            array = float_array(spec["data"], f"{where} data")
            if array.size != count:
                raise BadRequest(f"{where} has {array.size} values, its shape {shape} says "
                                 f"{count}")
        return Images(arrays=array.reshape(shape)), offset
    raise BadRequest(f"{where} has datatype {str(datatype)[:16]!r}: send BYTES (encoded images, "
                     f"shape [N]) or FP32 (preprocessed, shape {_SHAPE_TEXT})")


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """An OIP v2 `$inference_request`, with the binary tensor extension when `header_length`
    (the `Inference-Header-Content-Length` header) is given. Raises BadRequest."""
    if header_length is not None:
        if not is_number(header_length.strip()) or int(header_length) > len(body):
            raise BadRequest(f"{HEADER_LENGTH} must be the JSON header's length in bytes, at "
                             f"most the body's {len(body)}; got '{header_length[:32]}'")
        split = int(header_length)
        header, binary = body[:split], body[split:]
    else:
        header, binary = body, b""
    obj = parse_json_object(header, "inference request")
    request_id = obj.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    params = _parameters(obj, "the request's")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise BadRequest("binary_data_output must be true or false")
    inputs = obj.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1:
        got = len(inputs) if isinstance(inputs, list) else "no list of"
        raise BadRequest(f"'inputs' must list exactly one input ({BYTES_INPUT!r} BYTES [N] or "
                         f"{ARRAY_INPUT!r} FP32 {_SHAPE_TEXT}); got {got} inputs")
    images, used = _input_images(inputs[0], binary, 0)
    if used != len(binary):
        raise BadRequest(f"{len(binary) - used} bytes after the JSON header belong to no input's "
                         f"binary_data_size")

    wanted = obj.get("outputs")
    if wanted is None:
        return InferRequest(request_id, images, (OutputRequest(binary_default, None),))
    if not isinstance(wanted, list) or not wanted:
        raise BadRequest("'outputs' must be a non-empty list when given")
    outputs = []
    for spec in wanted:
        if not isinstance(spec, dict) or spec.get("name") != OUTPUT:
            name = spec.get("name") if isinstance(spec, dict) else spec
            raise BadRequest(f"unknown output {str(name)[:64]!r}: this model has {OUTPUT!r}")
        out_params = _parameters(spec, f"output {OUTPUT!r}")
        as_binary = out_params.get("binary_data", binary_default)
        if not isinstance(as_binary, bool):
            raise BadRequest("binary_data must be true or false")
        k = out_params.get("classification")
        if k is not None and (not _is_int(k) or k < 1):
            raise BadRequest(f"classification must be an integer >= 1, got {str(k)[:32]}")
        outputs.append(OutputRequest(as_binary, k))
    return InferRequest(request_id, images, tuple(outputs))


def _serialize_bytes(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def infer_response(head: Head, request: InferRequest,
                   predictions: list[Prediction]) -> tuple[bytes, bytes]:
    """The `$inference_response` JSON, and the binary tensor data that follows it (maybe b"")."""
    probabilities = np.stack([p.probabilities for p in predictions])  # [N, n]
    outputs, blobs = [], []
    for wanted in request.outputs:
        if wanted.classification is None:
            entry = {"name": OUTPUT, "datatype": "FP32", "shape": list(probabilities.shape)}
            if wanted.binary:
                blobs.append(probabilities.astype("<f4").tobytes())
            else:
                entry["data"] = probabilities.ravel().tolist()
        else:
            # Triton's classification extension: "value:index:label", best first, per row;
            # the value as the shortest text that reads back as the same float32.
            strings = [[f"{str(row[i])}:{i}:{head.labels[i]}"
                        for i in top_indices(row, wanted.classification)]
                       for row in probabilities]
            entry = {"name": OUTPUT, "datatype": "BYTES",
                     "shape": [len(strings), len(strings[0])]}
            if wanted.binary:
                blobs.append(_serialize_bytes([s.encode() for row in strings for s in row]))
            else:
                entry["data"] = [s for row in strings for s in row]
        if wanted.binary:
            entry["parameters"] = {"binary_data_size": len(blobs[-1])}
        outputs.append(entry)
    body = {"model_name": head.bot_id, "model_version": str(head.version)}
    if request.id is not None:
        body["id"] = request.id
    body["outputs"] = outputs
    return json.dumps(body).encode(), b"".join(blobs)


async def server_metadata(service: Service, request: Request) -> Reply:
    return json_reply({"name": SERVER_NAME, "version": server_version(),
                       "extensions": list(EXTENSIONS)})


async def server_live(service: Service, request: Request) -> Reply:
    return json_reply({"live": True})


async def server_ready(service: Service, request: Request) -> Reply:
    ready = service.readiness.ready
    return json_reply({"ready": ready}, status=200 if ready else 503)


def _tensor(name: str, datatype: str, shape: list[int]) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape}


async def model_metadata(service: Service, request: Request) -> Reply:
    info = await active_info(service, request)
    return json_reply({
        "name": info.bot_id,
        "versions": [str(info.version)],
        "platform": PLATFORM,
        # Either input, not both: the request's one input is recognised by its datatype.
        "inputs": [_tensor(BYTES_INPUT, "BYTES", [-1]),
                   _tensor(ARRAY_INPUT, "FP32", [-1, *ARRAY_SHAPE])],
        "outputs": [_tensor(OUTPUT, "FP32", [-1, info.n_classes])],
    })


async def model_ready(service: Service, request: Request) -> Reply:
    bot_id = request.params["bot_id"]
    try:
        service.require_engine()
        head = await active_head(service, request)
    except (NotReady, HeadUnavailable):
        return json_reply({"name": bot_id, "ready": False}, status=503)
    return json_reply({"name": head.bot_id, "ready": True})


async def infer(service: Service, request: Request) -> Reply:
    service.require_engine()  # 503 before any work while the trunk loads
    head = await active_head(service, request)
    body = await request.body()
    # Parsing megabytes of JSON numbers takes a while: off the event loop.
    parsed = await service.run_blocking(parse_infer_request, body, request.header(HEADER_LENGTH))
    predictions = await classify_with(service, head, parsed.images, top_k=1)
    header, blobs = infer_response(head, parsed, predictions)
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
                                   "description": "every output as binary data by default"}}},
        "inputs": {
            "type": "array", "minItems": 1, "maxItems": 1,
            "description": f"one input: {BYTES_INPUT!r} BYTES [N] (encoded images, base64 in "
                           f"JSON) or {ARRAY_INPUT!r} FP32 {_SHAPE_TEXT} (preprocessed to "
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
            Endpoint("GET", path, f"oip_model_metadata{suffix}", model_metadata,
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
            Endpoint("GET", f"{path}/ready", f"oip_model_ready{suffix}", model_ready,
                     summary="OIP v2 model readiness of a bot", tag="oip-v2", path_params=params,
                     answers={200: json_answer("ready", _MODEL_READY),
                              503: json_answer("the trunk is loading, or the head cannot be "
                                               "loaded", _MODEL_READY)},
                     errors=_MODEL_ERRORS),
            Endpoint("POST", f"{path}/infer", f"oip_infer{suffix}", infer,
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
    Endpoint("GET", "/v2", "oip_server_metadata", server_metadata,
             summary="OIP v2 server metadata", tag="oip-v2",
             answers={200: json_answer("the server", {
                 "type": "object", "required": ["name", "version", "extensions"],
                 "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                "extensions": {"type": "array",
                                               "items": {"type": "string"}}}})}),
    Endpoint("GET", "/v2/health/live", "oip_server_live", server_live,
             summary="OIP v2 liveness", tag="oip-v2",
             answers={200: json_answer("live", {
                 "type": "object", "additionalProperties": False, "required": ["live"],
                 "properties": {"live": {"type": "boolean"}}})}),
    Endpoint("GET", "/v2/health/ready", "oip_server_ready", server_ready,
             summary="OIP v2 readiness", tag="oip-v2",
             answers={200: json_answer("ready", _READY),
                      503: json_answer("the trunk is loading, or failed to", _READY)}),
    *_model_endpoints(),
]
