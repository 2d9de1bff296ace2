"""Open Inference Protocol v2 requests and results as data: parsed from REST's JSON (with
Triton's binary tensor extension) or built by the gRPC transport from its messages, and
rendered back. The endpoints that use them are `service.codecs.oip`'s.

One input, recognised by its datatype (any name is accepted):
  `image_bytes` BYTES [N] (or [N, 1]): encoded images, base64 strings in JSON `data`, or raw
      through the binary extension (each element: 4-byte little-endian length, then bytes);
  `images` FP32 [N, 299, 299, 3]: images already preprocessed to [-1, 1] (JSON `data` flat or
      nested, or little-endian binary).
One output, `probabilities` FP32 [N, n] in class index order; with `"classification": k` in
its parameters it is BYTES [N, min(k, n)] of "score:index:label" strings instead, as Triton
returns (Triton's `classification` extension).

A request's `route_key` parameter (a string) is its routing key for a bot's canary
(`service.core.candidates`); it wins over the `X-Multihead-Route-Key` header.

What both transports share: the typed request and result (`InferRequest`, `InferResult`), the
neutral input `Tensor` and its rules (`check_one_input`, `check_shape`, `tensor_images`,
`output_request`, `route_key_parameter`); REST alone parses its body (`parse_infer_request`) and
renders its answer (`infer_response`). Pure code: no service, no web framework.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backbone.spec import INPUT
from heads import Head, top_indices
from service.codecs.common import b64decode, float_array, is_number, parse_json_object
from service.core import deadlines
from service.core.candidates import MAX_ROUTE_KEY_CHARS, ROUTE_KEY_PARAMETER
from service.core.engine import Images, Prediction
from service.core.errors import BadRequest

# An inference request's parameter (REST and gRPC): its deadline, in ms from now.
DEADLINE_PARAMETER = "deadline_ms"

BYTES_INPUT = "image_bytes"  # BYTES [N]: encoded images (JPEG, PNG, ...)
ARRAY_INPUT = "images"  # FP32 [N, 299, 299, 3] in [-1, 1]
OUTPUT = "probabilities"  # FP32 [N, n]
ARRAY_SHAPE = INPUT.shape
HEADER_LENGTH = "Inference-Header-Content-Length"
# How messages and the API description write the FP32 input's shape.
SHAPE_TEXT = f"[N, {', '.join(map(str, ARRAY_SHAPE))}]"


@dataclass(frozen=True)
class OutputRequest:
    """One requested output: as binary data or JSON (REST), and as top-`classification`
    strings."""

    binary: bool
    classification: int | None


@dataclass(frozen=True)
class InferRequest:
    """A parsed inference request, whatever carried it (`route_key`: its routing key for a
    canary, from its `route_key` parameter)."""

    id: str | None
    images: Images
    outputs: tuple[OutputRequest, ...]
    route_key: str | None = None
    deadline_ms: float | None = None  # its `deadline_ms` parameter (`deadline_parameter`)


@dataclass(frozen=True)
class Tensor:
    """One input tensor in a form both transports produce; its data is in exactly one of:

    Attributes:
        raw: the binary encoding (REST's binary extension, gRPC's raw_input_contents): FP32
            little-endian, or BYTES as (uint32 little-endian length, bytes) per element.
        elements: BYTES elements already as bytes (gRPC's bytes_contents).
        data: REST's JSON `data`, flat or nested: base64 strings (BYTES) or numbers (FP32);
            gRPC's fp32_contents as numbers too.
    """

    name: str
    datatype: Any
    shape: Sequence[int]
    raw: bytes | None = None
    elements: Sequence[bytes] | None = None
    data: Any = None


@dataclass(frozen=True)
class OutputTensor:
    """One output of a result: `probabilities` FP32 [N, n], or BYTES [N, k] of
    "score:index:label" strings (row-major in `values`)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: np.ndarray | list[str]
    binary: bool  # what the request asked for REST's body (gRPC always carries raw data)

    def raw(self) -> bytes:
        """The binary encoding of the values (as `Tensor.raw`)."""
        if self.datatype == "FP32":
            return np.asarray(self.values).astype("<f4").tobytes()
        return _serialize_bytes([s.encode() for s in self.values])

    def data(self) -> list:
        """The values as REST's JSON `data` (flat, row-major)."""
        if self.datatype == "FP32":
            return np.asarray(self.values).ravel().tolist()
        return list(self.values)


@dataclass(frozen=True)
class InferResult:
    """An answered inference request, whatever carries it back."""

    model_name: str
    model_version: str
    id: str | None
    outputs: tuple[OutputTensor, ...]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parameters(obj: dict, where: str) -> dict:
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where} 'parameters' must be a JSON object")
    return params


def route_key_parameter(params: dict) -> str | None:
    """The request's `route_key` parameter: a string of at most MAX_ROUTE_KEY_CHARS, or
    None (absent or empty). Raises BadRequest."""
    value = params.get(ROUTE_KEY_PARAMETER)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > MAX_ROUTE_KEY_CHARS:
        raise BadRequest(f"the '{ROUTE_KEY_PARAMETER}' parameter must be a string of at most "
                         f"{MAX_ROUTE_KEY_CHARS} characters")
    return value


def deadline_parameter(params: dict) -> float | None:
    """The request's `deadline_ms` parameter, or None. The codec that runs the request
    tightens the request's deadline with it (`service.core.deadlines.tighten`, in the
    request's task: a parse may run in a thread). Raises InvalidDeadline (400
    invalid_deadline) when it is not a number of ms in range."""
    value = params.get(DEADLINE_PARAMETER)
    if value is None:
        return None
    return deadlines.parse_ms(value, f"parameters.{DEADLINE_PARAMETER}")


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


def input_where(name: str) -> str:
    """How messages name an input."""
    return f"input '{name[:64]}'"


def check_shape(shape: Any, where: str) -> None:
    if not isinstance(shape, list | tuple) or not all(_is_int(d) and d >= 0 for d in shape):
        raise BadRequest(f"{where} needs a 'shape' of non-negative integers")


def check_one_input(count: Any) -> None:
    """The request's inputs: exactly one (`count`: how many, or None when not a list)."""
    if count != 1:
        got = count if count is not None else "no list of"
        raise BadRequest(f"'inputs' must list exactly one input ({BYTES_INPUT!r} BYTES [N] or "
                         f"{ARRAY_INPUT!r} FP32 {SHAPE_TEXT}); got {got} inputs")


def tensor_images(tensor: Tensor) -> Images:
    """The images of the one input tensor: BYTES [N] / [N, 1] encoded images, or FP32
    [N, 299, 299, 3] preprocessed ones. The shape is checked by `check_shape` first."""
    where, shape = input_where(tensor.name), list(tensor.shape)
    # NOTE: the element count is computed only once the rank is checked (at most 4 dims), in
    # Python integers: np.prod overflows int64 (or raises) on shapes a client may send.
    if tensor.datatype == "BYTES":
        if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
            raise BadRequest(f"{where}: a BYTES input holds one encoded image per element, shape "
                             f"[N] or [N, 1]; got {shape}")
        count = math.prod(shape)
        if tensor.raw is not None:
            encoded = _split_bytes_elements(tensor.raw, where)
        elif tensor.elements is not None:
            encoded = list(tensor.elements)
        else:
            encoded = []
            for i, element in enumerate(_flatten(tensor.data)):
                if isinstance(element, dict) and set(element) == {"b64"}:
                    element = element["b64"]
                encoded.append(b64decode(element, f"{where} element {i}"))
        if len(encoded) != count:
            raise BadRequest(f"{where} has {len(encoded)} elements, its shape {shape} says "
                             f"{count}")
        return Images(encoded=encoded)
    if tensor.datatype == "FP32":
        if tuple(shape[1:]) != ARRAY_SHAPE or len(shape) != 4:
            raise BadRequest(f"{where}: an FP32 input is preprocessed images of shape "
                             f"{SHAPE_TEXT}, got {shape}")
        count = math.prod(shape)
        if tensor.raw is not None:
            if len(tensor.raw) != count * 4:
                raise BadRequest(f"{where}: binary_data_size is {len(tensor.raw)} bytes, shape "
                                 f"{shape} of FP32 needs {count * 4}")
            array = np.frombuffer(tensor.raw, dtype="<f4")
        else:
            array = float_array(tensor.data, f"{where} data")
            if array.size != count:
                raise BadRequest(f"{where} has {array.size} values, its shape {shape} says "
                                 f"{count}")
        return Images(arrays=array.reshape(shape))
    raise BadRequest(f"{where} has datatype {str(tensor.datatype)[:16]!r}: send BYTES (encoded "
                     f"images, shape [N]) or FP32 (preprocessed, shape {SHAPE_TEXT})")


def _unknown_output(name: Any) -> BadRequest:
    return BadRequest(f"unknown output {str(name)[:64]!r}: this model has {OUTPUT!r}")


def output_request(name: Any, params: dict, binary_default: bool) -> OutputRequest:
    """One requested output by name and parameters (`binary_data`, `classification`)."""
    if name != OUTPUT:
        raise _unknown_output(name)
    as_binary = params.get("binary_data", binary_default)
    if not isinstance(as_binary, bool):
        raise BadRequest("binary_data must be true or false")
    k = params.get("classification")
    if k is not None and (not _is_int(k) or k < 1):
        raise BadRequest(f"classification must be an integer >= 1, got {str(k)[:32]}")
    return OutputRequest(as_binary, k)


def _json_input(spec: Any, binary: bytes, offset: int) -> tuple[Tensor, int]:
    """One JSON `$request_input` -> its tensor, and the offset after its binary data (if any)."""
    if not isinstance(spec, dict):
        raise BadRequest("each input must be a JSON object")
    name = spec.get("name")
    if not isinstance(name, str):
        raise BadRequest("each input needs a string 'name'")
    where = input_where(name)
    shape = spec.get("shape")
    check_shape(shape, where)
    params = _parameters(spec, where)
    size = params.get("binary_data_size")
    if size is None:
        if "data" not in spec:
            raise BadRequest(f"{where} has neither 'data' nor a binary_data_size parameter")
        return Tensor(name, spec.get("datatype"), shape, data=spec["data"]), offset
    if not _is_int(size) or size < 0:
        raise BadRequest(f"{where}: binary_data_size must be a non-negative integer")
    if "data" in spec:
        raise BadRequest(f"{where} has both 'data' and binary_data_size")
    if offset + size > len(binary):
        raise BadRequest(f"{where}: binary_data_size {size} runs past the end of the body "
                         f"({len(binary) - offset} bytes left after the JSON header)")
    return (Tensor(name, spec.get("datatype"), shape, raw=binary[offset:offset + size]),
            offset + size)


def parse_infer_request(body: bytes, header_length: str | None) -> InferRequest:
    """An OIP v2 `$inference_request`, with the binary tensor extension when `header_length`
    (the `Inference-Header-Content-Length` header) is given. Raises BadRequest."""
    if header_length is not None:
        # Optional whitespace around a header value is spaces and tabs (RFC 9110): `str.strip()`
        # also takes '\x1c'-'\x1f', which `int()` then refuses (a ValueError, not a 400).
        raw = header_length.strip(" \t")
        if not is_number(raw) or int(raw) > len(body):
            raise BadRequest(f"{HEADER_LENGTH} must be the JSON header's length in bytes, at "
                             f"most the body's {len(body)}; got '{header_length[:32]}'")
        split = int(raw)
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
    key = route_key_parameter(params)
    deadline_ms = deadline_parameter(params)
    inputs = obj.get("inputs")
    check_one_input(len(inputs) if isinstance(inputs, list) else None)
    tensor, used = _json_input(inputs[0], binary, 0)
    images = tensor_images(tensor)
    if used != len(binary):
        raise BadRequest(f"{len(binary) - used} bytes after the JSON header belong to no input's "
                         f"binary_data_size")

    wanted = obj.get("outputs")
    if wanted is None:
        return InferRequest(request_id, images, (OutputRequest(binary_default, None),), key,
                            deadline_ms)
    if not isinstance(wanted, list) or not wanted:
        raise BadRequest("'outputs' must be a non-empty list when given")
    outputs = []
    for spec in wanted:
        if not isinstance(spec, dict):
            raise _unknown_output(spec)
        name = spec.get("name")
        params = _parameters(spec, f"output {OUTPUT!r}") if name == OUTPUT else {}
        outputs.append(output_request(name, params, binary_default))
    return InferRequest(request_id, images, tuple(outputs), key, deadline_ms)


def _serialize_bytes(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def infer_result(head: Head, request: InferRequest,
                 predictions: list[Prediction]) -> InferResult:
    """The answer to `request`: each requested output of every image's prediction, named by
    the version that answered (`head`'s, or its bot's canary candidate's: every image of a
    request is answered by the same one)."""
    labels = predictions[0].labels or head.labels
    probabilities = np.stack([p.probabilities for p in predictions])  # [N, n]
    outputs = []
    for wanted in request.outputs:
        if wanted.classification is None:
            outputs.append(OutputTensor(OUTPUT, "FP32", probabilities.shape, probabilities,
                                        wanted.binary))
            continue
        # Triton's classification extension: "value:index:label", best first, per row;
        # the value as the shortest text that reads back as the same float32.
        rows = [[f"{str(row[i])}:{i}:{labels[i]}"
                 for i in top_indices(row, wanted.classification)] for row in probabilities]
        outputs.append(OutputTensor(OUTPUT, "BYTES", (len(rows), len(rows[0])),
                                    [s for row in rows for s in row], wanted.binary))
    return InferResult(head.bot_id, str(predictions[0].version), request.id, tuple(outputs))


def infer_response(result: InferResult) -> tuple[bytes, bytes]:
    """REST: the `$inference_response` JSON, and the binary tensor data that follows it (maybe
    b"")."""
    outputs, blobs = [], []
    for output in result.outputs:
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype,
                                 "shape": list(output.shape)}
        if output.binary:
            blobs.append(output.raw())
            entry["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            entry["data"] = output.data()
        outputs.append(entry)
    body: dict[str, Any] = {"model_name": result.model_name,
                            "model_version": result.model_version}
    if result.id is not None:
        body["id"] = result.id
    body["outputs"] = outputs
    return json.dumps(body).encode(), b"".join(blobs)
