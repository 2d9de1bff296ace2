"""Protocol codecs: pure code between a transport and the engine.

Every protocol the service speaks (native `/classify`, admin `/bots`, operations, Open Inference
Protocol v2, TF Serving REST) is written ONCE here, as:

- pure functions that parse a transport-neutral `Request` (method, path params, query, headers,
  body bytes) into a typed call, and render a result or a domain error as a `Reply` (status,
  headers, body);
- an `Endpoint` per route: `handle(service, request) -> Reply`, which parses, calls the
  protocol-agnostic service as the call's caller sees it (`service.core.caller.Caller`: every
  member with its access and ownership rule), and renders.

The interop protocols (OIP v2, TF Serving) also expose their typed calls to other transports:
a typed request (`oip_tensors.InferRequest`, with its input in the neutral form
`oip_tensors.Tensor`; TF Serving's images) goes into a call (`oip.infer_call`,
`tfserving.predict_call`, the metadata, readiness and status calls) that returns a typed result
(`oip_tensors.InferResult`, ...). The REST
endpoints are parse -> typed call -> render; the gRPC services (`service.transports.grpc`) are
protobuf -> the same typed request -> the same call -> protobuf, with the same input rules and
messages. No transport builds another protocol's wire bytes.

`service.codecs.base` holds the shared types; `service.codecs.routes` lists every endpoint;
`service.codecs.pipeline` is the request pipeline every transport runs (request scope, caller,
admission, handler, error, metrics); `service.codecs.stream` the protocol of a streaming
endpoint (the WebSocket). Transports only move bytes: the aiohttp app
(`service.transports.http.app`), Ray's model replicas and the gRPC services run each request
through the pipeline, with their own way of sending the answer. Nothing in this package imports
aiohttp (a test keeps it so). A codec reaches the core only through its `Caller`.

Each endpoint's access rule is checked once, by the pipeline's caller step (`dispatch`, the same
steps without a transport, is what the codec tests call); every error becomes
`{"error": "...", "code": "..."}` with its status through `error_reply`.
"""
