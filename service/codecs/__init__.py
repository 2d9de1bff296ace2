"""Protocol codecs: pure code between a transport and the engine.

Every protocol the service speaks (native `/classify`, admin `/bots`, operations, Open Inference
Protocol v2, TF Serving REST) is written ONCE here, as:

- pure functions that parse a transport-neutral `Request` (method, path params, query, headers,
  body bytes) into a typed call, and render a result or a domain error as a `Reply` (status,
  headers, body);
- an `Endpoint` per route: `handle(service, request) -> Reply`, which parses, calls the
  protocol-agnostic `Service` (`service.core.context`), and renders.

`service.codecs.base` holds the shared types and `dispatch`; `service.codecs.routes` lists every
endpoint. Transports only move bytes: the aiohttp app (`service.transports.http.app`) maps each
`Endpoint` to a
route and calls `dispatch`; a Ray Serve ASGI proxy or a gRPC server are further transports
over the same endpoints and functions. Nothing in this package imports aiohttp (a test keeps it so).

Admin authentication is applied once, in `dispatch`, for every endpoint marked `admin=True`;
every error becomes `{"error": "...", "code": "..."}` with its status through `error_reply`.
"""
