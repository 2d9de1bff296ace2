"""TF Serving gRPC: `tensorflow.serving.PredictionService` (Predict, GetModelMetadata) and
`tensorflow.serving.ModelService` (GetModelStatus) over the TF Serving codec.

A bot is a model, as on the REST routes (`service.codecs.tfserving`); `model_spec.version`
must be the bot's active version when given, and version labels are not served.

Each RPC calls the codec's typed call of its REST twin. Predict takes one input, DT_STRING [N]
(or [N, 1]) of encoded images or DT_FLOAT [N, 299, 299, 3] of preprocessed ones
(`tensor_content` or `float_val`), under any name: its elements (bytes, or a float array per
image) are read by the codec's rules and messages (signature name, one input, image shape and
values: `tfserving.images_of`), and the codec's output columns become tensors:
`probabilities` DT_FLOAT [N, n], `classes` DT_STRING [N, k], `scores` DT_FLOAT [N, k]
(`output_filter` picks some). k is the server's `top_k_default`, or the call's `top_k` metadata
(REST: `?top_k=`). GetModelMetadata (`signature_def`) and GetModelStatus are built from the
codec's typed results (`tfserving.Signature`, `tfserving.VersionStatus`). Classify and Regress
answer as their REST verbs `:classify` and `:regress` do (`tfserving.check_verb`): UNIMPLEMENTED
with the code `not_found`, counted under `tfs_predict`.

The generated messages and servicer bases come from the `tensorflow-serving-api` package
(`tensorflow_serving.apis.*_pb2(_grpc)`): nothing is copied or generated here. They import
TensorFlow's own protos, hence TensorFlow: `service.transports.grpc.server` loads this module
after the trunk's `import_tensorflow`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import grpc
import numpy as np
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from heads import Head
from service.codecs import tfserving
from service.codecs.common import Model, TensorSpec, endpoint_name, model_head, parse_top_k
from service.core.engine import Images, Prediction
from service.core.errors import BadRequest
from service.transports.grpc.common import Rpcs
from store import BotInfo, UnknownVersion

PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"
METADATA_FIELD = "signature_def"  # the one GetModelMetadata field TF Serving defines

# tensorflow.DataType values, read from the generated descriptors (no TensorFlow import here).
_TENSOR = (predict_pb2.PredictRequest.DESCRIPTOR.fields_by_name["inputs"]
           .message_type.fields_by_name["value"].message_type)
_DATA_TYPES = _TENSOR.fields_by_name["dtype"].enum_type
DT_FLOAT = _DATA_TYPES.values_by_name["DT_FLOAT"].number
DT_STRING = _DATA_TYPES.values_by_name["DT_STRING"].number
_VERSION_STATUS = (get_model_status_pb2.GetModelStatusResponse.DESCRIPTOR
                   .fields_by_name["model_version_status"].message_type)
_STATES = _VERSION_STATUS.fields_by_name["state"].enum_type
_ERROR_CODES = (_VERSION_STATUS.fields_by_name["status"].message_type
                .fields_by_name["error_code"].enum_type)
# RPC -> the name of its REST twin in the endpoint table (metrics, logs); a call whose
# model_spec names a version is the `_version` route's (`endpoint_name`).
ENDPOINT_NAMES = {"Predict": "tfs_predict", "GetModelMetadata": "tfs_metadata",
                  "GetModelStatus": "tfs_status"}


def _dtype_name(value: int) -> str:
    known = _DATA_TYPES.values_by_number.get(value)
    return known.name if known is not None else str(value)


def model_of(spec) -> Model:
    """The model a `ModelSpec` names (a version label is refused: only numbers are served)."""
    if spec.version_label:
        raise UnknownVersion(f"version label '{spec.version_label[:32]}' is not served: ask "
                             f"for the model's active version, or for no version")
    return Model(spec.name, str(spec.version.value) if spec.HasField("version") else None)


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
    """One input tensor as the images the codec reads (`tfserving.images_of`): encoded bytes per
    DT_STRING element, or a float array per image of a DT_FLOAT tensor."""
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
        return list(tensor.string_val)
    if tensor.dtype == DT_FLOAT:
        return list(_float_values(tensor, count, where).reshape(dims))
    raise BadRequest(f"{where} has dtype {_dtype_name(tensor.dtype)}: send DT_STRING (encoded "
                     f"images, shape [N]) or DT_FLOAT (preprocessed, shape [N, 299, 299, 3])")


def predict_images(request: predict_pb2.PredictRequest) -> Images:
    """A PredictRequest's images, by the codec's `:predict` rules (raises BadRequest)."""
    tfserving.check_signature(request.model_spec.signature_name)
    tfserving.check_one_input(len(request.inputs), "'inputs'")
    ((name, tensor),) = request.inputs.items()
    return tfserving.images_of(tensor_images(name, tensor), "input")


def predict_response(head: Head, predictions: list[Prediction],
                     wanted: Sequence[str]) -> predict_pb2.PredictResponse:
    """The codec's output columns as tensors: text as DT_STRING, numbers as DT_FLOAT."""
    names = list(wanted) or list(tfserving.OUTPUTS)
    for name in names:
        if name not in tfserving.OUTPUTS:
            raise BadRequest(f"output_filter names '{name[:64]}': this model's outputs are "
                             f"{', '.join(tfserving.OUTPUTS)}")
    columns = tfserving.prediction_columns(predictions)
    response = predict_pb2.PredictResponse()
    response.model_spec.name = head.bot_id
    # The version that answered: the live one, or the bot's canary candidate.
    response.model_spec.version.value = predictions[0].version if predictions else head.version
    response.model_spec.signature_name = tfserving.SIGNATURE
    for name in dict.fromkeys(names):
        values = np.asarray(columns[name])
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


def fill_tensor_info(info, spec: TensorSpec) -> None:
    """A `TensorInfo` (of a signature's map) from the codec's tensor metadata."""
    info.name = f"{spec.name}:0"
    info.dtype = _DATA_TYPES.values_by_name[spec.datatype].number
    for size in spec.shape:
        info.tensor_shape.dim.add(size=size)


def metadata_response(info: BotInfo, signature: tfserving.Signature
                      ) -> get_model_metadata_pb2.GetModelMetadataResponse:
    response = get_model_metadata_pb2.GetModelMetadataResponse()
    response.model_spec.name = info.bot_id
    response.model_spec.version.value = info.version
    signatures = get_model_metadata_pb2.SignatureDefMap()
    signature_def = signatures.signature_def[tfserving.SIGNATURE]
    for key, spec in signature.inputs.items():
        fill_tensor_info(signature_def.inputs[key], spec)
    for key, spec in signature.outputs.items():
        fill_tensor_info(signature_def.outputs[key], spec)
    signature_def.method_name = signature.method_name
    response.metadata[METADATA_FIELD].Pack(signatures)
    return response


def status_response(status: tfserving.VersionStatus
                    ) -> get_model_status_pb2.GetModelStatusResponse:
    response = get_model_status_pb2.GetModelStatusResponse()
    entry = response.model_version_status.add(version=status.version)
    entry.state = _STATES.values_by_name[status.state].number
    entry.status.error_code = _ERROR_CODES.values_by_name[status.error_code].number
    entry.status.error_message = status.error_message
    return response


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    """Predict and GetModelMetadata. Classify and Regress answer as their REST verbs do
    (`tfserving.check_verb`: UNIMPLEMENTED, code `not_found`, counted under `tfs_predict`);
    MultiInference, which has no REST twin, is UNIMPLEMENTED."""

    def __init__(self, rpcs: Rpcs) -> None:
        self.rpcs = rpcs

    async def Predict(self, request, context):  # noqa: N802 - the RPC's name
        async def handle(service) -> predict_pb2.PredictResponse:
            head = await model_head(service, model_of(request.model_spec))
            metadata = {key: value for key, value in (context.invocation_metadata() or ())
                        if isinstance(value, str)}
            top_k = parse_top_k(metadata, service.top_k_default)
            images = await service.run_blocking(predict_images, request)
            predictions = await tfserving.predict_call(service, head, images, top_k)
            return predict_response(head, predictions, request.output_filter)

        return await self.rpcs.run(_name("Predict", request.model_spec), request, context,
                                   handle)

    async def Classify(self, request, context):  # noqa: N802
        return await self._not_served("classify", request, context)

    async def Regress(self, request, context):  # noqa: N802
        return await self._not_served("regress", request, context)

    async def _not_served(self, verb: str, request, context):
        async def handle(service) -> None:
            tfserving.check_verb(verb)

        return await self.rpcs.run(_name("Predict", request.model_spec), request, context,
                                   handle)

    async def GetModelMetadata(self, request, context):  # noqa: N802
        async def handle(service) -> get_model_metadata_pb2.GetModelMetadataResponse:
            for field in request.metadata_field:
                if field != METADATA_FIELD:
                    raise BadRequest(f"metadata_field '{field[:64]}' is not served: only "
                                     f"'{METADATA_FIELD}'")
            info, signature = await tfserving.metadata_call(service,
                                                            model_of(request.model_spec))
            return metadata_response(info, signature)

        return await self.rpcs.run(_name("GetModelMetadata", request.model_spec), request,
                                   context, handle)


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    """GetModelStatus; HandleReloadConfigRequest is UNIMPLEMENTED (bots are managed over the
    admin routes)."""

    def __init__(self, rpcs: Rpcs) -> None:
        self.rpcs = rpcs

    async def GetModelStatus(self, request, context):  # noqa: N802
        async def handle(service) -> get_model_status_pb2.GetModelStatusResponse:
            status = await tfserving.status_call(service, model_of(request.model_spec))
            return status_response(status)

        return await self.rpcs.run(_name("GetModelStatus", request.model_spec), request,
                                   context, handle)


def _name(rpc: str, spec) -> str:
    """The metrics name of an RPC: its REST twin's endpoint name (`_version` when the spec
    names a version; a version label is refused as unknown, counted under the plain name)."""
    return endpoint_name(ENDPOINT_NAMES[rpc], spec.HasField("version"))


def register(server: grpc.aio.Server, rpcs: Rpcs) -> list[str]:
    """Adds both services to `server`; returns their names."""
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionServicer(rpcs), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(rpcs), server)
    return [PREDICTION_SERVICE, MODEL_SERVICE]
