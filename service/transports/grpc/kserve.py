"""KServe v2 / Triton gRPC: `inference.GRPCInferenceService` over the OIP v2 codec.

A bot is a model, as on the REST routes (`service.codecs.oip`): its active version is the only
one served. ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata and ModelInfer
are served; the other RPCs of the service (streaming, model config and statistics, repository,
shared memory, trace and log settings) answer UNIMPLEMENTED.

ModelInfer is the REST `/infer` with the binary tensor extension: the request's input becomes
the REST input with its data as binary data (raw_input_contents as they are; typed contents
`bytes_contents` of a BYTES input or `fp32_contents` of an FP32 one serialized the way the
binary extension carries them), every requested output is asked as binary data, and the codec's
binary answer becomes `outputs` + `raw_output_contents`. So the input rules (one input, BYTES
[N] / [N, 1] encoded images or FP32 [N, 299, 299, 3] preprocessed, element counts) and the
classification extension (an output's `classification` parameter: BYTES [N, k] of
"score:index:label") are the codec's, with its messages. Request, input and output parameters
pass through as the REST JSON values of the same names.

The generated messages and servicer base come from Triton's own client package
(`tritonclient.grpc.service_pb2` / `service_pb2_grpc`): nothing is copied or generated here.
"""
from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from service.codecs import oip
from service.codecs.base import Reply
from service.core.errors import BadRequest
from service.transports.grpc.common import Rpcs, codec_request

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

SERVICE = "inference.GRPCInferenceService"
# Where a typed input's data is, by datatype (the datatypes this model takes).
TYPED_CONTENTS = {"BYTES": "bytes_contents", "FP32": "fp32_contents"}
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size",
                            "shared_memory_offset")


def _method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def parameter_value(parameter: pb.InferParameter) -> Any:
    """An `InferParameter` as the JSON value REST would carry (bool, int, float or str)."""
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


def parameters(entries: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in entries.items()}


def _bytes_tensor(elements) -> bytes:
    """BYTES elements as the binary tensor extension carries them: (uint32 LE length, bytes)*."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _input_data(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None,
                where: str) -> bytes:
    """The input's data as the binary tensor extension would carry it."""
    typed = [f.name for f, _ in tensor.contents.ListFields()]
    if raw is not None:
        if typed:
            raise BadRequest(f"{where} has typed contents ({', '.join(typed)}) and an entry in "
                             f"raw_input_contents: send its data once")
        return raw
    if not typed:
        raise BadRequest(f"{where} has no data: send it in raw_input_contents or in its typed "
                         f"contents")
    field = TYPED_CONTENTS.get(tensor.datatype)
    if field is None:
        return b""  # the codec refuses the datatype itself, naming the ones it takes
    if typed != [field]:
        raise BadRequest(f"{where}: the data of a {tensor.datatype} input goes in contents."
                         f"{field}, got {', '.join(typed)}")
    values = getattr(tensor.contents, field)
    if tensor.datatype == "BYTES":
        return _bytes_tensor(values)
    return np.asarray(values, dtype="<f4").tobytes()


def rest_infer_body(request: pb.ModelInferRequest) -> tuple[bytes, int]:
    """A ModelInferRequest as the body of the REST `/infer` with the binary tensor extension:
    (JSON header + binary data, the header's length). Raises BadRequest for what only gRPC can
    get wrong (raw_input_contents per input, typed contents, shared memory)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} "
                         f"inputs: when used, it holds one entry per input")
    inputs, blobs = [], []
    for i, tensor in enumerate(request.inputs):
        where = f"input '{tensor.name[:64]}'"
        params = parameters(tensor.parameters)
        if any(key in params for key in SHARED_MEMORY_PARAMETERS):
            raise BadRequest(f"{where}: shared memory is not supported; send the data in the "
                             f"request")
        data = _input_data(tensor, raw[i] if raw else None, where)
        params["binary_data_size"] = len(data)
        inputs.append({"name": tensor.name, "datatype": tensor.datatype,
                       "shape": list(tensor.shape), "parameters": params})
        blobs.append(data)
    header: dict[str, Any] = {
        "parameters": {**parameters(request.parameters), "binary_data_output": True},
        "inputs": inputs,
    }
    if request.id:
        header["id"] = request.id
    if request.outputs:
        header["outputs"] = [{"name": out.name,
                              "parameters": {**parameters(out.parameters), "binary_data": True}}
                             for out in request.outputs]
    head = json.dumps(header).encode()
    return head + b"".join(blobs), len(head)


def infer_response(reply: Reply) -> pb.ModelInferResponse:
    """The codec's binary `/infer` answer (JSON header + each output's binary data) as a
    ModelInferResponse: `outputs` without data, their data in `raw_output_contents`."""
    split = int(reply.headers[oip.HEADER_LENGTH])
    header = json.loads(reply.body[:split])
    response = pb.ModelInferResponse(model_name=header["model_name"],
                                     model_version=header["model_version"],
                                     id=header.get("id", ""))
    offset = split
    for output in header["outputs"]:
        size = output["parameters"]["binary_data_size"]
        response.outputs.add(name=output["name"], datatype=output["datatype"],
                             shape=output["shape"])
        response.raw_output_contents.append(reply.body[offset:offset + size])
        offset += size
    return response


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The RPCs served; each calls the OIP codec through `Rpcs`."""

    def __init__(self, rpcs: Rpcs) -> None:
        self.rpcs = rpcs

    async def ServerLive(self, request, context):  # noqa: N802 - the RPC's name
        return await self.rpcs.answer(_method("ServerLive"), request, context, oip.server_live,
                                      codec_request(_method("ServerLive")),
                                      pb.ServerLiveResponse())

    async def ServerReady(self, request, context):  # noqa: N802
        return await self.rpcs.answer(_method("ServerReady"), request, context, oip.server_ready,
                                      codec_request(_method("ServerReady")),
                                      pb.ServerReadyResponse())

    async def ServerMetadata(self, request, context):  # noqa: N802
        return await self.rpcs.answer(_method("ServerMetadata"), request, context,
                                      oip.server_metadata,
                                      codec_request(_method("ServerMetadata")),
                                      pb.ServerMetadataResponse())

    async def ModelReady(self, request, context):  # noqa: N802
        method = _method("ModelReady")
        return await self.rpcs.answer(method, request, context, oip.model_ready,
                                      codec_request(method, request.name, request.version),
                                      pb.ModelReadyResponse())

    async def ModelMetadata(self, request, context):  # noqa: N802
        method = _method("ModelMetadata")
        return await self.rpcs.answer(method, request, context, oip.model_metadata,
                                      codec_request(method, request.name, request.version),
                                      pb.ModelMetadataResponse())

    async def ModelInfer(self, request, context):  # noqa: N802
        method = _method("ModelInfer")
        service = self.rpcs.service

        async def handle() -> pb.ModelInferResponse:
            service.require_engine()  # UNAVAILABLE before any work while the trunk loads
            # Typed FP32 contents can be megabytes of floats to convert: off the event loop.
            body, header_length = await service.run_blocking(rest_infer_body, request)
            reply = await oip.infer(service, codec_request(
                method, request.model_name, request.model_version,
                headers={oip.HEADER_LENGTH: str(header_length)}, body=body))
            return infer_response(reply)

        return await self.rpcs.run(method, request, context, handle)


def register(server: grpc.aio.Server, rpcs: Rpcs) -> list[str]:
    """Adds the service to `server`; returns the names of the services added."""
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(rpcs), server)
    return [SERVICE]
