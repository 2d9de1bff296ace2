"""The interop protocols answer what /openapi.json says they answer, without a server or trunk.

Each OIP v2 and TF Serving model endpoint is called against the fake service; every reply's
status must be documented for its operation, its JSON body must match the documented schema, its
headers must be documented, and what the request sent (parameters, body) must be what the
operation documents. The document itself must be valid OpenAPI 3.0.

The model endpoints are built here by calling their builders (not taken from the import-time
route table), so that the description checked is the one the code builds now."""
from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import jsonschema
import pytest
from schemathesis.specs.openapi.definitions import OPENAPI_30

from heads import InvalidBotId, validate_bot_id
from service.codecs import admin, native, oip, oip_tensors, openapi, ops, tfserving
from service.codecs.base import JSON, Answer, Body, Endpoint, Param, Reply, dispatch, json_answer
from service.codecs.common import is_number
from service.core.auth import MANAGE, PUBLIC
from service.core.errors import DeadlineExceeded
from tests.support.fakes import FakeService, loading, make_head, req

HEAD = make_head("acme", 2, ["cat", "dog", "eel"])


def model_endpoints() -> list[Endpoint]:
    return [*oip._model_endpoints(), *tfserving._model_endpoints()]


def all_endpoints() -> list[Endpoint]:
    table: list[Endpoint] = []
    table += [*native.ENDPOINTS, *admin.ENDPOINTS, *ops.ENDPOINTS,
              *openapi.endpoints(lambda: table), *oip.ENDPOINTS[:3], *model_endpoints()]
    return table


@pytest.fixture
def described() -> tuple[dict[str, Endpoint], dict[str, Any]]:
    """(endpoints by operation id, the OpenAPI document of them all). Built for each test (not
    once per module): the mutation run maps each function to the tests that call it."""
    table = all_endpoints()
    return {e.name: e for e in table}, openapi.document(table, version="0.0.0")


def operation_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    (op,) = [op for _, _, op in openapi.operations(doc) if op["operationId"] == name]
    return op


def check_schema(doc: dict[str, Any], schema: dict[str, Any], instance: Any) -> None:
    """`instance` against an OpenAPI schema of `doc` (its `$ref`s resolved in the document)."""
    jsonschema.Draft4Validator({**schema, "components": doc["components"]}).validate(instance)


class DeadlineService(FakeService):
    async def classify(self, images, heads, *, top_k, route_key=None, all_scores=False):
        raise DeadlineExceeded("the request's deadline passed while it waited for the trunk")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


INFER = {"inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [1],
                     "data": [b64(b"img")]}]}
INFER_BINARY_OUT = {**INFER, "parameters": {"binary_data_output": True}}
PREDICT = {"instances": [{"b64": b64(b"img")}]}
PREDICT_COLUMNS = {"inputs": [{"b64": b64(b"img")}]}
V2 = {"bot_id": "acme", "version": "2"}

# (operation id, service, path parameters, query, headers, body, the status expected)
CASES = [
    ("oip_model_metadata", {}, {"bot_id": "acme"}, None, None, None, 200),
    ("oip_model_metadata", {}, {"bot_id": "nobody"}, None, None, None, 404),
    ("oip_model_metadata_version", {}, V2, None, None, None, 200),
    ("oip_model_metadata_version", {}, {"bot_id": "acme", "version": "3"}, None, None, None,
     404),
    ("oip_model_metadata_version", {}, {"bot_id": "acme", "version": "v2"}, None, None, None,
     400),
    ("oip_model_ready", {}, {"bot_id": "acme"}, None, None, None, 200),
    ("oip_model_ready", {"readiness": loading()}, {"bot_id": "acme"}, None, None, None, 503),
    ("oip_model_ready", {}, {"bot_id": "nobody"}, None, None, None, 404),
    ("oip_model_ready_version", {}, V2, None, None, None, 200),
    ("oip_infer", {}, {"bot_id": "acme"}, None, None, INFER, 200),
    ("oip_infer", {}, {"bot_id": "acme"}, None, None, INFER_BINARY_OUT, 200),
    ("oip_infer", {}, {"bot_id": "acme"}, None, None, {"inputs": []}, 400),
    ("oip_infer", {}, {"bot_id": "nobody"}, None, None, INFER, 404),
    ("oip_infer", {"broken": {"acme"}}, {"bot_id": "acme"}, None, None, INFER, 500),
    ("oip_infer", {"readiness": loading()}, {"bot_id": "acme"}, None, None, INFER, 503),
    ("oip_infer", "deadline", {"bot_id": "acme"}, None, None, INFER, 504),
    ("oip_infer_version", {}, V2, None, None, INFER, 200),
    ("tfs_status", {}, {"bot_id": "acme"}, None, None, None, 200),
    ("tfs_status", {}, {"bot_id": "nobody"}, None, None, None, 404),
    ("tfs_status_version", {}, {"bot_id": "acme", "version": "x"}, None, None, None, 400),
    ("tfs_metadata", {}, {"bot_id": "acme"}, None, None, None, 200),
    ("tfs_metadata", {}, {"bot_id": "nobody"}, None, None, None, 404),
    ("tfs_metadata_version", {}, {"bot_id": "acme", "version": "x"}, None, None, None, 400),
    ("tfs_predict", {}, {"bot_id": "acme", "verb": "predict"}, {"top_k": "2"}, None, PREDICT,
     200),
    ("tfs_predict", {}, {"bot_id": "acme", "verb": "predict"}, None, None, PREDICT_COLUMNS,
     200),
    ("tfs_predict", {}, {"bot_id": "acme", "verb": "predict"}, None, None, {}, 400),
    ("tfs_predict", {}, {"bot_id": "nobody", "verb": "predict"}, None, None, PREDICT, 404),
    ("tfs_predict", {"broken": {"acme"}}, {"bot_id": "acme", "verb": "predict"}, None, None,
     PREDICT, 500),
    ("tfs_predict", {"readiness": loading()}, {"bot_id": "acme", "verb": "predict"}, None,
     None, PREDICT, 503),
    ("tfs_predict", "deadline", {"bot_id": "acme", "verb": "predict"}, None, None, PREDICT, 504),
    ("tfs_predict_version", {}, {**V2, "verb": "predict"}, None, None, PREDICT, 200),
]


@pytest.mark.parametrize("name, svc, params, query, headers, body, status", CASES,
                         ids=[f"{c[0]}-{c[-1]}-{i}" for i, c in enumerate(CASES)])
async def test_every_answer_is_the_one_documented(described, name, svc, params, query, headers,
                                                  body, status):
    endpoints, doc = described
    endpoint, op = endpoints[name], operation_of(doc, name)
    service = (DeadlineService(heads={"acme": HEAD}) if svc == "deadline"
               else FakeService(heads={"acme": HEAD}, **svc))
    raw = None if body is None else json.dumps(body).encode()
    reply = await dispatch(service, endpoint, req(endpoint.method, endpoint.path, params=params,
                                                  query=query, headers=headers, body=raw))
    assert reply.status == status, reply.body[:200]
    _check_request(doc, op, params, query, body if status != 400 else None)
    _check_reply(doc, op, reply)


def _check_request(doc, op, params, query, body) -> None:
    """What the request sent is documented (its body, when the server took it as valid)."""
    documented = {(p["in"], p["name"]): p for p in op.get("parameters", [])}
    for name in params:
        assert ("path", name) in documented, name
    for name, value in (query or {}).items():
        check_schema(doc, documented[("query", name)]["schema"], int(value))
    if body is not None:
        check_schema(doc, op["requestBody"]["content"][JSON]["schema"], body)


def _check_reply(doc, op, reply: Reply) -> None:
    response = op["responses"].get(str(reply.status))
    assert response is not None, (reply.status, sorted(op["responses"]))
    documented_headers = set(response.get("headers", {}))
    assert set(reply.headers) <= documented_headers, (set(reply.headers), documented_headers)
    assert {h for h, spec in response.get("headers", {}).items() if spec["required"]} <= set(
        reply.headers)
    assert reply.content_type in response["content"], (reply.content_type, response)
    if reply.content_type == JSON:
        check_schema(doc, response["content"][JSON]["schema"], json.loads(reply.body))
    else:
        header_length = int(reply.headers[oip_tensors.HEADER_LENGTH])
        check_schema(doc, response["content"][JSON]["schema"],
                     json.loads(reply.body[:header_length]))


def test_the_binary_request_form_of_infer_is_documented_with_its_header(described):
    endpoints, doc = described
    for name in ("oip_infer", "oip_infer_version"):
        op = operation_of(doc, name)
        assert op["requestBody"]["content"]["application/octet-stream"]["schema"]["format"] \
            == "binary"
        (header,) = [p for p in op["parameters"] if p["in"] == "header"]
        assert header["name"] == oip_tensors.HEADER_LENGTH and header["required"] is False
        check_schema(doc, header["schema"], 123)


def test_the_document_is_valid_openapi_3_0(described):
    _, doc = described
    jsonschema.Draft4Validator(OPENAPI_30).validate(doc)


def test_every_operation_is_tagged_with_a_described_protocol(described):
    _, doc = described
    tags = {t["name"] for t in doc["tags"]}
    for _, _, op in openapi.operations(doc):
        assert len(op["tags"]) == 1 and op["tags"][0] in tags, op["operationId"]
    protocols = {op["operationId"]: op["tags"][0] for _, _, op in openapi.operations(doc)}
    assert {protocols[e.name] for e in oip._model_endpoints()} == {"oip-v2"}
    assert {protocols[e.name] for e in tfserving._model_endpoints()} == {"tf-serving"}


@pytest.mark.parametrize("value", ["acme", "a", "A.b_c-9", "x" * 64, "", "x" * 65, "-a", ".a",
                                   "a/b", "a b", "é", "a:b"])
def test_documented_bot_ids_are_exactly_the_ones_the_server_accepts(described, value):
    _, doc = described
    try:
        validate_bot_id(value)
        accepted = True
    except InvalidBotId:
        accepted = False
    for _, path, op in openapi.operations(doc):
        for p in op.get("parameters", []):
            if p["in"] == "path" and p["name"] == "bot_id":
                valid = jsonschema.Draft4Validator(p["schema"] if "$ref" not in p["schema"]
                                                   else {**p["schema"],
                                                         "components": doc["components"]}
                                                   ).is_valid(value)
                assert valid is accepted, (path, value)


@pytest.mark.parametrize("value", ["2", "0", "007", "x", "", "²", "1.0", "-1"])
def test_documented_versions_are_numbers_as_the_server_reads_them(described, value):
    _, doc = described
    versioned = [op for _, path, op in openapi.operations(doc) if "{version}" in path]
    assert len(versioned) == 6  # OIP v2: metadata, ready, infer; TF Serving: status,
    # metadata, predict
    for op in versioned:
        (p,) = [p for p in op["parameters"] if p["name"] == "version"]
        assert jsonschema.Draft4Validator(p["schema"]).is_valid(value) is is_number(value)


def test_model_endpoints_are_the_routed_ones():
    # What is routed (method, path, id, handler) is what is described.
    routed = [dataclasses.astuple(e)[:4] for e in (*oip.ENDPOINTS[3:], *tfserving.ENDPOINTS)]
    assert [dataclasses.astuple(e)[:4] for e in model_endpoints()] == routed


# -- the endpoints serving the description -------------------------------------------------------


def docs_endpoints(routes) -> dict[str, Endpoint]:
    return {e.name: e for e in openapi.endpoints(routes)}


async def test_openapi_json_is_the_document_of_the_routes_built_once():
    calls = []

    def routes():
        calls.append(1)
        return model_endpoints()

    svc, endpoint = FakeService(), docs_endpoints(routes)["openapi"]
    replies = [await dispatch(svc, endpoint, req("GET", "/openapi.json")) for _ in range(2)]
    for reply in replies:
        assert (reply.status, reply.content_type, dict(reply.headers)) == (
            200, JSON, {"Cache-Control": "no-cache"})
        assert json.loads(reply.body) == openapi.document(model_endpoints())
    assert calls == [1]


async def test_the_docs_page_is_served_from_the_package_with_a_strict_policy():
    svc, endpoint = FakeService(), docs_endpoints(model_endpoints)["docs_page"]
    for _ in range(2):
        reply = await dispatch(svc, endpoint, req("GET", "/docs"))
        assert (reply.status, reply.content_type) == (200, "text/html; charset=utf-8")
        assert reply.body == (openapi.STATIC_DIR / "docs.html").read_bytes()
        assert dict(reply.headers) == {
            "Cache-Control": "no-cache", "Content-Security-Policy": openapi.PAGE_CSP,
            "X-Content-Type-Options": "nosniff"}
    assert svc.blocking == ["read_bytes"]  # read once, off the event loop


@pytest.mark.parametrize("name", sorted(openapi.ASSETS))
async def test_each_docs_asset_is_served_with_its_type(name):
    svc, endpoint = FakeService(), docs_endpoints(model_endpoints)["docs_asset"]
    folder, content_type = openapi.ASSETS[name]
    root = openapi.STATIC_DIR if folder == "static" else openapi._swagger_ui_dir()
    for _ in range(2):
        reply = await dispatch(svc, endpoint, req("GET", f"/docs/{name}", params={"asset": name}))
        assert (reply.status, reply.content_type) == (200, content_type)
        assert reply.body == (root / name).read_bytes()
        assert dict(reply.headers) == {"Cache-Control": "public, max-age=3600",
                                       "X-Content-Type-Options": "nosniff"}
    assert svc.blocking == ["read_bytes"]


async def test_an_unknown_docs_asset_is_404_naming_it_cut_short():
    svc, endpoint = FakeService(), docs_endpoints(model_endpoints)["docs_asset"]
    name = "../" + "x" * 100
    reply = await dispatch(svc, endpoint, req("GET", "/docs/x", params={"asset": name}))
    assert reply.status == 404
    assert json.loads(reply.body) == {"error": f"no docs asset {name[:64]!r}",
                                      "code": "not_found"}


async def test_without_the_swagger_ui_package_the_docs_are_404_naming_it(monkeypatch):
    monkeypatch.setattr(openapi, "_swagger_ui_dir", lambda: None)
    svc, endpoints = FakeService(), docs_endpoints(model_endpoints)
    message = ("the docs page needs the swagger-ui-bundle package, which is not installed; "
               "/openapi.json describes the API")
    for name, params in (("docs_page", {}), ("docs_asset", {"asset": "swagger-ui.css"})):
        reply = await dispatch(svc, endpoints[name], req("GET", "/docs", params=params))
        assert (reply.status, json.loads(reply.body)) == (
            404, {"error": message, "code": "not_found"})
    ours = await dispatch(svc, endpoints["docs_asset"],
                          req("GET", "/docs/docs.js", params={"asset": "docs.js"}))
    assert ours.status == 200  # the page's own script needs no package


def test_the_docs_endpoints_document_their_assets(described):
    _, doc = described
    op = operation_of(doc, "docs_asset")
    (param,) = op["parameters"]
    assert param["schema"]["enum"] == sorted(openapi.ASSETS)
    content = op["responses"]["200"]["content"]
    assert set(content) == {t.split(";")[0] for _, t in openapi.ASSETS.values()}
    assert content["image/png"]["schema"] == {"type": "string", "format": "binary"}
    assert content["text/css"]["schema"] == {"type": "string"}
    assert set(operation_of(doc, "docs_page")["responses"]) == {"200", "404"}
    assert operation_of(doc, "openapi")["responses"]["200"]["content"][JSON]["schema"] == {
        "type": "object"}


# -- rules of the generator ------------------------------------------------------------------------


async def _never(service, request):  # pragma: no cover - never called
    raise AssertionError


OK = {200: json_answer("ok", {"type": "object"})}


@pytest.mark.parametrize("endpoints, message", [
    ([Endpoint("GET", "/a", "a", _never, access=PUBLIC, answers={204: Answer("done")}),
      Endpoint("GET", "/b", "b", _never, access=PUBLIC, answers={300: Answer("elsewhere")})],
     "b documents no 2xx answer"),
    ([Endpoint("GET", "/a", "a", _never, access=PUBLIC, answers=OK),
      Endpoint("GET", "/b", "a", _never, access=PUBLIC, answers=OK)], "operation id 'a' used twice"),
    ([Endpoint("GET", "/a", "a", _never, access=PUBLIC, answers=OK),
      Endpoint("get", "/a", "b", _never, access=PUBLIC, answers=OK)], "get /a is routed twice"),
    ([Endpoint("GET", "/a/{x}", "a", _never, access=PUBLIC, answers=OK, path_params={"y": {}, "z": {}})],
     "a: path_params ['y', 'z'] are not in /a/{x}"),
    ([Endpoint("GET", "/a", "a", _never, access=PUBLIC, errors=(503, 500),
               answers={**OK, 503: Answer("loading"), 500: Answer("broken")})],
     "a: status [500, 503] is both an answer and an error"),
    ([Endpoint("GET", "/a", "a", _never, access=PUBLIC,
               answers={200: json_answer("ok", {"title": "T", "type": "string"})}),
      Endpoint("GET", "/b", "b", _never, access=PUBLIC,
               answers={200: json_answer("ok", {"title": "T", "type": "integer"})})],
     "two different schemas are titled 'T'"),
])
def test_an_inconsistent_description_is_refused_naming_the_problem(endpoints, message):
    with pytest.raises(ValueError) as info:
        openapi.document(endpoints, version="0")
    assert str(info.value) == message


def test_the_rules_every_operation_gets():
    titled = {"title": "Thing", "type": "object", "properties": {
        "part": {"title": "Part", "type": "string"}, "parts": {
            "type": "array", "items": {"title": "Part", "type": "string"}}}}
    admin_upload = Endpoint(
        "PUT", "/things/{name:[a-z]+}", "put_thing", _never, access=MANAGE, tag="bots",
        summary="put a thing", description="*longer*",
        params=(Param("q", "query", {"type": "integer"}, "how many", True),
                Param("X-Hint", "header", {"type": "string"})),
        body=Body({"multipart/form-data": titled}, "the thing", required=False,
                  encoding={"multipart/form-data": {"part": {"contentType": "text/plain"}}}),
        answers={201: Answer("made", {JSON: titled}, {"Location": ("where it is", True)})},
        errors=(400, 401))
    plain = Endpoint("GET", "/things", "list_things", _never, access=PUBLIC, answers=OK)
    doc = openapi.document([admin_upload, plain], version="1.2.3")
    assert (doc["openapi"], doc["info"]["title"], doc["info"]["version"]) == (
        "3.0.3", "multihead", "1.2.3")
    assert doc["tags"] == [{"name": "bots", "description": openapi.TAGS["bots"]}]
    assert doc["components"]["securitySchemes"]["adminToken"]["scheme"] == "bearer"
    assert sorted(doc["components"]["schemas"]) == ["Error", "Part", "Thing"]
    thing = doc["components"]["schemas"]["Thing"]
    assert thing["properties"]["part"] == {"$ref": "#/components/schemas/Part"}
    assert thing["properties"]["parts"]["items"] == {"$ref": "#/components/schemas/Part"}
    op = doc["paths"]["/things/{name}"]["put"]
    assert (op["operationId"], op["summary"], op["description"], op["tags"]) == (
        "put_thing", "put a thing", "*longer*", ["bots"])
    assert op["parameters"] == [
        {"name": "name", "in": "path", "required": True,
         "schema": {"type": "string", "minLength": 1}},
        {"name": "q", "in": "query", "required": True, "schema": {"type": "integer"},
         "description": "how many"},
        {"name": "X-Hint", "in": "header", "required": False, "schema": {"type": "string"}}]
    assert op["requestBody"] == {
        "required": False, "description": "the thing",
        "content": {"multipart/form-data": {
            "schema": {"$ref": "#/components/schemas/Thing"},
            "encoding": {"part": {"contentType": "text/plain"}}}}}
    assert list(op["responses"]) == ["201", "400", "401", "403", "413", "503"]
    assert op["responses"]["201"] == {
        "description": "made", "content": {JSON: {"schema": {"$ref": "#/components/schemas/Thing"}}},
        "headers": {"Location": {"description": "where it is", "required": True,
                                 "schema": {"type": "string"}}}}
    error = {"$ref": "#/components/schemas/Error"}
    for status in ("400", "401", "403", "413", "503"):
        assert op["responses"][status]["content"] == {JSON: {"schema": error}}
        assert op["responses"][status]["description"] == openapi.ERROR_TEXT[int(status)]
    assert op["responses"]["401"]["headers"]["WWW-Authenticate"]["required"] is True
    assert op["responses"]["503"]["headers"]["Retry-After"]["required"] is False
    assert "headers" not in op["responses"]["400"]
    assert op["security"] == [{"adminToken": []}]
    listed = doc["paths"]["/things"]["get"]
    assert set(listed) == {"operationId", "summary", "responses"}  # no tag, params, body, auth
    assert [(m, p) for m, p, _ in openapi.operations(doc)] == [
        ("PUT", "/things/{name}"), ("GET", "/things")]


def test_the_version_defaults_to_the_installed_package():
    from importlib import metadata

    doc = openapi.document([Endpoint("GET", "/a", "a", _never, access=PUBLIC, answers=OK)])
    assert doc["info"]["version"] == metadata.version("multihead")


@pytest.mark.parametrize("template, path, names", [
    ("/classify/{bot_id}", "/classify/{bot_id}", ["bot_id"]),
    ("/v2/models/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}/infer",
     "/v2/models/{bot_id}/versions/{version}/infer", ["bot_id", "version"]),
    ("/v1/models/{bot_id:[^{}/:]+}:{verb}", "/v1/models/{bot_id}:{verb}", ["bot_id", "verb"]),
    ("/x/{n:[0-9]{1,3}}", "/x/{n}", ["n"]),
])
def test_route_templates_become_openapi_paths(template, path, names):
    assert openapi.openapi_path(template) == path
    assert openapi.path_param_names(template) == names


# -- the docs endpoints, built here (the route table's copy is built before a mutant applies) -------

def test_the_docs_endpoints_are_the_routed_ones_and_every_operation_has_a_summary(described):
    from service.codecs.routes import ENDPOINTS

    _, doc = described
    routed = {e.name: (e.method, e.path) for e in ENDPOINTS}
    for e in openapi.endpoints(lambda: []):
        assert (e.method, e.path) == routed[e.name], e.name
    for method, path, op in openapi.operations(doc):
        assert op["summary"].strip(), (method, path)
    page = operation_of(doc, "docs_page")["responses"]
    assert page["200"]["content"] == {"text/html": {"schema": {"type": "string"}}}
    assert set(operation_of(doc, "docs_asset")["responses"]) == {"200", "404"}


async def test_docs_assets_are_read_once_each_and_cached_by_name():
    by_name = {e.name: e for e in openapi.endpoints(lambda: [])}
    service = FakeService()
    bodies = {}
    for name in ("docs.js", "swagger-ui.css", "docs.js", "swagger-ui.css"):
        reply = await by_name["docs_asset"].handle(service, req(params={"asset": name}))
        assert reply.status == 200 and reply.content_type == openapi.ASSETS[name][1]
        assert reply.body == openapi._asset_path(name).read_bytes(), name
        bodies.setdefault(name, reply.body)
        assert reply.body == bodies[name]
    assert bodies["docs.js"] != bodies["swagger-ui.css"]
    assert service.blocking == ["read_bytes", "read_bytes"]  # one read per asset, then cached


def _schemas(node: Any):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schemas(value)


def test_required_fields_are_documented_properties_and_binary_media_is_binary(described):
    """A renamed property would leave `required` naming a field the schema no longer types; a
    binary body or answer without `format: binary` is text to client generators."""
    _, doc = described
    for schema in _schemas(doc):
        if "required" in schema and "properties" in schema:
            assert set(schema["required"]) <= set(schema["properties"]), schema
    binary = 0
    for _, _, op in openapi.operations(doc):
        contents = [op.get("requestBody", {}).get("content", {})]
        contents += [answer.get("content", {}) for answer in op["responses"].values()]
        for content in contents:
            for media, entry in content.items():
                if media == "application/octet-stream" or media in ("image/*", "image/png"):
                    assert entry["schema"]["format"] == "binary", (op["operationId"], media)
                    binary += 1
    assert binary >= 4  # image uploads, infer's binary request and answer, the favicons
