"""The tenancy codec (`service.codecs.tenancy`): tenants and their limits over HTTP, through
`dispatch` on the real `Service` and a real directory store (no trunk, no server: the tenancy
routes need neither); every answer checked against the API description. The same routes on a
real server, with every credential: test_auth.py."""
from __future__ import annotations

import asyncio
import copy
import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accounts.tenants import LIMIT_NAMES, TenantLimits, validate_limit
from service.codecs import openapi, tenancy
from service.codecs.base import JSON, Reply, dispatch
from service.codecs.routes import ENDPOINTS
from service.core.service import Service
from store import HeadStore
from tests.support.fakes import req
from tests.support.limits import JSON_LIMIT_VALUES, LIMITS_OBJECTS, accepted_limit
from tests.support.servers import make_settings

TOKEN = "operator-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON_TYPE = {**AUTH, "Content-Type": "application/json"}
ENDPOINT = {e.name: e for e in tenancy.ENDPOINTS}
DOCUMENT = openapi.document(ENDPOINTS, version="0.0.0")
NO_LIMITS = dict.fromkeys(LIMIT_NAMES)


@pytest.fixture
def service(tmp_path):
    store = HeadStore(tmp_path / "store")
    store.add_tenant("acme")
    yield Service(make_settings(tmp_path, admin_token=TOKEN), store=store)
    store.close()


def call(service, name: str, tenant: str | None = None, body: bytes | None = None,
         headers: dict | None = None) -> Reply:
    """One request to endpoint `name` through `dispatch`, its answer checked against the
    document."""
    endpoint = ENDPOINT[name]
    params = {"tenant": tenant} if tenant is not None else {}
    reply = asyncio.run(dispatch(service, endpoint, req(
        endpoint.method, endpoint.path, params=params, body=body,
        headers=JSON_TYPE if headers is None else headers)))
    assert reply.status < 500, reply.body[:300]
    _documented(name, reply)
    return reply


def _nullable(schema):
    """An OpenAPI 3.0 schema as JSON Schema draft 4: `nullable: true` -> type or null."""
    if isinstance(schema, dict):
        out = {k: _nullable(v) for k, v in schema.items() if k != "nullable"}
        if schema.get("nullable"):
            out["type"] = [schema["type"], "null"]
        return out
    if isinstance(schema, list):
        return [_nullable(v) for v in schema]
    return schema


def _documented(name: str, reply: Reply) -> None:
    (op,) = [op for _, _, op in openapi.operations(DOCUMENT) if op["operationId"] == name]
    response = op["responses"].get(str(reply.status))
    assert response is not None, (name, reply.status, sorted(op["responses"]))
    schema = response["content"][JSON]["schema"]
    jsonschema.Draft4Validator(_nullable({**schema, "components": copy.deepcopy(
        DOCUMENT["components"])})).validate(json.loads(reply.body))


def js(obj) -> bytes:
    return json.dumps(obj).encode()


def body_of(reply: Reply):
    return json.loads(reply.body)


# -- the routes ----------------------------------------------------------------------------------


def test_a_tenant_is_added_with_limits_changed_and_listed(service):
    reply = call(service, "put_tenant", "globex", js({"weight": 2, "rate": 12.5}))
    assert reply.status == 201
    assert body_of(reply)["limits"] == {**NO_LIMITS, "weight": 2.0, "rate": 12.5}
    assert call(service, "put_tenant", "initech", b"", AUTH).status == 201  # no body: defaults
    reply = call(service, "patch_tenant", "globex", js({"burst": 40, "rate": None}))
    assert reply.status == 200 and body_of(reply) == {
        "name": "globex", "limits": {**NO_LIMITS, "weight": 2.0, "burst": 40}}
    reply = call(service, "patch_tenant", "default", js({"max_queued": 100.0}))
    assert body_of(reply)["limits"] == {**NO_LIMITS, "max_queued": 100}
    listed = body_of(call(service, "list_tenants", headers=AUTH))["tenants"]
    assert {t["name"]: t["limits"] for t in listed} == {
        "acme": NO_LIMITS, "default": {**NO_LIMITS, "max_queued": 100},
        "globex": {**NO_LIMITS, "weight": 2.0, "burst": 40}, "initech": NO_LIMITS}
    store = service.store
    assert store.tenant_limits()["globex"] == TenantLimits(weight=2, burst=40)
    assert [(r.actor, r.action, r.tenant, r.detail) for r in store.audit()] == [
        ("operator", "tenant_add", "acme", None),
        ("operator", "tenant_add", "globex", "weight=2 rate=12.5"),
        ("operator", "tenant_add", "initech", None),
        ("operator", "tenant_set", "globex", "rate=default burst=40"),
        ("operator", "tenant_set", "default", "max_queued=100")]


@pytest.mark.parametrize("name, tenant, body, headers, status, code, names", [
    ("patch_tenant", "acme", {"weight": 0}, None, 400, "invalid_limits",
     "weight must be a number > 0 and <= 1000, got 0"),
    ("patch_tenant", "acme", {"rate": "fast"}, None, 400, "invalid_limits", "rate must be"),
    ("patch_tenant", "acme", {"burst": 2.5}, None, 400, "invalid_limits",
     "burst must be a whole number from 1 to 1000000, got 2.5"),
    ("patch_tenant", "acme", {"max_queued": True}, None, 400, "invalid_limits", "got True"),
    ("patch_tenant", "acme", b'{"rate": NaN}', None, 400, "invalid_limits", "got nan"),
    ("patch_tenant", "acme", b'{"rate": 1e999}', None, 400, "invalid_limits", "got inf"),
    ("patch_tenant", "acme", b'{"weight": -Infinity}', None, 400, "invalid_limits",
     "got -inf"),
    ("patch_tenant", "acme", {"weight": 1, "speed": 3}, None, 400, "bad_request",
     "unknown field(s) 'speed': the limits are weight, rate, burst, max_queued"),
    ("patch_tenant", "acme", {}, None, 400, "invalid_limits", "no limit to change"),
    ("patch_tenant", "acme", [1], None, 400, "bad_request", "must be a JSON object"),
    ("patch_tenant", "acme", b"{", None, 400, "bad_request", "not valid JSON"),
    ("patch_tenant", "acme", {"weight": 1}, {**AUTH, "Content-Type": "text/plain"}, 415,
     "unsupported_media_type", "application/json"),
    ("patch_tenant", "nobody", {"weight": 1}, None, 404, "unknown_tenant", "'nobody'"),
    ("patch_tenant", "a..b/", {"weight": 1}, None, 400, "invalid_tenant", "a..b/"),
    ("patch_tenant", "acme", {"weight": 1}, {}, 401, "unauthorized", "Bearer"),
    ("put_tenant", "globex", {"weight": 1e4}, None, 400, "invalid_limits", "weight must be"),
    ("put_tenant", "globex", {"limits": {}}, None, 400, "bad_request", "'limits'"),
    ("put_tenant", "globex", {"weight": 1}, {**AUTH, "Content-Type": "text/plain"}, 415,
     "unsupported_media_type", "PUT /tenants/{tenant}"),
    ("put_tenant", "acme", {"weight": 1}, None, 409, "tenant_exists", "'acme'"),
])
def test_a_refusal_names_the_field_and_changes_nothing(service, name, tenant, body, headers,
                                                        status, code, names):
    before = (service.store.tenants(), service.store.audit())
    raw = body if isinstance(body, bytes) else js(body)
    reply = call(service, name, tenant, raw, headers)
    error = body_of(reply)
    assert (reply.status, error["code"]) == (status, code), error
    assert names in error["error"] and "\n" not in error["error"], error
    assert (service.store.tenants(), service.store.audit()) == before


# -- any body ------------------------------------------------------------------------------------

# NOTE: one store for every example (the function-scoped fixture): each starts from the limits
# the previous ones left.
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=st.one_of(LIMITS_OBJECTS, JSON_LIMIT_VALUES, st.binary(max_size=16)))
def test_any_patch_body_is_applied_or_refused_in_one_line_naming_the_field(service, body):
    before = service.store.tenant_limits()["acme"]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = call(service, "patch_tenant", "acme", raw)
    answer = body_of(reply)
    valid = (isinstance(body, dict) and body and set(body) <= set(LIMIT_NAMES)
             and all(accepted_limit(n, v) for n, v in body.items()))
    if not valid:
        assert reply.status == 400 and answer["code"] in ("bad_request", "invalid_limits"), \
            (body, answer)
        assert "\n" not in answer["error"] and len(answer["error"]) < 200, answer
        if answer["code"] == "invalid_limits" and isinstance(body, dict) and body:
            bad = [n for n, v in body.items() if n in LIMIT_NAMES and not accepted_limit(n, v)]
            assert answer["error"].split(" ", 1)[0] in bad, (body, answer)
        assert service.store.tenant_limits()["acme"] == before
        return
    assert reply.status == 200, (body, answer)
    # JSON carries floats exactly (repr): what was sent is what is kept.
    want = {**before.to_dict(), **{n: validate_limit(n, v) for n, v in body.items()}}
    assert answer["limits"] == want
    assert service.store.tenant_limits()["acme"].to_dict() == want
