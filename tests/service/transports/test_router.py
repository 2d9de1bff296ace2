"""`service.transports.common.router`: the Ray transport routes every request as aiohttp does."""
from __future__ import annotations

import re

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from service.codecs.base import Endpoint, Reply
from service.codecs.openapi import openapi_path
from service.codecs.routes import ENDPOINTS
from service.core.auth import PUBLIC
from service.transports.common.router import Router, template_regex


async def _noop(service, request) -> Reply:
    return Reply()


def test_a_parameter_regex_with_braces_inside_nests():
    regex = template_regex("/v2/models/{bot_id:[^{}/:]+}/ready")
    assert regex.fullmatch("/v2/models/acme/ready").group("bot_id") == "acme"
    assert regex.fullmatch("/v2/models/a:b/ready") is None
    assert regex.fullmatch("/v2/models/a/b/ready") is None


def test_a_plain_parameter_is_one_segment_and_literals_are_escaped():
    regex = template_regex("/v1/models/{name}:predict")
    assert regex.fullmatch("/v1/models/x:predict").group("name") == "x"
    assert regex.fullmatch("/v1/models/x/y:predict") is None
    assert template_regex("/a.b").fullmatch("/aXb") is None


def test_an_unbalanced_template_is_refused():
    with pytest.raises(ValueError, match="unbalanced"):
        template_regex("/bots/{bot_id")


def test_method_mismatch_lists_the_allowed_methods_and_unknown_paths_none():
    router = Router([Endpoint("POST", "/x/{id}", "post_x", _noop, access=PUBLIC),
                     Endpoint("DELETE", "/x/{id}", "delete_x", _noop, access=PUBLIC),
                     Endpoint("GET", "/y", "get_y", _noop, access=PUBLIC)])
    assert router.match("POST", "/x/1").endpoint.name == "post_x"
    assert router.match("POST", "/x/1").params == {"id": "1"}
    miss = router.match("GET", "/x/1")
    assert miss.endpoint is None and miss.allowed == ("POST", "DELETE")
    assert router.match("GET", "/nowhere").allowed == ()
    assert router.match("HEAD", "/y").allowed == ("GET",)


# The table of requests, generated from the route table: each endpoint's template filled with a
# value of every kind its parameters may or may not take (a plain id, one with ':', one with
# '/', digits), the same path with a trailing '/' and one segment more, and paths of no route.
PARAMETER_VALUES = ("acme", "a:b", "a/b", "3")
NO_ROUTE = ("/", "/nope", "/v2/", "/v1/models", "/bots/acme/x")


def paths_of(endpoint: Endpoint) -> list[str]:
    template = openapi_path(endpoint.path)
    filled = {re.sub(r"\{\w+\}", value, template) for value in PARAMETER_VALUES}
    return sorted({variant for path in filled for variant in (path, path + "/", path + "/x")})


PATHS = sorted({path for endpoint in ENDPOINTS for path in paths_of(endpoint)} | set(NO_ROUTE))
# Every method of the table (PATCH included), and HEAD, which no endpoint serves (a GET route
# answers it 405, as aiohttp's `add_route("GET", ...)` does).
METHODS = sorted({endpoint.method for endpoint in ENDPOINTS} | {"HEAD"})


def test_the_table_reaches_every_route_with_its_method():
    ours = Router(ENDPOINTS)
    for endpoint in ENDPOINTS:
        path = re.sub(r"\{\w+\}", PARAMETER_VALUES[0], openapi_path(endpoint.path))
        assert ours.match(endpoint.method, path).endpoint == endpoint, endpoint.name
    assert {"PATCH", "PUT", "DELETE", "HEAD"} <= set(METHODS)


@pytest.mark.parametrize("method", METHODS)
async def test_the_router_agrees_with_aiohttps_on_every_route(method):
    app = web.Application()
    for endpoint in ENDPOINTS:
        app.router.add_route(endpoint.method, endpoint.path, _noop, name=endpoint.name)
    ours = Router(ENDPOINTS)
    for path in PATHS:
        info = await app.router.resolve(make_mocked_request(method, path, app=app))
        mine = ours.match(method, path)
        if info.http_exception is not None:
            assert mine.endpoint is None, (method, path)
            expected = info.http_exception.status
            assert (405 if mine.allowed else 404) == expected, (method, path)
            if expected == 405:
                assert set(mine.allowed) == set(info.http_exception.allowed_methods)
        else:
            assert mine.endpoint is not None and mine.endpoint.name == info.route.name, \
                (method, path)
            assert mine.params == dict(info), (method, path)
