"""KServe v2 / Triton gRPC: `inference.GRPCInferenceService` over the OIP v2 codec.

A bot is a model, as on the REST routes (`service.codecs.oip`): its active version is the only
one served. ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata and ModelInfer
are served; the other RPCs of the service (streaming, model config and statistics, repository,
shared memory, trace and log settings) answer UNIMPLEMENTED.

Each RPC calls the codec's typed call of its REST twin. ModelInfer's input becomes the codec's
neutral `oip_tensors.Tensor` (raw_input_contents as its raw data; typed contents
`bytes_contents` of a BYTES input or `fp32_contents` of an FP32 one as its elements or values),
read by the codec's rules (one input, BYTES [N] / [N, 1] encoded images or FP32 [N, 299, 299, 3]
preprocessed, element counts) with the codec's messages; each requested output is checked by the
codec too (the classification extension: an output's `classification` parameter gives
BYTES [N, k] of "score:index:label"), and the typed result becomes `outputs` +
`raw_output_contents`. What only gRPC can get wrong (raw_input_contents per input, typed
contents, shared memory) is checked here.

The generated messages and servicer base come from Triton's own client package
(`tritonclient.grpc.service_pb2` / `service_pb2_grpc`): nothing is copied or generated here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from service.codecs import oip, oip_tensors
from service.codecs.common import Model, TensorSpec, endpoint_name
from service.core.errors import BadRequest
from service.transports.grpc.common import Rpcs

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

SERVICE = "inference.GRPCInferenceService"
# Where a typed input's data is, by datatype (the datatypes this model takes).
TYPED_CONTENTS = {"BYTES": "bytes_contents", "FP32": "fp32_contents"}
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size",
                            "shared_memory_offset")
# RPC -> the name of its REST twin in the endpoint table (metrics, logs); a model RPC that
# names a version is the `_version` route's (`endpoint_name`).
ENDPOINT_NAMES = {"ServerLive": "oip_server_live", "ServerReady": "oip_server_ready",
                  "ServerMetadata": "oip_server_metadata", "ModelReady": "oip_model_ready",
                  "ModelMetadata": "oip_model_metadata", "ModelInfer": "oip_infer"}


def parameter_value(parameter: pb.InferParameter) -> Any:
    """An `InferParameter` as the JSON value REST would carry (bool, int, float or str)."""
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


def parameters(entries: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in entries.items()}


def model_of(name: str, version: str) -> Model:
    return Model(name, version or None)


def _name(rpc: str, model: Model) -> str:
    return endpoint_name(ENDPOINT_NAMES[rpc], model.version)


def input_tensor(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None,
                 where: str) -> oip_tensors.Tensor:
    """An input as the codec's neutral tensor: its raw contents, or its typed contents."""
    typed = [f.name for f, _ in tensor.contents.ListFields()]
    shape = list(tensor.shape)
    if raw is not None:
        if typed:
            raise BadRequest(f"{where} has typed contents ({', '.join(typed)}) and an entry in "
                             f"raw_input_contents: send its data once")
        return oip_tensors.Tensor(tensor.name, tensor.datatype, shape, raw=raw)
    if not typed:
        raise BadRequest(f"{where} has no data: send it in raw_input_contents or in its typed "
                         f"contents")
    field = TYPED_CONTENTS.get(tensor.datatype)
    if field is None:  # the codec refuses the datatype itself, naming the ones it takes
        return oip_tensors.Tensor(tensor.name, tensor.datatype, shape, raw=b"")
    if typed != [field]:
        raise BadRequest(f"{where}: the data of a {tensor.datatype} input goes in contents."
                         f"{field}, got {', '.join(typed)}")
    values = getattr(tensor.contents, field)
    if tensor.datatype == "BYTES":
        return oip_tensors.Tensor(tensor.name, tensor.datatype, shape, elements=list(values))
    return oip_tensors.Tensor(tensor.name, tensor.datatype, shape,
                              data=np.asarray(values, dtype=np.float32))


def infer_request(request: pb.ModelInferRequest) -> oip_tensors.InferRequest:
    """A ModelInferRequest as the codec's typed request (raises BadRequest). Every output is
    answered as raw data, whatever its `binary_data` parameter says."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} "
                         f"inputs: when used, it holds one entry per input")
    oip_tensors.check_one_input(len(request.inputs))
    tensor = request.inputs[0]
    where = oip_tensors.input_where(tensor.name)
    oip_tensors.check_shape(list(tensor.shape), where)
    if any(key in parameters(tensor.parameters) for key in SHARED_MEMORY_PARAMETERS):
        raise BadRequest(f"{where}: shared memory is not supported; send the data in the "
                         f"request")
    images = oip_tensors.tensor_images(input_tensor(tensor, raw[0] if raw else None, where))
    outputs = tuple(oip_tensors.output_request(out.name, {**parameters(out.parameters),
                                                          "binary_data": True}, True)
                    for out in request.outputs) or (oip_tensors.OutputRequest(True, None),)
    given = parameters(request.parameters)
    return oip_tensors.InferRequest(request.id or None, images, outputs,
                                    oip_tensors.route_key_parameter(given),
                                    oip_tensors.deadline_parameter(given))


def infer_response(result: oip_tensors.InferResult) -> pb.ModelInferResponse:
    """The typed result as a ModelInferResponse: `outputs` without data, their data in
    `raw_output_contents`."""
    response = pb.ModelInferResponse(model_name=result.model_name,
                                     model_version=result.model_version, id=result.id or "")
    for output in result.outputs:
        response.outputs.add(name=output.name, datatype=output.datatype,
                             shape=list(output.shape))
        response.raw_output_contents.append(output.raw())
    return response


def _tensors(specs: tuple[TensorSpec, ...]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
    return [pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype,
                                                    shape=list(t.shape)) for t in specs]


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The RPCs served; each calls the OIP codec's typed call through `Rpcs`."""

    def __init__(self, rpcs: Rpcs) -> None:
        self.rpcs = rpcs

    async def ServerLive(self, request, context):  # noqa: N802 - the RPC's name
        async def handle(service) -> pb.ServerLiveResponse:
            return pb.ServerLiveResponse(live=True)

        return await self.rpcs.run(ENDPOINT_NAMES["ServerLive"], request, context, handle)

    async def ServerReady(self, request, context):  # noqa: N802
        async def handle(service) -> pb.ServerReadyResponse:
            return pb.ServerReadyResponse(ready=oip.server_ready_call(service))

        return await self.rpcs.run(ENDPOINT_NAMES["ServerReady"], request, context, handle)

    async def ServerMetadata(self, request, context):  # noqa: N802
        async def handle(service) -> pb.ServerMetadataResponse:
            metadata = oip.server_metadata_call()
            return pb.ServerMetadataResponse(name=metadata.name, version=metadata.version,
                                             extensions=list(metadata.extensions))

        return await self.rpcs.run(ENDPOINT_NAMES["ServerMetadata"], request, context, handle)

    async def ModelReady(self, request, context):  # noqa: N802
        model = model_of(request.name, request.version)

        async def handle(service) -> pb.ModelReadyResponse:
            return pb.ModelReadyResponse(
                ready=await oip.model_ready_call(service, model))

        return await self.rpcs.run(_name("ModelReady", model), request, context, handle)

    async def ModelMetadata(self, request, context):  # noqa: N802
        model = model_of(request.name, request.version)

        async def handle(service) -> pb.ModelMetadataResponse:
            metadata = await oip.model_metadata_call(service, model)
            return pb.ModelMetadataResponse(name=metadata.name, versions=list(metadata.versions),
                                            platform=metadata.platform,
                                            inputs=_tensors(metadata.inputs),
                                            outputs=_tensors(metadata.outputs))

        return await self.rpcs.run(_name("ModelMetadata", model), request, context, handle)

    async def ModelInfer(self, request, context):  # noqa: N802
        model = model_of(request.model_name, request.model_version)

        async def handle(service) -> pb.ModelInferResponse:
            head = await oip.model_head(service, model)  # UNAVAILABLE / NOT_FOUND before work
            # Typed FP32 contents can be megabytes of floats to convert: off the event loop.
            parsed = await service.run_blocking(infer_request, request)
            return infer_response(await oip.infer_call(service, head, parsed))

        return await self.rpcs.run(_name("ModelInfer", model), request, context, handle)


def register(server: grpc.aio.Server, rpcs: Rpcs) -> list[str]:
    """Adds the service to `server`; returns the names of the services added."""
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(rpcs), server)
    return [SERVICE]
