"""The API description: an OpenAPI 3.0.3 document generated from the endpoints themselves, and
the endpoints that serve it and its docs page.

    GET /openapi.json        the document (every route of `service.codecs.routes.ENDPOINTS`, these
    too)
    GET /docs                the docs page: Swagger UI, served from this package and the
    GET /docs/{asset}        swagger-ui-bundle package (no CDN, nothing fetched elsewhere)

Nothing here is written by hand per route: each `Endpoint` carries its summary, parameters,
request body, answers and error statuses as data (`service.codecs.base`), and `document` turns
them into OpenAPI. Rules it adds for every endpoint alike:

- path parameters come from the route template (`{bot_id:[^{}/:]+}` -> `{bot_id}`), their
  schema from `Endpoint.path_params`;
- every status in `Endpoint.errors` is answered with the JSON error body (`Error`);
- an admin endpoint needs the bearer token (`security`) and may answer 401 and 403;
- an endpoint with a body may answer 413 (over `max_body_bytes`) and 503 (admission: the
  in-flight budget is full, before the body is read);
- a streaming endpoint (a WebSocket) documents its upgrade: a 101 answer instead of a 2xx;
- a schema with a "title" becomes a named component (`#/components/schemas/<title>`).

OpenAPI 3.0.3 rather than 3.1: Swagger UI before 5.0 (the swagger-ui-bundle package ships 4.15)
cannot render 3.1, and binary bodies (`format: binary`) are what client generators and
Schemathesis read best in 3.0.
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.codecs.base import JSON, Answer, Endpoint, Reply, Request
from service.codecs.pipeline import SWITCHING_PROTOCOLS
from service.core.auth import PUBLIC
from service.core.errors import NotFound

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller

OPENAPI_VERSION = "3.0.3"
TITLE = "multihead"
SECURITY_SCHEME = "adminToken"
STATIC_DIR = Path(__file__).resolve().parents[1] / "static"

TAGS = {
    "native": "Classify images with one bot or several (one trunk run per image, whatever the "
              "number of bots).",
    "bots": "The registered bots of the caller's tenant; registering, replacing, rolling back "
            "and removing one needs a manage key or the operator token.",
    "tenants": "Tenants, API keys and the audit log (the operator's; a manage key reads its "
               "tenant's audit log).",
    "operations": "Health, readiness and Prometheus metrics.",
    "oip-v2": "Open Inference Protocol v2 (KServe, Triton), with Triton's binary tensor and "
              "classification extensions. A bot is a model; only its active version is served.",
    "tf-serving": "TensorFlow Serving's REST API. A bot is a model; only its active version is "
                  "served.",
    "docs": "This description and its docs page.",
}

DESCRIPTION = """\
Many image classifiers ("bots") sharing one Inception-V4 trunk. Every protocol (native,
Open Inference Protocol v2, TF Serving REST) runs on the same cross-bot batcher.

**Errors** are JSON `{"error": "<message>", "code": "<code>"}` with the status that fits:
400 malformed request or image, 401/403 credentials, 404 unknown bot or version, 409 a taken
id, 413 too large,
415 unsupported content type, 422 unusable head upload, 503 loading or overloaded (with
`Retry-After`), 504 deadline passed.

**Credentials**: `Authorization: Bearer <key>`, a tenant's API key (`multihead keys add`): scope
infer calls and lists its tenant's bots, manage also changes them, metrics reads `/metrics`;
another tenant's bot answers as an unknown one (404). The operator token
(`MULTIHEAD_ADMIN_TOKEN`) manages tenants and keys and reaches every bot. With `--auth none`
only the changes need the operator token.

**The WebSocket** `GET /ws/classify/{bot_id}` is described by its upgrade request (OpenAPI 3.0
has no WebSocket): its `101` answer and the messages are in its description. Not described
here: the web page `/`.
"""

ERROR_SCHEMA = {
    "title": "Error", "type": "object", "additionalProperties": False,
    "required": ["error", "code"],
    "properties": {
        "error": {"type": "string", "description": "what went wrong, naming the offending value"},
        "code": {"type": "string", "description": "a stable machine-readable code "
                                                  "(`unknown_bot`, `invalid_image`, ...)"}}}

ERROR_TEXT = {
    400: "malformed request: a parameter, the body, the image or the bot id",
    401: "admin route without a valid bearer token",
    403: "admin routes are disabled (no admin token configured)",
    404: "unknown bot, version or route",
    413: "the body, an image, the number of images or the answer's upper bound "
         "(`max_answer_bytes`) is over a limit",
    415: "unsupported Content-Type",
    422: "the uploaded head cannot be used (bad checkpoint, labels or shapes)",
    500: "the bot is registered but its head cannot be loaded (`head_unavailable`)",
    503: "the trunk is loading, the server is overloaded (in-flight bytes or queue full) or "
         "shutting down",
    504: "the request's deadline passed before its images reached the trunk",
}
ERROR_HEADERS = {
    401: {"WWW-Authenticate": ("`Bearer realm=\"multihead\"`", True)},
    503: {"Retry-After": ("seconds to wait before retrying (when loading or overloaded)",
                          False)},
}
# Statuses of the auto rules (see the module docstring).
CREDENTIAL_ERRORS = (401, 403)
BODY_ERRORS = (413, 503)

_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::[^{}]*(?:\{[^{}]*\}[^{}]*)*)?\}")


def openapi_path(template: str) -> str:
    """A route template as an OpenAPI path: `/v2/models/{bot_id:[^{}/:]+}` ->
    `/v2/models/{bot_id}` (a parameter's regex may hold one level of braces)."""
    return _PARAM.sub(lambda m: "{" + m.group(1) + "}", template)


def path_param_names(template: str) -> list[str]:
    return [m.group(1) for m in _PARAM.finditer(template)]


def error_statuses(endpoint: Endpoint) -> list[int]:
    """Every status the endpoint answers with the JSON error body."""
    statuses = set(endpoint.errors)
    if endpoint.access != PUBLIC:
        statuses.update(CREDENTIAL_ERRORS)
    if endpoint.body is not None:
        statuses.update(BODY_ERRORS)
    return sorted(statuses)


# -- schemas -----------------------------------------------------------------------------------

_SCHEMA_MAPS = ("properties",)
_SCHEMA_LISTS = ("oneOf", "anyOf", "allOf")
_SCHEMA_ONE = ("items", "additionalProperties", "not")


class _Components:
    """Named schemas, filled as titled schemas are met."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self._sources: dict[str, Any] = {}

    def schema(self, schema: Mapping[str, Any]) -> dict[str, Any]:
        """`schema` with every titled sub-schema (itself included) replaced by a `$ref`."""
        title = schema.get("title")
        if title is None:
            return self._walk(schema)
        known = self._sources.get(title)
        if known is None:
            self._sources[title] = schema  # first: a schema holding itself ends in a $ref
            self.schemas[title] = self._walk(schema)
        elif known != schema:
            raise ValueError(f"two different schemas are titled {title!r}")
        return {"$ref": f"#/components/schemas/{title}"}

    def _walk(self, schema: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(schema)
        for key in _SCHEMA_MAPS:
            if key in out:
                out[key] = {name: self.schema(sub) for name, sub in out[key].items()}
        for key in _SCHEMA_LISTS:
            if key in out:
                out[key] = [self.schema(sub) for sub in out[key]]
        for key in _SCHEMA_ONE:
            if isinstance(out.get(key), Mapping):
                out[key] = self.schema(out[key])
        return copy.deepcopy(out)


def _content(components: _Components, content: Mapping[str, Any],
             encoding: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    out = {}
    for media_type, schema in content.items():
        entry: dict[str, Any] = {"schema": components.schema(schema)}
        if encoding and media_type in encoding:
            entry["encoding"] = copy.deepcopy(dict(encoding[media_type]))
        out[media_type] = entry
    return out


def _headers(headers: Mapping[str, tuple[str, bool]]) -> dict[str, Any]:
    return {name: {"description": text, "required": required, "schema": {"type": "string"}}
            for name, (text, required) in headers.items()}


def _answer(components: _Components, answer: Answer) -> dict[str, Any]:
    out: dict[str, Any] = {"description": answer.description}
    if answer.content:
        out["content"] = _content(components, answer.content)
    if answer.headers:
        out["headers"] = _headers(answer.headers)
    return out


def _error_answer(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {"description": ERROR_TEXT.get(status, "error"),
                           "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}
    if status in ERROR_HEADERS:
        out["headers"] = _headers(ERROR_HEADERS[status])
    return out


# -- the document ------------------------------------------------------------------------------

def operation(components: _Components, endpoint: Endpoint) -> dict[str, Any]:
    """The OpenAPI operation object of one endpoint."""
    op: dict[str, Any] = {"operationId": endpoint.name, "summary": endpoint.summary}
    if endpoint.description:
        op["description"] = endpoint.description
    if endpoint.tag:
        op["tags"] = [endpoint.tag]
    names = path_param_names(endpoint.path)
    unknown = set(endpoint.path_params) - set(names)
    if unknown:
        raise ValueError(f"{endpoint.name}: path_params {sorted(unknown)} are not in "
                         f"{endpoint.path}")
    params = [{"name": name, "in": "path", "required": True,
               "schema": components.schema(endpoint.path_params.get(
                   name, {"type": "string", "minLength": 1}))} for name in names]
    for p in endpoint.params:
        entry = {"name": p.name, "in": p.location, "required": p.required,
                 "schema": components.schema(p.schema)}
        if p.description:
            entry["description"] = p.description
        params.append(entry)
    if params:
        op["parameters"] = params
    if endpoint.body is not None:
        body = endpoint.body
        op["requestBody"] = {"required": body.required,
                             "content": _content(components, body.content, body.encoding)}
        if body.description:
            op["requestBody"]["description"] = body.description
    if not any(200 <= s < 300 or (s == SWITCHING_PROTOCOLS and endpoint.stream is not None)
               for s in endpoint.answers):
        raise ValueError(f"{endpoint.name} documents no 2xx answer")
    errors = error_statuses(endpoint)
    both = set(errors) & set(endpoint.answers)
    if both:
        raise ValueError(f"{endpoint.name}: status {sorted(both)} is both an answer and an error")
    responses = {str(s): _answer(components, endpoint.answers[s])
                 for s in sorted(endpoint.answers)}
    responses.update({str(s): _error_answer(s) for s in errors})
    op["responses"] = dict(sorted(responses.items()))
    if endpoint.access != PUBLIC:
        op["security"] = [{SECURITY_SCHEME: []}]
    return op


def document(endpoints: Sequence[Endpoint], *, version: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.0.3 document of `endpoints` (a JSON-ready dict).

    Raises:
        ValueError: an endpoint whose description is inconsistent (no 2xx answer, a status both
            answered and an error, a path parameter not in its template, an operation id or a
            method + path used twice, two different schemas under one title).
    """
    components = _Components()
    components.schema(ERROR_SCHEMA)
    paths: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    for endpoint in endpoints:
        if endpoint.name in seen:
            raise ValueError(f"operation id {endpoint.name!r} used twice")
        seen.add(endpoint.name)
        methods = paths.setdefault(openapi_path(endpoint.path), {})
        method = endpoint.method.lower()
        if method in methods:
            raise ValueError(f"{endpoint.method} {endpoint.path} is routed twice")
        methods[method] = operation(components, endpoint)
    used_tags = [t for t in TAGS if any(e.tag == t for e in endpoints)]
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": TITLE, "version": version or package_version(),
                 "description": DESCRIPTION},
        "tags": [{"name": t, "description": TAGS[t]} for t in used_tags],
        "paths": paths,
        "components": {
            "schemas": dict(sorted(components.schemas.items())),
            "securitySchemes": {SECURITY_SCHEME: {
                "type": "http", "scheme": "bearer",
                "description": "a tenant's API key (`mhk_...`), or the operator token "
                               "(`MULTIHEAD_ADMIN_TOKEN`)"}},
        },
    }


def package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("multihead")
    except metadata.PackageNotFoundError:
        return "unknown"


def operations(doc: Mapping[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(METHOD, path, operation) of every operation of a document."""
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            yield method.upper(), path, op


# -- the endpoints serving it ------------------------------------------------------------------

def _swagger_ui_dir() -> Path | None:
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return Path(str(swagger_ui_path))


# asset name -> (folder: "static" (ours) or "swagger-ui", content type)
ASSETS: dict[str, tuple[str, str]] = {
    "docs.js": ("static", "text/javascript; charset=utf-8"),
    "swagger-ui.css": ("swagger-ui", "text/css; charset=utf-8"),
    "swagger-ui-bundle.js": ("swagger-ui", "text/javascript; charset=utf-8"),
    "favicon-32x32.png": ("swagger-ui", "image/png"),
    "favicon-16x16.png": ("swagger-ui", "image/png"),
}
PAGE = "docs.html"
# Only this origin: scripts, styles and the document; no inline script. Swagger UI sets inline
# styles, and its images are data: URIs.
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'")


def _asset_path(name: str) -> Path:
    folder, _ = ASSETS[name]
    if folder == "static":
        return STATIC_DIR / name
    root = _swagger_ui_dir()
    if root is None:
        raise NotFound("the docs page needs the swagger-ui-bundle package, which is not "
                       "installed; /openapi.json describes the API")
    return root / name


def endpoints(routes: Callable[[], Sequence[Endpoint]]) -> list[Endpoint]:
    """`GET /openapi.json`, `GET /docs` and `GET /docs/{asset}`.

    Args:
        routes: returns every endpoint to describe (called once, at the first request: the
            route table that holds these endpoints too).
    """
    cache: dict[str, bytes] = {}

    async def load(service: Caller, key: str, path: Path) -> bytes:
        data = cache.get(key)
        if data is None:
            data = cache[key] = await service.run_blocking(path.read_bytes)
        return data

    async def openapi_json(service: Caller, request: Request) -> Reply:
        body = cache.get("openapi.json")
        if body is None:
            body = cache["openapi.json"] = json.dumps(document(routes())).encode()
        return Reply(200, body, JSON, {"Cache-Control": "no-cache"})

    async def docs_page(service: Caller, request: Request) -> Reply:
        _asset_path("swagger-ui-bundle.js")  # 404 naming the package when it is missing
        body = await load(service, PAGE, STATIC_DIR / PAGE)
        return Reply(200, body, "text/html; charset=utf-8",
                     {"Cache-Control": "no-cache", "Content-Security-Policy": PAGE_CSP,
                      "X-Content-Type-Options": "nosniff"})

    async def docs_asset(service: Caller, request: Request) -> Reply:
        name = request.params["asset"]
        if name not in ASSETS:
            raise NotFound(f"no docs asset {name[:64]!r}")
        body = await load(service, name, _asset_path(name))
        return Reply(200, body, ASSETS[name][1],
                     {"Cache-Control": "public, max-age=3600",
                      "X-Content-Type-Options": "nosniff"})

    asset_types = sorted({ctype.split(";")[0] for _, ctype in ASSETS.values()})
    return [
        Endpoint("GET", "/openapi.json", "openapi", openapi_json, access=PUBLIC,
                 summary="this API description (OpenAPI 3.0.3)", tag="docs",
                 answers={200: Answer("the OpenAPI document", {JSON: {"type": "object"}})}),
        Endpoint("GET", "/docs", "docs_page", docs_page, access=PUBLIC,
                 summary="the docs page (Swagger UI over /openapi.json)", tag="docs",
                 answers={200: Answer("the page", {"text/html": {"type": "string"}})},
                 errors=(404,)),
        Endpoint("GET", "/docs/{asset}", "docs_asset", docs_asset, access=PUBLIC,
                 summary="a script, style sheet or icon of the docs page", tag="docs",
                 path_params={"asset": {"type": "string", "enum": sorted(ASSETS)}},
                 answers={200: Answer("the file", {t: {"type": "string", "format": "binary"}
                                                   if t.startswith("image/")
                                                   else {"type": "string"}
                                                   for t in asset_types})},
                 errors=(404,)),
    ]
