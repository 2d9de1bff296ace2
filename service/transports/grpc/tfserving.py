"""TF Serving gRPC: `tensorflow.serving.PredictionService` (Predict, GetModelMetadata) and
`tensorflow.serving.ModelService` (GetModelStatus) over the TF Serving codec.

A bot is a model, as on the REST routes (`service.codecs.tfserving`); `model_spec.version`
must be the bot's active version when given, and version labels are not served.

Predict takes one input, DT_STRING [N] (or [N, 1]) of encoded images or DT_FLOAT
[N, 299, 299, 3] of preprocessed ones (`tensor_content` or `float_val`), under any name. Its
tensor becomes the REST `:predict` columnar body's images (encoded bytes as `{"b64": ...}`,
each float image as its rows) and the codec's `parse_predict_request` applies the REST rules
and messages (signature name, one input, image shape and values); the answer is the codec's
`render_predictions` as tensors: `probabilities` DT_FLOAT [N, n], `classes` DT_STRING [N, k],
`scores` DT_FLOAT [N, k] (`output_filter` picks some). k is the server's `top_k_default`, or
the call's `top_k` metadata (REST: `?top_k=`). GetModelMetadata (`signature_def`) and
GetModelStatus are the REST answers, parsed into the messages through the proto3 JSON mapping.

The generated messages and servicer bases come from the `tensorflow-serving-api` package
(`tensorflow_serving.apis.*_pb2(_grpc)`): nothing is copied or generated here. They import
TensorFlow's own protos, hence TensorFlow: `service.transports.grpc.server` loads this module after
the
trunk's `import_tensorflow`.
"""
from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from heads import Head, UnknownVersion
from service.codecs import tfserving
from service.codecs.common import active_head, classify_with, parse_top_k
from service.core.errors import BadRequest
from service.transports.grpc.common import Rpcs, codec_request, from_json, reply_json

PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"
METADATA_FIELD = "signature_def"  # the one GetModelMetadata field TF Serving defines

# tensorflow.DataType values, read from the generated descriptors (no TensorFlow import here).
_TENSOR = (predict_pb2.PredictRequest.DESCRIPTOR.fields_by_name["inputs"]
           .message_type.fields_by_name["value"].message_type)
_DATA_TYPES = _TENSOR.fields_by_name["dtype"].enum_type
DT_FLOAT = _DATA_TYPES.values_by_name["DT_FLOAT"].number
DT_STRING = _DATA_TYPES.values_by_name["DT_STRING"].number


def _dtype_name(value: int) -> str:
    known = _DATA_TYPES.values_by_number.get(value)
    return known.name if known is not None else str(value)


def spec_request(method: str, spec) -> Any:
    """The codecs' request for a `ModelSpec`: the model and its version as path parameters."""
    if spec.version_label:
        raise UnknownVersion(f"version label '{spec.version_label[:32]}' is not served: ask "
                             f"for the model's active version, or for no version")
    version = str(spec.version.value) if spec.HasField("version") else ""
    return codec_request(method, spec.name, version)


def _float_values(tensor, count: int, where: str) -> np.ndarray:
    if tensor.tensor_content:
        if len(tensor.tensor_content) != count * 4:
            raise BadRequest(f"{where}: tensor_content has {len(tensor.tensor_content)} bytes, "
                             f"its shape needs {count * 4}")
        return np.frombuffer(tensor.tensor_content, dtype="<f4")
    values = np.asarray(tensor.float_val, dtype=np.float32)
    if values.size != count:
        raise BadRequest(f"{where} has {values.size} float_val values, its shape needs {count}")
    return values


def tensor_images(name: str, tensor) -> list:
    """One input tensor as the images of the REST columnar body: `{"b64": ...}` per encoded
    image, or each float image as the list of its rows (numpy rows where JSON has lists)."""
    where = f"input '{name[:64]}'"
    dims = [d.size for d in tensor.tensor_shape.dim]
    if tensor.tensor_shape.unknown_rank or not dims or any(d < 0 for d in dims):
        raise BadRequest(f"{where} needs a known shape, the batch dimension first")
    count = math.prod(dims)
    if tensor.dtype == DT_STRING:
        if len(dims) > 2 or (len(dims) == 2 and dims[1] != 1):
            raise BadRequest(f"{where}: a DT_STRING input holds one encoded image per element, "
                             f"shape [N] or [N, 1]; got {dims}")
        if len(tensor.string_val) != count:
            raise BadRequest(f"{where} has {len(tensor.string_val)} string_val values, its "
                             f"shape {dims} says {count}")
        return [{"b64": base64.b64encode(value).decode()} for value in tensor.string_val]
    if tensor.dtype == DT_FLOAT:
        images = _float_values(tensor, count, where).reshape(dims)
        return [list(image) if image.ndim else image.item() for image in images]
    raise BadRequest(f"{where} has dtype {_dtype_name(tensor.dtype)}: send DT_STRING (encoded "
                     f"images, shape [N]) or DT_FLOAT (preprocessed, shape [N, 299, 299, 3])")


def predict_images(request: predict_pb2.PredictRequest):
    """A PredictRequest's images, through the REST `:predict` rules (raises BadRequest)."""
    body = {"signature_name": request.model_spec.signature_name,
            "inputs": {name: tensor_images(name, tensor)
                       for name, tensor in request.inputs.items()}}
    images, _ = tfserving.parse_predict_request(body)
    return images


def predict_response(head: Head, outputs: dict[str, list],
                     wanted: Sequence[str]) -> predict_pb2.PredictResponse:
    """The codec's columnar outputs as tensors: text as DT_STRING, numbers as DT_FLOAT."""
    names = list(wanted) or list(outputs)
    for name in names:
        if name not in outputs:
            raise BadRequest(f"output_filter names '{name[:64]}': this model's outputs are "
                             f"{', '.join(outputs)}")
    response = predict_pb2.PredictResponse()
    response.model_spec.name = head.bot_id
    response.model_spec.version.value = head.version
    response.model_spec.signature_name = tfserving.SIGNATURE
    for name in dict.fromkeys(names):
        values = np.asarray(outputs[name])
        tensor = response.outputs[name]
        for size in values.shape:
            tensor.tensor_shape.dim.add(size=size)
        if values.dtype.kind in "US":
            tensor.dtype = DT_STRING
            tensor.string_val.extend(v.encode() for v in values.ravel().tolist())
        else:
            tensor.dtype = DT_FLOAT
            tensor.tensor_content = values.astype("<f4").tobytes()
    return response


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    """Predict and GetModelMetadata; Classify, Regress and MultiInference are UNIMPLEMENTED."""

    def __init__(self, rpcs: Rpcs) -> None:
        self.rpcs = rpcs

    async def Predict(self, request, context):  # noqa: N802 - the RPC's name
        method = f"/{PREDICTION_SERVICE}/Predict"
        service = self.rpcs.service

        async def handle() -> predict_pb2.PredictResponse:
            service.require_engine()
            head = await active_head(service, spec_request(method, request.model_spec))
            metadata = {key: value for key, value in (context.invocation_metadata() or ())
                        if isinstance(value, str)}
            top_k = parse_top_k(metadata, service.settings.top_k_default)
            images = await service.run_blocking(predict_images, request)
            predictions = await classify_with(service, head, images, top_k=top_k)
            outputs = tfserving.render_predictions(predictions, columnar=True)["outputs"]
            return predict_response(head, outputs, request.output_filter)

        return await self.rpcs.run(method, request, context, handle)

    async def GetModelMetadata(self, request, context):  # noqa: N802
        method = f"/{PREDICTION_SERVICE}/GetModelMetadata"

        async def handle() -> get_model_metadata_pb2.GetModelMetadataResponse:
            for field in request.metadata_field:
                if field != METADATA_FIELD:
                    raise BadRequest(f"metadata_field '{field[:64]}' is not served: only "
                                     f"'{METADATA_FIELD}'")
            reply = await tfserving.tf_metadata(self.rpcs.service,
                                                spec_request(method, request.model_spec))
            body = reply_json(reply)
            response = get_model_metadata_pb2.GetModelMetadataResponse()
            from_json(body["model_spec"], response.model_spec)
            signatures = from_json(body["metadata"][METADATA_FIELD],
                                   get_model_metadata_pb2.SignatureDefMap())
            response.metadata[METADATA_FIELD].Pack(signatures)
            return response

        return await self.rpcs.run(method, request, context, handle)


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    """GetModelStatus; HandleReloadConfigRequest is UNIMPLEMENTED (bots are managed over the
    admin routes)."""

    def __init__(self, rpcs: Rpcs) -> None:
        self.rpcs = rpcs

    async def GetModelStatus(self, request, context):  # noqa: N802
        method = f"/{MODEL_SERVICE}/GetModelStatus"

        async def handle() -> get_model_status_pb2.GetModelStatusResponse:
            reply = await tfserving.tf_status(self.rpcs.service,
                                              spec_request(method, request.model_spec))
            return from_json(reply_json(reply), get_model_status_pb2.GetModelStatusResponse())

        return await self.rpcs.run(method, request, context, handle)


def register(server: grpc.aio.Server, rpcs: Rpcs) -> list[str]:
    """Adds both services to `server`; returns their names."""
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionServicer(rpcs), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(rpcs), server)
    return [PREDICTION_SERVICE, MODEL_SERVICE]
