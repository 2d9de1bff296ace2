"""The protocol codecs as pure code: no server, no trunk. Transports are tested elsewhere."""
from __future__ import annotations

import dataclasses
import json

import pytest

from service.codecs.base import Endpoint, Reply, Request, dispatch, error_reply
from service.codecs.common import parse_top_k
from service.codecs.native import parse_bot_ids, parse_images, parse_multipart
from service.codecs.routes import ENDPOINTS
from service.core.auth import PUBLIC
from service.core.errors import BadRequest, PayloadTooLarge
from service.core.settings import Settings
from tests.support.fakes import FakeService

BOUNDARY = "XyZ"
CTYPE = f"multipart/form-data; boundary={BOUNDARY}"


def part(name: str, data: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return (f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n").encode() + data + \
        b"\r\n"


GOOD = part("image", b"\xff\xd8jpeg", "a.jpg") + part("note", b"hi") + \
    part("image", b"\x89PNG") + f"--{BOUNDARY}--\r\n".encode()


def test_multipart_parts_in_order_with_names_and_files():
    parts = parse_multipart(CTYPE, GOOD)
    assert [(p.name, p.filename, p.data) for p in parts] == [
        ("image", "a.jpg", b"\xff\xd8jpeg"), ("note", None, b"hi"), ("image", None, b"\x89PNG")]


@pytest.mark.parametrize("body", [
    GOOD[:-9],                                  # no final boundary
    GOOD[:40],                                  # cut inside the first part's headers
    GOOD.replace(b"--XyZ--", b"--XyQ--"),       # wrong final boundary
    GOOD.replace(b"--XyZ", b"--Other"),         # wrong boundary everywhere
    b"",                                        # empty
    b"not multipart at all",
], ids=["no-final", "truncated", "wrong-final", "wrong-boundary", "empty", "garbage"])
def test_malformed_multipart_is_a_bad_request(body):
    with pytest.raises(BadRequest, match="multipart"):
        parse_multipart(CTYPE, body)


def test_multipart_without_boundary_is_a_bad_request():
    with pytest.raises(BadRequest, match="boundary"):
        parse_multipart("multipart/form-data", GOOD)


def test_too_many_parts_are_refused_unparsed():
    body = b"".join(part("x", b"1") for _ in range(5)) + f"--{BOUNDARY}--\r\n".encode()
    assert len(parse_multipart(CTYPE, body, max_parts=5)) == 5
    with pytest.raises(PayloadTooLarge):
        parse_multipart(CTYPE, body, max_parts=4)


def request(headers=None, **kwargs) -> Request:
    return Request("POST", "/x", headers={k.lower(): v for k, v in (headers or {}).items()},
                   **kwargs)


def test_images_of_a_raw_body_and_of_a_multipart_body():
    assert parse_images(request({"Content-Type": "image/png"}), b"png!") == [b"png!"]
    multi = request({"Content-Type": CTYPE})
    assert parse_images(multi, GOOD) == [b"\xff\xd8jpeg", b"\x89PNG"]
    no_image = part("note", b"hi") + f"--{BOUNDARY}--\r\n".encode()
    with pytest.raises(BadRequest, match="no part named 'image'"):
        parse_images(multi, no_image)


def test_content_type_ignores_parameters_and_case():
    assert request({"Content-Type": "Image/JPEG; q=1"}).content_type == "image/jpeg"
    assert request().content_type == ""


@pytest.mark.parametrize("query,want", [({}, 5), ({"top_k": "3"}, 3), ({"top_k": "0"}, None),
                                        ({"top_k": "-1"}, None), ({"top_k": "two"}, None),
                                        ({"top_k": ""}, None)])
def test_top_k(query, want):
    if want is None:
        with pytest.raises(BadRequest, match="top_k"):
            parse_top_k(query, 5)
    else:
        assert parse_top_k(query, 5) == want


def test_bot_ids_are_deduplicated_in_order_and_bounded():
    assert parse_bot_ids(" b, a,b,,c ") == ["b", "a", "c"]
    with pytest.raises(BadRequest):
        parse_bot_ids(" , ")
    with pytest.raises(BadRequest, match="limit"):
        parse_bot_ids(",".join(f"b{i}" for i in range(65)))


def test_routes_are_unique_and_every_admin_route_is_a_write_on_bots_tenants_or_keys():
    assert len({e.name for e in ENDPOINTS}) == len(ENDPOINTS)
    assert len({(e.method, e.path) for e in ENDPOINTS}) == len(ENDPOINTS)
    assert sorted((e.method, e.path) for e in ENDPOINTS if e.admin) == [
        ("DELETE", "/bots/{bot_id}"), ("DELETE", "/bots/{bot_id}/candidate"),
        ("DELETE", "/keys/{key_id}"), ("DELETE", "/tenants/{tenant}"),
        ("PATCH", "/tenants/{tenant}"), ("POST", "/bots/{bot_id}/candidate/promote"),
        ("POST", "/bots/{bot_id}/rollback"), ("POST", "/keys"), ("PUT", "/bots/{bot_id}"),
        ("PUT", "/tenants/{tenant}")]


def test_an_endpoint_without_an_access_rule_is_refused():
    async def handle(service, req):
        return Reply(204)

    with pytest.raises(ValueError, match="access must be one of"):
        Endpoint("GET", "/x", "x", handle)


ADMIN = [e for e in ENDPOINTS if e.admin]


@pytest.mark.parametrize("endpoint", ADMIN, ids=[e.name for e in ADMIN])
@pytest.mark.parametrize("token,header,status", [
    (None, "Bearer s3cret", 403),           # admin disabled
    ("s3cret", None, 401),                  # no credentials
    ("s3cret", "Basic s3cret", 401),        # not a bearer token
    ("s3cret", "Bearer wrong", 403),        # wrong token
    ("s3cret", "Bearer s3cret", 200),       # the handler runs
])
async def test_admin_auth_is_applied_by_dispatch_to_every_admin_route(endpoint, token,
                                                                       header, status):
    called = []

    async def handle(service, req):
        called.append(req)
        return Reply(200, b"{}")

    service = FakeService(Settings(admin_token=token, auth="none"))
    headers = {"authorization": header} if header else {}
    reply = await dispatch(service, dataclasses.replace(endpoint, handle=handle),
                           Request(endpoint.method, "/bots/x", {"bot_id": "x"}, {}, headers))
    assert reply.status == status
    assert bool(called) == (status == 200)
    if status == 401:
        assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    if status != 200:
        assert json.loads(reply.body)["code"] in ("unauthorized", "forbidden")


async def test_dispatch_turns_any_error_into_a_json_reply_without_internals():
    async def broken(service, req):
        raise RuntimeError("/secret/path/model.ckpt exploded")

    reply = await dispatch(FakeService(Settings(auth="none")), Endpoint("GET", "/x", "x", broken, access=PUBLIC),
                           Request("GET", "/x"))
    assert reply.status == 500
    assert json.loads(reply.body) == {"error": "internal server error", "code": "internal"}


def test_error_reply_keeps_status_headers_and_message_of_domain_errors():
    from service.core.errors import Overloaded

    reply = error_reply(Overloaded(retry_after_s=2.2))
    assert (reply.status, reply.headers["Retry-After"]) == (503, "3")
    assert json.loads(reply.body)["code"] == "overloaded"
