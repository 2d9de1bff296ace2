"""The gRPC column of `test_same_answers`: a row's REST request as the RPC that is its twin, and
the RPC's answer as the REST body it stands for.

gRPC has no URL routes. A row is routed as REST routes it (`Router` over the endpoint table);
an endpoint whose twin is an RPC (`RPC_OF_ENDPOINT`, written here, not read from the product,
so that a product label gone wrong shows as a wrong metrics label) becomes that RPC with the
same model, version and content: OIP JSON inputs as typed contents (a BYTES input's base64
elements as its `bytes_contents`), TF Serving `instances` of `{"b64": ...}` as a DT_STRING
tensor, `?top_k=` as the call's `top_k` metadata (as `service.transports.grpc.tfserving`
reads it). A request with no message form (a body that is not JSON, an endpoint without an
RPC twin, a route no endpoint matches) has no gRPC column: `rpc_of` gives None. A feature of a
REST request this mapping does not carry yet raises NotImplementedError, so a new row cannot
silently lose its gRPC column.

The response becomes the JSON REST answers for the same content (`Rpc.as_rest`): tensors
through Triton's own `InferResult` (raw contents decoded by the client, as users read them) and
TensorFlow's `make_ndarray`, enums by name, int64 versions and sizes as REST's strings where
TF Serving's REST (JSON-mapped protos) has strings.
"""
from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import grpc
import tensorflow as tf
import tritonclient.grpc as triton
from google.protobuf.message import Message
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from service.codecs.routes import ENDPOINTS
from service.transports.common.router import Router
from service.transports.grpc.tfserving import DT_STRING

# REST endpoint (without `_version`) -> (gRPC service, RPC): the twins the column drives.
RPC_OF_ENDPOINT = {
    "oip_server_live": ("kserve", "ServerLive"),
    "oip_server_ready": ("kserve", "ServerReady"),
    "oip_server_metadata": ("kserve", "ServerMetadata"),
    "oip_model_ready": ("kserve", "ModelReady"),
    "oip_model_metadata": ("kserve", "ModelMetadata"),
    "oip_infer": ("kserve", "ModelInfer"),
    "tfs_predict": ("prediction", "Predict"),  # `:classify` and `:regress` as theirs
    "tfs_metadata": ("prediction", "GetModelMetadata"),
    "tfs_status": ("model", "GetModelStatus"),
}
TFS_VERBS = {"predict": "Predict", "classify": "Classify", "regress": "Regress"}
VERSIONED = "_version"
TIMEOUT_S = 60.0
_ROUTER = Router(ENDPOINTS)


@dataclass(frozen=True)
class Rpc:
    """One call: `service`'s `name` with `request` and `metadata`; `as_rest` reads its response
    as the JSON REST answers."""

    service: str
    name: str
    request: Message
    metadata: tuple[tuple[str, str], ...] = ()
    as_rest: Callable[[Any], Any] = lambda response: None


@dataclass(frozen=True)
class Outcome:
    """What the call answered: the status code's name, the trailing metadata, and the REST body
    it stands for (the error's message and domain code for a failed call)."""

    code: str
    trailing: dict[str, str]
    body: Any


def stubs(channel: grpc.aio.Channel) -> dict[str, Any]:
    return {"kserve": pb_grpc.GRPCInferenceServiceStub(channel),
            "prediction": prediction_service_pb2_grpc.PredictionServiceStub(channel),
            "model": model_service_pb2_grpc.ModelServiceStub(channel)}


async def call(stub_of: Mapping[str, Any], rpc: Rpc, code_key: str) -> Outcome:
    """Runs `rpc`; a failed call's body is `{"error": details, "code": <code_key metadata>}`
    (no `code` when the trailing metadata has none, as when gRPC refused the call itself)."""
    method = getattr(stub_of[rpc.service], rpc.name)
    try:
        response = await method(rpc.request, metadata=rpc.metadata, timeout=TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        trailing = {key: value for key, value in exc.trailing_metadata() or ()}
        body = {"error": exc.details()}
        if code_key in trailing:
            body["code"] = trailing[code_key]
        return Outcome(exc.code().name, trailing, body)
    return Outcome(grpc.StatusCode.OK.name, {}, rpc.as_rest(response))


def rpc_of(method: str, target: str, body: bytes | None) -> Rpc | None:
    """The RPC twin of a REST request, or None when it has none (see the module doc)."""
    url = urlsplit(target)
    match = _ROUTER.match(method, url.path)
    if match.endpoint is None:
        return None
    twin = RPC_OF_ENDPOINT.get(match.endpoint.name.removesuffix(VERSIONED))
    if twin is None:
        return None
    service, name = twin
    params = match.params
    query = parse_qsl(url.query, keep_blank_values=True)
    return _BUILDERS[name](service, name, params, query, body)


# -- KServe v2 ---------------------------------------------------------------------------------

def _no_query(query, what: str) -> None:
    if query:
        raise NotImplementedError(f"the gRPC column has no form for the query of {what}")


def _server_rpc(message: type[Message], as_rest) -> Callable[..., Rpc]:
    def build(service, name, params, query, body) -> Rpc:
        _no_query(query, name)
        return Rpc(service, name, message(), as_rest=as_rest)

    return build


def _model_ready(service, name, params, query, body) -> Rpc:
    _no_query(query, name)
    request = pb.ModelReadyRequest(name=params["bot_id"], version=params.get("version", ""))
    # REST names the model as asked (`service.codecs.oip.model_ready`); gRPC answers `ready`.
    return Rpc(service, name, request,
               as_rest=lambda r: {"name": request.name, "ready": r.ready})


def _tensor_metadata(tensors) -> list[dict]:
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors]


def _model_metadata(service, name, params, query, body) -> Rpc:
    _no_query(query, name)
    return Rpc(service, name,
               pb.ModelMetadataRequest(name=params["bot_id"], version=params.get("version", "")),
               as_rest=lambda r: {"name": r.name, "versions": list(r.versions),
                                  "platform": r.platform, "inputs": _tensor_metadata(r.inputs),
                                  "outputs": _tensor_metadata(r.outputs)})


def _json_body(body: bytes | None) -> dict | None:
    """The request body as a JSON object, or None when it is not one (no message form)."""
    try:
        obj = json.loads(body or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        raise NotImplementedError("the gRPC column maps valid base64 only") from None


def _infer_request(obj: dict, params: Mapping[str, str]) -> pb.ModelInferRequest:
    if set(obj) - {"id", "inputs", "outputs"}:
        raise NotImplementedError(f"the gRPC column maps OIP 'id', 'inputs' and 'outputs', "
                                  f"not {sorted(set(obj) - {'id', 'inputs', 'outputs'})}")
    request = pb.ModelInferRequest(model_name=params["bot_id"],
                                   model_version=params.get("version", ""),
                                   id=obj.get("id", ""))
    for spec in obj["inputs"]:
        if set(spec) != {"name", "datatype", "shape", "data"} or spec["datatype"] != "BYTES":
            raise NotImplementedError("the gRPC column maps JSON BYTES inputs only")
        tensor = request.inputs.add(name=spec["name"], datatype="BYTES", shape=spec["shape"])
        tensor.contents.bytes_contents.extend(_b64(e) for e in spec["data"])
    for spec in obj.get("outputs", ()):
        if set(spec) - {"name", "parameters"} or set(spec.get("parameters", {})) - {
                "classification"}:
            raise NotImplementedError("the gRPC column maps an output's name and "
                                      "'classification' only")
        output = request.outputs.add(name=spec["name"])
        if "classification" in spec.get("parameters", {}):
            output.parameters["classification"].int64_param = spec["parameters"][
                "classification"]
    return request


def _infer_rest(response: pb.ModelInferResponse) -> dict:
    """REST's JSON answer: each output's values as JSON `data` (strings for BYTES)."""
    result = triton.InferResult(response)
    body: dict[str, Any] = {"model_name": response.model_name,
                            "model_version": response.model_version}
    if response.id:
        body["id"] = response.id
    body["outputs"] = [
        {"name": o.name, "datatype": o.datatype, "shape": list(o.shape),
         "data": [v.decode() if isinstance(v, bytes) else v
                  for v in result.as_numpy(o.name).ravel().tolist()]}
        for o in response.outputs]
    return body


def _model_infer(service, name, params, query, body) -> Rpc | None:
    _no_query(query, name)
    obj = _json_body(body)
    if obj is None:
        return None
    return Rpc(service, name, _infer_request(obj, params), as_rest=_infer_rest)


# -- TF Serving ---------------------------------------------------------------------------------

def _model_spec(spec, params: Mapping[str, str]) -> None:
    spec.name = params["bot_id"]
    if "version" in params:
        spec.version.value = int(params["version"])


def _predict_rest(response: predict_pb2.PredictResponse) -> dict:
    """REST's answer to a row-format (`instances`) request: one object per image."""
    columns = {name: [[v.decode() if isinstance(v, bytes) else v for v in row]
                      for row in tf.make_ndarray(tensor).tolist()]
               for name, tensor in response.outputs.items()}
    n = len(next(iter(columns.values())))
    return {"predictions": [{name: rows[i] for name, rows in columns.items()}
                            for i in range(n)]}


def _tfs_call(service, name, params, query, body) -> Rpc | None:
    rpc = TFS_VERBS.get(params["verb"])
    obj = _json_body(body)
    if rpc is None or obj is None:
        return None
    if rpc != "Predict":  # what would be in its request does not matter: it is not served
        message = {"Classify": classification_pb2.ClassificationRequest,
                   "Regress": regression_pb2.RegressionRequest}[rpc]()
        _model_spec(message.model_spec, params)
        return Rpc(service, rpc, message)
    request = predict_pb2.PredictRequest()
    _model_spec(request.model_spec, params)
    if set(obj) - {"instances", "signature_name"}:
        raise NotImplementedError("the gRPC column maps TF Serving 'instances' only")
    request.model_spec.signature_name = obj.get("signature_name", "")
    images = []
    for instance in obj["instances"]:
        if not isinstance(instance, dict) or set(instance) != {"b64"}:
            raise NotImplementedError('the gRPC column maps {"b64": ...} instances only')
        images.append(_b64(instance["b64"]))
    tensor = request.inputs["image_bytes"]
    tensor.dtype = DT_STRING
    tensor.tensor_shape.dim.add(size=len(images))
    tensor.string_val.extend(images)
    # As the service reads it: the FIRST `top_k` of the query.
    metadata = tuple((key, value) for key, value in dict(reversed(query)).items())
    return Rpc(service, rpc, request, metadata=metadata, as_rest=_predict_rest)


def _tensor_info(info) -> dict:
    return {"dtype": _enum_name(info, "dtype"), "name": info.name,
            "tensor_shape": {"dim": [{"size": str(d.size), "name": d.name}
                                     for d in info.tensor_shape.dim],
                             "unknown_rank": info.tensor_shape.unknown_rank}}


def _metadata_rest(response: get_model_metadata_pb2.GetModelMetadataResponse) -> dict:
    signatures = {}
    for field, packed in response.metadata.items():
        unpacked = get_model_metadata_pb2.SignatureDefMap()
        assert packed.Unpack(unpacked), f"metadata '{field}' is not a SignatureDefMap"
        signatures[field] = {"signature_def": {
            key: {"inputs": {k: _tensor_info(v) for k, v in sig.inputs.items()},
                  "outputs": {k: _tensor_info(v) for k, v in sig.outputs.items()},
                  "method_name": sig.method_name}
            for key, sig in unpacked.signature_def.items()}}
    spec = response.model_spec
    return {"model_spec": {"name": spec.name, "signature_name": spec.signature_name,
                           "version": str(spec.version.value)},
            "metadata": signatures}


def _tfs_metadata(service, name, params, query, body) -> Rpc:
    _no_query(query, name)
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    _model_spec(request.model_spec, params)
    return Rpc(service, name, request, as_rest=_metadata_rest)


def _enum_name(message: Message, field: str) -> str:
    enum = message.DESCRIPTOR.fields_by_name[field].enum_type
    return enum.values_by_number[getattr(message, field)].name


def _status_rest(response: get_model_status_pb2.GetModelStatusResponse) -> dict:
    return {"model_version_status": [
        {"version": str(v.version), "state": _enum_name(v, "state"),
         "status": {"error_code": _enum_name(v.status, "error_code"),
                    "error_message": v.status.error_message}}
        for v in response.model_version_status]}


def _tfs_status(service, name, params, query, body) -> Rpc:
    _no_query(query, name)
    request = get_model_status_pb2.GetModelStatusRequest()
    _model_spec(request.model_spec, params)
    return Rpc(service, name, request, as_rest=_status_rest)


_BUILDERS: dict[str, Callable[..., Rpc | None]] = {
    "ServerLive": _server_rpc(pb.ServerLiveRequest, lambda r: {"live": r.live}),
    "ServerReady": _server_rpc(pb.ServerReadyRequest, lambda r: {"ready": r.ready}),
    "ServerMetadata": _server_rpc(pb.ServerMetadataRequest, lambda r: {
        "name": r.name, "version": r.version, "extensions": list(r.extensions)}),
    "ModelReady": _model_ready,
    "ModelMetadata": _model_metadata,
    "ModelInfer": _model_infer,
    "Predict": _tfs_call,
    "GetModelMetadata": _tfs_metadata,
    "GetModelStatus": _tfs_status,
}
