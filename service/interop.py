"""Interop HTTP routes: the Open Inference Protocol v2 (KServe, Triton) and TF Serving's REST API.

Existing Triton / KServe / TF Serving clients work unchanged against a multihead server: a bot is
a "model", and its active version is the only version served. Every request still goes through
the same `Engine` as the native routes (cross-bot batching, feature cache, deadlines, limits).

Open Inference Protocol v2, with Triton's `binary_tensor_data` and `classification` extensions:

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
  returns.

TensorFlow Serving REST:

    GET  /v1/models/{bot}[/versions/{v}]            model status
    GET  /v1/models/{bot}[/versions/{v}]/metadata   signature_def of `serving_default`
    POST /v1/models/{bot}[/versions/{v}]:predict    row ("instances") or columnar ("inputs")

  An image is `{"b64": "..."}` (encoded bytes) or a nested list [299, 299, 3] (preprocessed),
  either bare or under one input name (`{"image_bytes": {"b64": ...}}`). Each prediction has
  `probabilities` (all classes), `classes` and `scores` (the top `?top_k=`, default from the
  settings).

Errors keep the app's `{"error": "...", "code": "..."}` body, which is what both protocols
expect (`{"error": $string}`) plus a field clients ignore.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from backbone import IMAGE_SIZE
from heads import BotInfo, Head, UnknownVersion
from service.app import (RUNTIME, SETTINGS, STORE, _deadline, _engine, _head, _top_k)
from service.engine import Prediction, top_indices
from service.errors import BadRequest, HeadUnavailable, NotReady

SERVER_NAME = "multihead"
EXTENSIONS = ("binary_tensor_data", "classification")
PLATFORM = "multihead_inception_v4"
BYTES_INPUT = "image_bytes"  # BYTES [N]: encoded images (JPEG, PNG, ...)
ARRAY_INPUT = "images"  # FP32 [N, 299, 299, 3] in [-1, 1]
OUTPUT = "probabilities"  # FP32 [N, n]
ARRAY_SHAPE = (IMAGE_SIZE, IMAGE_SIZE, 3)
HEADER_LENGTH = "Inference-Header-Content-Length"
SIGNATURE = "serving_default"


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("multihead")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Images:
    """The images of one request: encoded bytes, or float32 [N, 299, 299, 3] preprocessed."""

    encoded: list[bytes] | None = None
    arrays: np.ndarray | None = None


# -- shared by both protocols ----------------------------------------------------------------

def _check_version(bot_id: str, active: int, raw: str | None) -> None:
    """A version in the path must be the bot's active one: only that one is served."""
    if raw is None:
        return
    if not raw.isdigit():
        raise BadRequest(f"model version must be a number, got '{raw[:32]}'")
    if int(raw) != active:
        raise UnknownVersion(f"bot '{bot_id}' version {int(raw)} is not served: only its active "
                             f"version {active} is")


async def _info(request: web.Request) -> BotInfo:
    """The registry's view of the bot in the path (no head load), version checked."""
    loop = asyncio.get_running_loop()
    info = await loop.run_in_executor(None, request.app[STORE].info, request.match_info["bot_id"])
    _check_version(info.bot_id, info.version, request.match_info.get("version"))
    return info


async def _active_head(request: web.Request) -> Head:
    head = await _head(request, request.match_info["bot_id"])
    _check_version(head.bot_id, head.version, request.match_info.get("version"))
    return head


async def _classify(request: web.Request, head: Head, images: Images,
                    top_k: int) -> list[Prediction]:
    engine = _engine(request)
    deadline = _deadline(request.app[SETTINGS])
    if images.arrays is not None:
        results = await engine.classify_arrays(images.arrays, [head], top_k=top_k,
                                               deadline=deadline)
    else:
        results = await engine.classify(images.encoded, [head], top_k=top_k, deadline=deadline)
    return [r[0] for r in results]


def _b64(value: Any, where: str) -> bytes:
    """Standard or URL-safe base64 text -> bytes."""
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a base64 string, got {type(value).__name__}")
    altchars = b"-_" if ("-" in value or "_" in value) else None
    try:
        return base64.b64decode(value, altchars=altchars, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where} is not valid base64") from None


def _float_images(data: Any, where: str) -> np.ndarray:
    """JSON numbers (flat or nested) -> float32 array; the shape is checked by the caller."""
    try:
        return np.asarray(data, dtype=np.float32)
    except (TypeError, ValueError):
        raise BadRequest(f"{where} must be numbers (flat, or nested to the same depth)") \
            from None


def _parse_json(raw: bytes | str, what: str) -> dict:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(f"{what} is not valid JSON") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"{what} must be a JSON object")
    return obj


# -- Open Inference Protocol v2 --------------------------------------------------------------

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
    count = int(np.prod(shape, dtype=np.int64))
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
        if raw is not None:
            encoded = _split_bytes_elements(raw, where)
        else:
            encoded = []
            for i, element in enumerate(_flatten(spec["data"])):
                if isinstance(element, dict) and set(element) == {"b64"}:
                    element = element["b64"]
                encoded.append(_b64(element, f"{where} element {i}"))
        if len(encoded) != count:
            raise BadRequest(f"{where} has {len(encoded)} elements, its shape {shape} says "
                             f"{count}")
        return Images(encoded=encoded), offset
    if datatype == "FP32":
        if tuple(shape[1:]) != ARRAY_SHAPE or len(shape) != 4:
            raise BadRequest(f"{where}: an FP32 input is preprocessed images of shape "
                             f"[N, {IMAGE_SIZE}, {IMAGE_SIZE}, 3], got {shape}")
        if raw is not None:
            if len(raw) != count * 4:
                raise BadRequest(f"{where}: binary_data_size is {len(raw)} bytes, shape {shape} "
                                 f"of FP32 needs {count * 4}")
            array = np.frombuffer(raw, dtype="<f4")
        else:
            array = _float_images(spec["data"], f"{where} data")
            if array.size != count:
                raise BadRequest(f"{where} has {array.size} values, its shape {shape} says "
                                 f"{count}")
        return Images(arrays=array.reshape(shape)), offset
    raise BadRequest(f"{where} has datatype {str(datatype)[:16]!r}: send BYTES (encoded images, "
                     f"shape [N]) or FP32 (preprocessed, shape [N, {IMAGE_SIZE}, {IMAGE_SIZE}, "
                     f"3])")


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """An OIP v2 `$inference_request`, with the binary tensor extension when `header_length`
    (the `Inference-Header-Content-Length` header) is given. Raises BadRequest."""
    if header_length is not None:
        if not header_length.strip().isdigit() or int(header_length) > len(body):
            raise BadRequest(f"{HEADER_LENGTH} must be the JSON header's length in bytes, at "
                             f"most the body's {len(body)}; got '{header_length[:32]}'")
        split = int(header_length)
        header, binary = body[:split], body[split:]
    else:
        header, binary = body, b""
    obj = _parse_json(header, "inference request")
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
                         f"{ARRAY_INPUT!r} FP32 [N, {IMAGE_SIZE}, {IMAGE_SIZE}, 3]); got {got} "
                         f"inputs")
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


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": SERVER_NAME, "version": _version(),
                              "extensions": list(EXTENSIONS)})


async def server_live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def server_ready(request: web.Request) -> web.Response:
    ready = request.app[RUNTIME].ready
    return web.json_response({"ready": ready}, status=200 if ready else 503)


def _tensor(name: str, datatype: str, shape: list[int]) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape}


async def model_metadata(request: web.Request) -> web.Response:
    info = await _info(request)
    return web.json_response({
        "name": info.bot_id,
        "versions": [str(info.version)],
        "platform": PLATFORM,
        # Either input, not both: the request's one input is recognised by its datatype.
        "inputs": [_tensor(BYTES_INPUT, "BYTES", [-1]),
                   _tensor(ARRAY_INPUT, "FP32", [-1, *ARRAY_SHAPE])],
        "outputs": [_tensor(OUTPUT, "FP32", [-1, info.n_classes])],
    })


async def model_ready(request: web.Request) -> web.Response:
    bot_id = request.match_info["bot_id"]
    try:
        head = await _active_head(request)
        _engine(request)
    except (NotReady, HeadUnavailable):
        return web.json_response({"name": bot_id, "ready": False}, status=503)
    return web.json_response({"name": head.bot_id, "ready": True})


async def infer(request: web.Request) -> web.Response:
    _engine(request)  # 503 before any work while the trunk loads
    head = await _active_head(request)
    body = await request.read()
    loop = asyncio.get_running_loop()
    # Parsing megabytes of JSON numbers takes a while: off the event loop.
    parsed = await loop.run_in_executor(None, parse_infer_request, body,
                                        request.headers.get(HEADER_LENGTH))
    predictions = await _classify(request, head, parsed.images, top_k=1)
    header, blobs = infer_response(head, parsed, predictions)
    if not blobs:
        return web.Response(body=header, content_type="application/json")
    return web.Response(body=header + blobs, content_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(len(header))})


# -- TensorFlow Serving REST -----------------------------------------------------------------

def _tf_tensor(name: str, dtype: str, shape: list[int]) -> dict:
    return {"dtype": dtype, "name": f"{name}:0",
            "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in shape],
                             "unknown_rank": False}}


def _tf_image(value: Any, where: str) -> bytes | np.ndarray:
    """`{"b64": ...}` -> encoded bytes; a nested list -> float32 [299, 299, 3]."""
    if isinstance(value, dict) and set(value) == {"b64"}:
        return _b64(value["b64"], f"{where} b64")
    if isinstance(value, list):
        image = _float_images(value, where)
        if image.shape != ARRAY_SHAPE:
            raise BadRequest(f"{where} is a float image of shape {list(image.shape)}, expected "
                             f"[{IMAGE_SIZE}, {IMAGE_SIZE}, 3] (preprocessed to [-1, 1])")
        return image
    if isinstance(value, str):
        raise BadRequest(f"{where} is a bare string: send image bytes as {{\"b64\": \"...\"}}")
    raise BadRequest(f"{where} must be {{\"b64\": \"...\"}} (encoded image) or a nested list "
                     f"[{IMAGE_SIZE}, {IMAGE_SIZE}, 3] (preprocessed image)")


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


async def tf_status(request: web.Request) -> web.Response:
    info = await _info(request)
    runtime = request.app[RUNTIME]
    state, status = "AVAILABLE", {"error_code": "OK", "error_message": ""}
    if runtime.error:
        state, status = "END", {"error_code": "UNAVAILABLE", "error_message": runtime.error}
    elif not runtime.ready:
        state = "LOADING"
    return web.json_response({"model_version_status": [
        {"version": str(info.version), "state": state, "status": status}]})


async def tf_metadata(request: web.Request) -> web.Response:
    info = await _info(request)
    signature = {
        # Either input, not both: a request carries one of them.
        "inputs": {BYTES_INPUT: _tf_tensor(BYTES_INPUT, "DT_STRING", [-1]),
                   ARRAY_INPUT: _tf_tensor(ARRAY_INPUT, "DT_FLOAT", [-1, *ARRAY_SHAPE])},
        "outputs": {OUTPUT: _tf_tensor(OUTPUT, "DT_FLOAT", [-1, info.n_classes]),
                    "classes": _tf_tensor("classes", "DT_STRING", [-1, -1]),
                    "scores": _tf_tensor("scores", "DT_FLOAT", [-1, -1])},
        "method_name": "tensorflow/serving/predict",
    }
    return web.json_response({
        "model_spec": {"name": info.bot_id, "signature_name": "", "version": str(info.version)},
        "metadata": {"signature_def": {"signature_def": {SIGNATURE: signature}}},
    })


async def tf_call(request: web.Request) -> web.Response:
    verb = request.match_info["verb"]
    if verb != "predict":
        raise web.HTTPNotFound(reason=f"':{verb[:32]}' is not served: use ':predict'")
    _engine(request)
    head = await _active_head(request)
    top_k = _top_k(request)
    body = await request.read()
    loop = asyncio.get_running_loop()
    images, columnar = await loop.run_in_executor(
        None, lambda: parse_predict_request(_parse_json(body, "predict request")))
    predictions = await _classify(request, head, images, top_k=top_k)
    rows = [{OUTPUT: p.probabilities.tolist(),
             "classes": [label for label, _ in p.labels_scores],
             "scores": [score for _, score in p.labels_scores]} for p in predictions]
    if columnar:
        return web.json_response({"outputs": {name: [row[name] for row in rows]
                                              for name in (OUTPUT, "classes", "scores")}})
    return web.json_response({"predictions": rows})


# -- routes ----------------------------------------------------------------------------------

_BOT = "{bot_id:[^{}/:]+}"
_VERSION = "{version:[^{}/:]+}"


def add_interop_routes(app: web.Application) -> None:
    """Adds the OIP v2 (`/v2/...`) and TF Serving (`/v1/models/...`) routes to `app`."""
    router = app.router
    router.add_get("/v2", server_metadata)
    router.add_get("/v2/health/live", server_live)
    router.add_get("/v2/health/ready", server_ready)
    for model in (f"/v2/models/{_BOT}", f"/v2/models/{_BOT}/versions/{_VERSION}"):
        router.add_get(model, model_metadata)
        router.add_get(f"{model}/ready", model_ready)
        router.add_post(f"{model}/infer", infer)
    for model in (f"/v1/models/{_BOT}", f"/v1/models/{_BOT}/versions/{_VERSION}"):
        router.add_get(model, tf_status)
        router.add_get(f"{model}/metadata", tf_metadata)
        router.add_post(model + ":{verb}", tf_call)
