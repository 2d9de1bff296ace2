"""The API description as a document: /openapi.json is generated from the route table
(`service.codecs.routes.ENDPOINTS`), valid OpenAPI 3.0, and says what each operation takes and answers.

Fast (no trunk, no server), so `make mutation` runs it against `service/codecs/openapi.py`; the
served document, the docs page and Schemathesis over a real server are in test_openapi.py.
"""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from heads import InvalidBotId, validate_bot_id
from service.codecs import openapi
from service.codecs.common import BOT_ID_PATTERN
from service.codecs.routes import ENDPOINTS
from service.core.auth import PUBLIC

# Operations anyone may call: every other one needs a credential (`security`, 401/403).
PUBLIC_OPERATIONS = {e.name for e in ENDPOINTS if e.access == PUBLIC}


def document() -> dict:
    return openapi.document(ENDPOINTS)


# -- the document --------------------------------------------------------------------------------

def test_the_document_lists_exactly_the_routes_of_the_route_table():
    doc = document()
    listed = sorted((method, path) for method, path, _ in openapi.operations(doc))
    assert listed == sorted((e.method, openapi.openapi_path(e.path)) for e in ENDPOINTS)
    assert len(listed) == len(ENDPOINTS) == len(set(listed))
    assert sorted(op["operationId"] for _, _, op in openapi.operations(doc)) == \
        sorted(e.name for e in ENDPOINTS)


def test_the_app_serves_no_api_route_that_the_route_table_lacks(tmp_path):
    from service.core.settings import Settings
    from service.transports.http.app import create_app

    app = create_app(Settings(store=str(tmp_path / "store")))
    served = {(r.method, r.resource.canonical) for r in app.router.routes()}
    api = {(e.method, openapi.openapi_path(e.path)) for e in ENDPOINTS}
    assert api <= served
    # What the aiohttp app serves besides the API: the web page and its files.
    assert served - api == {("GET", "/"), ("HEAD", "/"), ("GET", "/static"),
                            ("HEAD", "/static")}


def test_every_operation_documents_its_parameters_answers_and_errors():
    doc = document()
    endpoints = {e.name: e for e in ENDPOINTS}
    error_ref = {"$ref": "#/components/schemas/Error"}
    for method, path, op in openapi.operations(doc):
        where, endpoint = f"{method} {path}", endpoints[op["operationId"]]
        assert op["summary"] and op["tags"], where
        in_path = [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]
        assert in_path == re.findall(r"\{(\w+)\}", path), where
        # A 2xx, or the upgrade of a streaming endpoint (a WebSocket).
        assert any(s.startswith("2") for s in op["responses"]) or (
            endpoint.stream is not None and "101" in op["responses"]), where
        assert all(a["description"] for a in op["responses"].values()), where
        errors = openapi.error_statuses(endpoint)
        for status in errors:
            assert op["responses"][str(status)]["content"]["application/json"]["schema"] == \
                error_ref, (where, status)
        if endpoint.body is not None:
            assert op["requestBody"]["content"], where
            assert {413, 503} <= set(errors), where
        if endpoint.access != PUBLIC:
            assert op["security"] == [{"adminToken": []}]
            assert {401, 403} <= set(errors), where
            assert "WWW-Authenticate" in op["responses"]["401"]["headers"]
        else:
            assert "security" not in op, where
    open_ops = {op["operationId"] for _, _, op in openapi.operations(doc) if "security" not in op}
    assert open_ops == PUBLIC_OPERATIONS
    assert {"healthz", "readyz", "openapi", "oip_server_live"} <= open_ops
    assert "bearer" == doc["components"]["securitySchemes"]["adminToken"]["scheme"]


def test_image_bodies_are_binary_or_multipart():
    ops = {op["operationId"]: op for _, _, op in openapi.operations(document())}
    content = ops["classify"]["requestBody"]["content"]
    assert content["image/*"]["schema"]["format"] == "binary"
    assert content["application/octet-stream"]["schema"]["format"] == "binary"
    image = content["multipart/form-data"]["schema"]["properties"]["image"]
    assert image["items"]["format"] == "binary"
    assert content["multipart/form-data"]["encoding"] == {"image": {"contentType": "image/*"}}
    upload = ops["put_bot"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert set(upload["required"]) == {"index", "data", "labels"}
    infer = ops["oip_infer"]["requestBody"]["content"]
    assert set(infer) == {"application/json", "application/octet-stream"}
    assert {p["name"] for p in ops["oip_infer"]["parameters"]} == {
        "bot_id", "Inference-Header-Content-Length"}


def test_the_document_is_valid_openapi_3_0():
    import jsonschema_rs
    from schemathesis.specs.openapi.definitions import OPENAPI_30

    doc = document()
    assert doc["openapi"] == "3.0.3"
    errors = [str(e) for e in jsonschema_rs.Draft4Validator(OPENAPI_30).iter_errors(doc)]
    assert errors == []
    # Every $ref resolves.
    refs = set(re.findall(r'"\$ref": "#/components/schemas/(\w+)"', json.dumps(doc)))
    assert refs and refs <= set(doc["components"]["schemas"])


@pytest.mark.parametrize("template,path", [
    ("/classify/{bot_id}", "/classify/{bot_id}"),
    ("/v2/models/{bot_id:[^{}/:]+}/versions/{version:[^{}/:]+}/infer",
     "/v2/models/{bot_id}/versions/{version}/infer"),
    ("/v1/models/{bot_id:[^{}/:]+}:{verb}", "/v1/models/{bot_id}:{verb}"),
    ("/x/{n:[0-9]{1,3}}", "/x/{n}"),
])
def test_route_templates_become_openapi_paths(template, path):
    assert openapi.openapi_path(template) == path
    assert openapi.path_param_names(template) == re.findall(r"\{(\w+)\}", path)


def _ecma_full_match(pattern: str, text: str) -> bool:
    # JSON Schema patterns are ECMA 262: `$` is the end of the text (never before a final \n).
    assert pattern.startswith("^") and pattern.endswith("$")
    return re.fullmatch(pattern[1:-1], text) is not None


def _valid(bot_id: str) -> bool:
    try:
        validate_bot_id(bot_id)
    except InvalidBotId:
        return False
    return True


@given(st.one_of(st.text(max_size=70), st.from_regex(BOT_ID_PATTERN[1:-1], fullmatch=True),
                 st.text(alphabet="aZ09._-/\n ", max_size=66)))
def test_the_documented_bot_id_pattern_is_what_the_store_accepts(text):
    assert _ecma_full_match(BOT_ID_PATTERN, text) == _valid(text)
