"""Logs: the access line of every protocol (HTTP, WebSocket message, gRPC call) on a real server
on loopback (the session's trunk, a real store; one server for the module), request ids taken
or made and echoed, the JSON and text formats, `--no-access-log`, and the scrubbing of
credentials and content bytes. (The JSON lines under hostile input, and that they hold none of
the secrets sent: tests/fuzz/test_fuzz_http.py.)"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from datetime import datetime

import aiohttp
import grpc
import numpy as np
import pytest
from PIL import Image
from tritonclient.grpc import service_pb2, service_pb2_grpc

from service.core import logs
from service.core.settings import Settings
from service.transports.grpc.server import GrpcServer
from service.transports.http.app import LISTENERS, create_app
from tests.backbone.helpers import encode
from tests.support.logcapture import Captured
from tests.support.polling import until
from tests.support.servers import ThreadedServer, make_settings, open_bots_store

pytestmark = pytest.mark.timeout(180)

BOT = "charlie"
TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) (\S+): (.*)")


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return encode(Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)))


@pytest.fixture(scope="module")
def server(tmp_path_factory, trunk):
    tmp = tmp_path_factory.mktemp("logs")
    store = open_bots_store(tmp / "store")
    app = create_app(make_settings(tmp, grpc_port=0), trunk=trunk, store=store,
                     listeners=[GrpcServer])
    served = ThreadedServer(app)
    served.grpc = app[LISTENERS][0]
    yield served
    served.close()
    store.close()


def grpc_infer(port: int, image: bytes, request_id: str) -> tuple:
    request = service_pb2.ModelInferRequest(model_name=BOT)
    request.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(image).to_bytes(4, "little") + image)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        _, call = stub.ModelInfer.with_call(request, metadata=(("x-request-id", request_id),),
                                            timeout=60)
        return tuple(call.trailing_metadata())


async def test_every_protocol_writes_one_json_access_line_per_request(server):
    await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        server.grpc.wait_started(), server._loop)), 60)
    with Captured("json") as captured:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/classify/{BOT}", data=png(1),
                                    headers={"Content-Type": "image/png",
                                             "X-Request-Id": "abc-1"}) as r:
                assert r.status == 200 and r.headers["X-Request-Id"] == "abc-1"
            # Not a sane id (a space, a semicolon): replaced by a fresh one, which is echoed.
            async with session.get(f"{server.url}/bots/nobody",
                                   headers={"X-Request-Id": "a b;c"}) as r:
                assert r.status == 404
                fresh = r.headers["X-Request-Id"]
                assert re.fullmatch(r"[0-9a-f]{32}", fresh)
            async with session.ws_connect(f"{server.url}/ws/classify/{BOT}",
                                          headers={"X-Request-Id": "sock"}) as ws:
                assert ws._response.headers["X-Request-Id"] == "sock"
                await ws.send_bytes(png(2))
                assert "results" in await ws.receive_json(timeout=60)
                await ws.send_str("not an image")
                assert (await ws.receive_json(timeout=60))["status"] == 400
        trailing = await asyncio.get_running_loop().run_in_executor(
            None, grpc_infer, server.grpc.port, png(3), "grpc-9")
        assert ("x-request-id", "grpc-9") in trailing
        await until(lambda: len(captured.access()) >= 6)
    lines = captured.json()
    for line in lines:
        assert list(line)[:len(logs.JSON_KEYS)] == list(logs.JSON_KEYS), line
        assert datetime.fromisoformat(line["time"].replace("Z", "+00:00")).utcoffset() \
            is not None and line["time"].endswith("Z")
    access = {x["request_id"]: x for x in captured.access()}
    assert set(access) == {"abc-1", fresh, "sock", "sock.1", "sock.2", "grpc-9"}, access
    for x in access.values():
        assert set(logs.ACCESS_KEYS) <= set(x) and x["latency_ms"] >= 0
    assert {k: access["abc-1"][k] for k in ("protocol", "method", "route", "path", "status",
                                            "tenant", "bot", "version")} == {
        "protocol": "http", "method": "POST", "route": "classify", "path": f"/classify/{BOT}",
        "status": 200, "tenant": "default", "bot": BOT, "version": "1"}
    assert (access[fresh]["status"], access[fresh]["bot"], access[fresh]["route"]) == (
        404, "nobody", "show_bot")
    assert (access["sock"]["status"], access["sock"]["protocol"]) == (101, "http")
    assert [(access[i]["protocol"], access[i]["method"], access[i]["status"], access[i]["bot"])
            for i in ("sock.1", "sock.2")] == [("ws", "WS", 200, BOT), ("ws", "WS", 400, None)]
    assert {k: access["grpc-9"][k] for k in ("protocol", "method", "path", "route", "status",
                                             "tenant", "bot")} == {
        "protocol": "grpc", "method": "GRPC", "path": "/inference.GRPCInferenceService/ModelInfer",
        "route": "oip_infer", "status": 200, "tenant": "default", "bot": BOT}
    assert "trace_id" not in access["abc-1"]  # tracing is off here


async def test_the_text_format_is_the_default_and_keeps_its_lines(server):
    assert Settings().log_format == "text" and Settings().access_log is True
    with Captured("text") as captured:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/classify/{BOT}", data=png(4),
                                    headers={"Content-Type": "image/png",
                                             "X-Request-Id": "text-1"}) as r:
                assert r.status == 200
        await until(lambda: "text-1" in captured.text())
    (line,) = [line for line in captured.lines() if "text-1" in line]
    level, logger, message = TEXT_LINE.fullmatch(line).groups()
    assert (level, logger) == ("INFO", logs.ACCESS_LOGGER)
    assert re.fullmatch(r'127\.0\.0\.1 "POST /classify/charlie" 200 [\d.]+ms '
                        r'request_id=text-1 tenant=default bot=charlie', message), message


async def test_no_access_log_removes_the_access_lines_only(make_client):
    client = await make_client(access_log=False)
    with Captured("json") as captured:
        for path in ("/healthz", "/bots", "/bots/nobody"):
            assert (await client.get(path)).status in (200, 404)
        logging.getLogger("service.core.lifecycle").info("still logging")
    # (The tests' aiohttp servers keep aiohttp's own access logger; `multihead serve` turns it
    # off: tests/service/core/test_tracing.py's serve process logs none.)
    assert [x["message"] for x in captured.json()
            if x["logger"] != "aiohttp.access"] == ["still logging"]


def test_json_lines_logged_while_serving_a_request_carry_its_id_and_are_scrubbed():
    captured = Captured("json")
    with captured, logs.request_scope(None, False, protocol="http", method="GET", route="r",
                                      path="/p", headers={"x-request-id": "r-1"},
                                      span_name="GET") as req:
        logs.note(tenant="acme", bots=["b1"])
        try:
            raise ValueError("Authorization: Bearer s3cr3t-value " + repr(b"\x89PNG" * 40))
        except ValueError:
            logging.getLogger("x").exception("failed with token=abc123 and mhk_0a1b_SeCrEt-x")
        req.status = 500
    (line,) = captured.json()
    assert (line["request_id"], line["tenant"], line["bot"], line["level"]) == (
        "r-1", "acme", "b1", "ERROR")
    assert line["message"] == "failed with token=*** and mhk_0a1b_***"
    assert "s3cr3t-value" not in line["exception"]
    assert "PNG\\x89PNG" not in line["exception"]  # the bytes (the source line shows "PNG")
    assert "ValueError: Authorization: ***" in line["exception"]
    assert "b'<bytes elided>'" in line["exception"]


@pytest.mark.parametrize("text,scrubbed", [
    ("Authorization: Bearer abc.def", "Authorization: ***"),
    ("{'authorization': 'Basic dXNlcjpwYXNz'}", "{'authorization': '***'}"),
    ("header bearer xyz", "header bearer ***"),
    ("x-api-key=k1&top_k=3", "x-api-key=***&top_k=3"),
    ("password: hunter2", "password: ***"),
    ("key mhk_deadbeef_Abc-_9 revoked", "key mhk_deadbeef_*** revoked"),
    ("short b'\\x89PNG' stays", "short b'\\x89PNG' stays"),
    ("the operator token set", "the operator token set"),
])
def test_scrub_removes_credentials_and_content(text, scrubbed):
    assert logs.scrub(text) == scrubbed


def test_a_registered_secret_is_scrubbed_anywhere():
    logs.register_secret("operator-Secret-42")
    assert logs.scrub("x=operator-Secret-42;") == "x=***;"


@pytest.mark.parametrize("given,kept", [
    ("abc-1", True), ("4bf92f3577b34da6a3ce929d0e0e4736", True), ("a/b:c@d+e=f.g_h", True),
    ("", False), (None, False), ("a b", False), ("x" * 129, False), ("naïve", False),
    ("line\nbreak", False),
])
def test_a_client_request_id_is_kept_only_when_sane(given, kept):
    rid = logs.request_id(given)
    assert (rid == given) is kept
    assert re.fullmatch(r"[A-Za-z0-9._:@+=/-]{1,128}", rid)


def test_configure_gives_the_root_logger_one_handler_in_the_format():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        handler = logs.configure("json", "warning", stream=stream)
        assert root.handlers == [handler] and root.level == logging.WARNING
        logging.getLogger("a.b").warning("hello %s", "there")
        logging.getLogger("a.b").info("dropped")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    (line,) = stream.getvalue().splitlines()
    assert {k: json.loads(line)[k] for k in ("level", "logger", "message")} == {
        "level": "WARNING", "logger": "a.b", "message": "hello there"}
    with pytest.raises(ValueError):
        logs.configure("yaml")
