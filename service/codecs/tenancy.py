"""Tenants, their limits, API keys and the audit log over HTTP: what `multihead
tenants|keys|audit` do on the CLI. The operator's (`OPERATOR` access), except `GET /audit`,
which a manage key may call for its own tenant (`MANAGE`; `Caller.audit` narrows it).

A tenant's limits (fair sharing, `accounts.tenants.LIMITS`) are a JSON object
`{"weight": .., "rate": .., "burst": .., "max_queued": ..}`: in the optional body of
`PUT /tenants/{tenant}`, and the body of `PATCH /tenants/{tenant}`, where a field given sets
its limit (null: back to the serve default) and the others stay. An unknown field is 400
`bad_request`, a value out of its range 400 `invalid_limits`, each naming the field.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from accounts.tenants import (
    LIMIT_NAMES,
    LIMITS,
    SCOPES,
    TenantLimits,
    validate_limits,
    validate_tenant,
)
from service.codecs.base import Body, Endpoint, Param, Reply, Request, json_answer, json_reply
from service.codecs.common import BOT_ID_PATTERN, is_number, parse_json_object
from service.core.auth import MANAGE, OPERATOR
from service.core.errors import BadRequest, UnsupportedMediaType

if TYPE_CHECKING:  # pragma: no cover
    from service.core.caller import Caller

AUDIT_LIMIT_MAX = 10_000
_TRUE = ("1", "true", "yes")


def _flag(request: Request, name: str) -> bool:
    value = request.query.get(name)
    if value is None:
        return False
    if value.lower() not in (*_TRUE, "0", "false", "no"):
        raise BadRequest(f"{name} must be true or false, got '{value[:32]}'")
    return value.lower() in _TRUE


async def list_tenants(service: Caller, request: Request) -> Reply:
    return json_reply({"tenants": [t.to_dict() for t in await service.tenants()]})


def parse_limits(raw: bytes | bytearray) -> dict[str, float | int | None]:
    """The limits of a JSON object body ({name: value}, null for the serve default), checked
    by the store's validator (`accounts.tenants.validate_limits`: InvalidLimits naming the
    field); an unknown field is BadRequest."""
    body = parse_json_object(bytes(raw), "the request body")
    unknown = sorted(set(body) - set(LIMIT_NAMES))
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        shown = names if len(names) <= 40 else names[:37] + "..."
        raise BadRequest(f"unknown field(s) {shown}: the limits are {', '.join(LIMIT_NAMES)}")
    return validate_limits(**body)


def _json_body(request: Request, route: str) -> None:
    if request.content_type != "application/json":
        raise UnsupportedMediaType(f"{route} takes application/json: {{\"weight\": 2, "
                                   "\"rate\": 50, ...}")


async def put_tenant(service: Caller, request: Request) -> Reply:
    name = validate_tenant(request.params["tenant"])  # refused before the body is read
    raw = await request.body()
    limits = None
    if raw.strip():
        _json_body(request, "PUT /tenants/{tenant}")
        limits = TenantLimits(**parse_limits(raw))
    info = await service.add_tenant(name, limits=limits)
    return json_reply(info.to_dict(), status=201)


async def patch_tenant(service: Caller, request: Request) -> Reply:
    name = validate_tenant(request.params["tenant"])
    _json_body(request, "PATCH /tenants/{tenant}")
    changes = parse_limits(await request.body())
    limits = await service.set_tenant_limits(name, **changes)
    return json_reply({"name": name, "limits": limits.to_dict()})


async def delete_tenant(service: Caller, request: Request) -> Reply:
    name = request.params["tenant"]
    await service.remove_tenant(name, force=_flag(request, "force"))
    return json_reply({"tenant": name, "removed": True})


async def list_keys(service: Caller, request: Request) -> Reply:
    keys = await service.keys(request.query.get("tenant"))
    return json_reply({"keys": [k.to_dict() for k in keys]})


def parse_new_key(raw: bytes | bytearray) -> tuple[str, str]:
    """(tenant, scope) of a `POST /keys` body `{"tenant": "...", "scope": "infer"}`."""
    body = parse_json_object(bytes(raw), "the request body")
    tenant, scope = body.get("tenant"), body.get("scope", "infer")
    if not isinstance(tenant, str) or not tenant:
        raise BadRequest("the body needs \"tenant\": the tenant's name")
    if scope not in SCOPES:
        raise BadRequest(f"\"scope\" must be one of {', '.join(SCOPES)}")
    unknown = set(body) - {"tenant", "scope"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))[:64]}")
    return tenant, scope


async def post_key(service: Caller, request: Request) -> Reply:
    if request.content_type != "application/json":
        raise UnsupportedMediaType("POST /keys takes application/json: "
                                   "{\"tenant\": \"...\", \"scope\": \"infer\"}")
    tenant, scope = parse_new_key(await request.body())
    key, token = await service.add_key(tenant, scope)
    # NOTE: the one time the secret leaves the server; never stored, logged or shown again.
    return json_reply({**key.to_dict(), "token": token}, status=201,
                      headers={"Cache-Control": "no-store"})


async def delete_key(service: Caller, request: Request) -> Reply:
    key = await service.revoke_key(request.params["key_id"])
    return json_reply(key.to_dict())


async def get_audit(service: Caller, request: Request) -> Reply:
    limit = request.query.get("limit", "1000")
    if not is_number(limit) or not 1 <= int(limit) <= AUDIT_LIMIT_MAX:
        raise BadRequest(f"limit must be a number from 1 to {AUDIT_LIMIT_MAX}")
    records = await service.audit(tenant=request.query.get("tenant"),
                                  since=request.query.get("since"), limit=int(limit))
    shown = [r.to_dict() for r in records]
    if service.tenant is not None:  # a key's caller: a registration's source is a server path
        shown = [{**r, "detail": None} for r in shown]
    return json_reply({"records": shown})


# -- API description ---------------------------------------------------------------------------

TENANT_SCHEMA = {"type": "string", "pattern": BOT_ID_PATTERN,
                 "description": "a tenant's name (the characters of a bot id)"}
KEY_ID_SCHEMA = {"type": "string", "pattern": "^[0-9a-f]{12}$",
                 "description": "an API key's public id"}
_TIME = {"type": "string", "description": "ISO 8601, UTC"}
_MAYBE_TIME = {"type": "string", "nullable": True, "description": "ISO 8601, UTC"}


def _limit_schema(name: str) -> dict:
    """One limit as the API describes it: its range (what `validate_limit` accepts), or null
    (the serve default)."""
    limit = LIMITS[name]
    unit = f" ({limit.unit})" if limit.unit else ""
    if limit.integer:
        bounds = {"type": "integer", "minimum": 1, "maximum": int(limit.maximum)}
    else:
        bounds = {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                  "maximum": limit.maximum}
    return {**bounds, "nullable": True,
            "description": f"{limit.meaning}{unit}; null: the serve default"}


LIMIT_PROPERTIES = {name: _limit_schema(name) for name in LIMIT_NAMES}
TENANT_LIMITS_SCHEMA = {
    "title": "TenantLimits", "type": "object", "additionalProperties": False,
    "required": list(LIMIT_NAMES), "properties": LIMIT_PROPERTIES,
    "description": "the tenant's limits (sharing the trunk, what it stores); null: the serve "
                   "default"}
TENANT_INFO_SCHEMA = {
    "title": "TenantInfo", "type": "object", "additionalProperties": False,
    "required": ["name", "created", "bots", "limits"],
    "properties": {"name": {"type": "string"},
                   "created": {**_MAYBE_TIME, "description": "when it was added (ISO 8601, "
                               "UTC; null for `default`, which always exists)"},
                   "bots": {"type": "integer", "minimum": 0,
                            "description": "how many bots it owns"},
                   "limits": TENANT_LIMITS_SCHEMA}}
NEW_TENANT_BODY = Body(
    content={"application/json": {
        "type": "object", "additionalProperties": False, "properties": LIMIT_PROPERTIES}},
    description="the new tenant's limits, if any (a limit left out or null: the serve "
                "default)", required=False)
LIMITS_CHANGE_BODY = Body(
    content={"application/json": {
        "type": "object", "additionalProperties": False, "minProperties": 1,
        "properties": LIMIT_PROPERTIES}},
    description="the limits to change: each field given sets its limit (null: back to the "
                "serve default); the others keep their values")
KEY_INFO_SCHEMA = {
    "title": "ApiKeyInfo", "type": "object", "additionalProperties": False,
    "required": ["id", "prefix", "tenant", "scope", "created", "last_used", "revoked"],
    "properties": {
        "id": {"type": "string"}, "tenant": {"type": "string"},
        "prefix": {"type": "string", "description": "how the key's token starts"},
        "scope": {"type": "string", "enum": list(SCOPES)}, "created": _TIME,
        "last_used": {**_MAYBE_TIME, "description": "last accepted call (ISO 8601, UTC; "
                                                    "recorded every few seconds)"},
        "revoked": {**_MAYBE_TIME, "description": "when it was revoked (ISO 8601, UTC)"}}}
NEW_KEY_SCHEMA = {
    "title": "NewApiKey", "type": "object", "additionalProperties": False,
    "required": [*KEY_INFO_SCHEMA["required"], "token"],
    "properties": {**KEY_INFO_SCHEMA["properties"],
                   "token": {"type": "string", "description": "the secret: send it as "
                             "`Authorization: Bearer <token>`. Shown this once only"}}}
AUDIT_RECORD_SCHEMA = {
    "title": "AuditRecord", "type": "object", "additionalProperties": False,
    "required": ["id", "at", "actor", "action", "tenant", "bot_id", "version", "digest",
                 "detail"],
    "properties": {
        "id": {"type": "integer"}, "at": _TIME,
        "actor": {"type": "string", "description": "operator, or key:<id>"},
        "action": {"type": "string"},
        "tenant": {"type": "string", "nullable": True},
        "bot_id": {"type": "string", "nullable": True},
        "version": {"type": "integer", "nullable": True},
        "digest": {"type": "string", "nullable": True,
                   "description": "sha256 of the head made active"},
        "detail": {"type": "string", "nullable": True,
                   "description": "the operator's: a registration's source (null for a key)"}}}
NEW_KEY_BODY = Body(
    content={"application/json": {
        "type": "object", "additionalProperties": False, "required": ["tenant"],
        "properties": {"tenant": TENANT_SCHEMA,
                       "scope": {"type": "string", "enum": list(SCOPES),
                                 "default": "infer"}}}},
    description="the tenant the key belongs to and what it may do")

ENDPOINTS = [
    Endpoint("GET", "/tenants", "list_tenants", list_tenants, access=OPERATOR,
             summary="every tenant, with its bot count and limits", tag="tenants",
             answers={200: json_answer("the tenants, by name", {
                 "type": "object", "additionalProperties": False, "required": ["tenants"],
                 "properties": {"tenants": {"type": "array", "items": TENANT_INFO_SCHEMA}}})}),
    Endpoint("PUT", "/tenants/{tenant}", "put_tenant", put_tenant, access=OPERATOR,
             summary="add a tenant (with its limits, if a body gives them)", tag="tenants",
             path_params={"tenant": TENANT_SCHEMA}, body=NEW_TENANT_BODY,
             answers={201: json_answer("the tenant was added", TENANT_INFO_SCHEMA)},
             errors=(400, 409, 415)),
    Endpoint("PATCH", "/tenants/{tenant}", "patch_tenant", patch_tenant, access=OPERATOR,
             summary="change a tenant's limits (`default` too; null: back to the serve default)",
             tag="tenants", path_params={"tenant": TENANT_SCHEMA}, body=LIMITS_CHANGE_BODY,
             description="Every server process on the store reads the new limits within a "
                         "second.",
             answers={200: json_answer("the tenant's limits now", {
                 "type": "object", "additionalProperties": False,
                 "required": ["name", "limits"],
                 "properties": {"name": {"type": "string"}, "limits": TENANT_LIMITS_SCHEMA}})},
             errors=(400, 404, 415)),
    Endpoint("DELETE", "/tenants/{tenant}", "delete_tenant", delete_tenant, access=OPERATOR,
             summary="remove a tenant (?force=true: with its bots and keys)", tag="tenants",
             path_params={"tenant": TENANT_SCHEMA},
             params=(Param("force", "query", {"type": "boolean"},
                           "also remove its bots and revoke its keys"),),
             answers={200: json_answer("the tenant is gone", {
                 "type": "object", "additionalProperties": False,
                 "required": ["tenant", "removed"],
                 "properties": {"tenant": {"type": "string"},
                                "removed": {"type": "boolean"}}})},
             errors=(400, 404, 409)),
    Endpoint("GET", "/keys", "list_keys", list_keys, access=OPERATOR,
             summary="API keys (never their secrets)", tag="tenants",
             params=(Param("tenant", "query", TENANT_SCHEMA, "only this tenant's"),),
             answers={200: json_answer("the keys", {
                 "type": "object", "additionalProperties": False, "required": ["keys"],
                 "properties": {"keys": {"type": "array", "items": KEY_INFO_SCHEMA}}})},
             errors=(400,)),
    Endpoint("POST", "/keys", "post_key", post_key, access=OPERATOR,
             summary="make an API key for a tenant: its secret is in this answer only",
             tag="tenants", body=NEW_KEY_BODY,
             answers={201: json_answer("the new key and its secret", NEW_KEY_SCHEMA)},
             errors=(400, 404, 415)),
    Endpoint("DELETE", "/keys/{key_id}", "delete_key", delete_key, access=OPERATOR,
             summary="revoke an API key (every process refuses it within a second)",
             tag="tenants", path_params={"key_id": KEY_ID_SCHEMA},
             answers={200: json_answer("the revoked key", KEY_INFO_SCHEMA)},
             errors=(400, 404)),
    Endpoint("GET", "/audit", "get_audit", get_audit, access=MANAGE,
             summary="the audit log: every change of bots, tenants and keys, oldest first",
             tag="tenants",
             description="The operator sees every tenant's records; a manage key its own "
                         "tenant's only (`tenant` naming another: 403); an infer or metrics "
                         "key: 403.",
             params=(Param("tenant", "query", TENANT_SCHEMA, "only this tenant's"),
                     Param("since", "query", {"type": "string"},
                           "only records at or after this ISO 8601 time"),
                     Param("limit", "query",
                           {"type": "integer", "minimum": 1, "maximum": AUDIT_LIMIT_MAX},
                           "at most this many records (default 1000)")),
             answers={200: json_answer("the records", {
                 "type": "object", "additionalProperties": False, "required": ["records"],
                 "properties": {"records": {"type": "array",
                                            "items": AUDIT_RECORD_SCHEMA}}})},
             errors=(400,)),
]
