"""OpenTelemetry tracing, end to end: a real server on loopback (the session's real trunk behind
a gate that is open unless a test holds it, a real store, HTTP, WebSocket and gRPC listeners)
tracing into the SDK's in-memory exporter, one server for the module.

What is checked: the span tree of one request (request -> admission, decode, queue_wait, heads,
and the trunk_batch span linked to it), a batch linked to every request it served, the W3C
`traceparent` of an HTTP header and of gRPC metadata becoming the request span's parent, the
namespaced attributes (tenant, bot, version, batch size); and, with OpenTelemetry's own
variables only, a `multihead serve` process exporting its spans over OTLP/HTTP to a receiver
the test runs. Tracing off: a server serves with every OpenTelemetry module unimportable, so
none is used and no span can be made.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import signal
import subprocess
import sys

import aiohttp
import grpc
import numpy as np
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from PIL import Image
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench.pgserver import free_port
from service.core import tracing
from service.core.errors import ServiceError
from service.transports.grpc.server import GrpcServer
from service.transports.http.app import LISTENERS, SERVICE, create_app
from tests.backbone.helpers import encode
from tests.support.fakes import GatedTrunk
from tests.support.polling import serve_ready, until
from tests.support.servers import ThreadedServer, make_settings, open_bots_store

pytestmark = pytest.mark.timeout(180)

BOT = "charlie"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def png(seed: int) -> bytes:
    """A distinct small PNG per seed (no feature-cache hit between seeds)."""
    rng = np.random.default_rng(seed)
    return encode(Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)))


@pytest.fixture(scope="module")
def traced(tmp_path_factory, trunk):
    """The module's server, tracing into an in-memory exporter (spans exported as they end)."""
    tmp = tmp_path_factory.mktemp("tracing")
    store = open_bots_store(tmp / "store")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gated = GatedTrunk(trunk, open=True)
    app = create_app(make_settings(tmp, grpc_port=0), trunk=gated, store=store,
                     listeners=[GrpcServer], tracer_provider=provider)
    server = ThreadedServer(app)
    server.exporter, server.gated, server.app = exporter, gated, app
    server.grpc = app[LISTENERS][0]
    yield server
    server.close()
    store.close()
    provider.shutdown()


@pytest.fixture
def spans(traced):
    """The spans the server ends during the test (the exporter emptied before it)."""
    traced.exporter.clear()
    return traced.exporter.get_finished_spans


def hex_trace(span) -> str:
    return f"{span.context.trace_id:032x}"


def children(all_spans, parent) -> dict[str, object]:
    """The spans whose parent is `parent`, by name (one each)."""
    found = {}
    for s in all_spans:
        if s.parent is not None and s.parent.span_id == parent.context.span_id:
            assert s.name not in found, f"two {s.name} spans under {parent.name}"
            found[s.name] = s
    return found


def one(all_spans, name: str, **attributes):
    matching = [s for s in all_spans if s.name == name
                and all(s.attributes.get(k) == v for k, v in attributes.items())]
    assert len(matching) == 1, (name, attributes, [(s.name, dict(s.attributes))
                                                   for s in all_spans])
    return matching[0]


def linked_from(batch, request_span) -> bool:
    return any(link.context.span_id == request_span.context.span_id
               and link.context.trace_id == request_span.context.trace_id
               for link in batch.links)


async def test_one_request_is_a_tree_and_its_batch_links_to_it(traced, spans):
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{traced.url}/classify/{BOT}", data=png(1),
                                headers={"Content-Type": "image/png",
                                         "traceparent": TRACEPARENT,
                                         "X-Request-Id": "req-1"}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-Request-Id"] == "req-1"
    await until(lambda: any(s.kind == SpanKind.SERVER for s in spans()))
    finished = spans()
    request = one(finished, "POST /classify/{bot_id}")
    assert request.kind == SpanKind.SERVER
    # The client's traceparent is the parent: same trace, its span id.
    assert hex_trace(request) == TRACE_ID and f"{request.parent.span_id:016x}" == PARENT_ID
    assert request.parent.is_remote
    attrs = request.attributes
    assert (attrs["http.request.method"], attrs["http.route"],
            attrs["http.response.status_code"]) == ("POST", "/classify/{bot_id}", 200)
    assert (attrs[tracing.TENANT], attrs[tracing.BOT], attrs[tracing.VERSION],
            attrs[tracing.REQUEST_ID]) == ("default", BOT, "1", "req-1")

    under = children(finished, request)
    assert set(under) == {"admission", "decode", "queue_wait", "heads"}, set(under)
    for child in under.values():
        assert hex_trace(child) == TRACE_ID
        assert request.start_time <= child.start_time <= child.end_time <= request.end_time
    assert under["admission"].end_time <= under["decode"].start_time
    assert under["decode"].end_time <= under["queue_wait"].end_time <= under["heads"].start_time
    assert under["heads"].attributes[tracing.BOT] == BOT
    assert under["queue_wait"].attributes[tracing.TENANT] == "default"

    # The trunk batch: a trace of its own, linked to the request, covering queue_wait's end.
    batch = one(finished, "trunk_batch")
    assert batch.parent is None and hex_trace(batch) != TRACE_ID
    assert linked_from(batch, request)
    assert batch.attributes[tracing.BATCH_SIZE] == 1
    assert batch.attributes[tracing.BATCH_TRUNK_IMAGES] == 1
    assert under["queue_wait"].end_time == batch.start_time
    assert [link.context.span_id for link in under["queue_wait"].links] == [
        batch.context.span_id]

    # The same image again: a feature-cache hit, scored without the trunk, so no batch.
    spans_before = len(spans())
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{traced.url}/classify/{BOT}", data=png(1),
                                headers={"Content-Type": "image/png"}) as resp:
            assert resp.status == 200
            assert len(resp.headers["X-Request-Id"]) == 32  # none sent: a new one
    await until(lambda: len(spans()) >= spans_before + 2)
    again = [s for s in spans()[spans_before:]]
    request2 = one(again, "POST /classify/{bot_id}")
    assert request2.parent is None and hex_trace(request2) != TRACE_ID
    assert set(children(again, request2)) == {"heads"}
    assert not [s for s in again if s.name == "trunk_batch"]


async def test_a_batch_is_linked_to_every_request_in_it(traced, spans):
    gated = traced.gated
    service = traced.app[SERVICE]
    gated.gate.clear()
    gated.entered.clear()
    try:
        async with aiohttp.ClientSession() as session:
            async def post(seed: int) -> int:
                async with session.post(f"{traced.url}/classify/{BOT}", data=png(seed),
                                        headers={"Content-Type": "image/png"}) as resp:
                    return resp.status

            blocker = asyncio.create_task(post(10))
            await until(gated.entered.is_set, what="the blocker's row in the trunk")
            waiting = [asyncio.create_task(post(seed)) for seed in (11, 12, 13)]
            await until(lambda: service.engine.batcher.queue_depth == 3,
                        what="three rows queued behind the blocker")
            gated.gate.set()
            assert await asyncio.gather(blocker, *waiting) == [200] * 4
    finally:
        gated.gate.set()
    await until(lambda: sum(s.kind == SpanKind.SERVER for s in spans()) == 4)
    finished = spans()
    requests = [s for s in finished if s.kind == SpanKind.SERVER]
    batches = sorted((s for s in finished if s.name == "trunk_batch"),
                     key=lambda s: s.start_time)
    assert [b.attributes[tracing.BATCH_SIZE] for b in batches] == [1, 3]
    shared = batches[1]
    linked = [r for r in requests if linked_from(shared, r)]
    assert len(linked) == 3 and len({hex_trace(r) for r in linked}) == 3
    assert shared.attributes[tracing.BATCH_REQUESTS] == 3
    assert list(shared.attributes[tracing.BATCH_TENANTS]) == ["default"]
    # Each of the three waited in the queue until exactly that batch took it.
    for r in linked:
        wait = children(finished, r)["queue_wait"]
        assert wait.end_time == shared.start_time
        assert wait.links[0].context.span_id == shared.context.span_id
    blocker_request = next(r for r in requests if r not in linked)
    assert linked_from(batches[0], blocker_request)


async def test_grpc_metadata_traceparent_is_the_parent(traced, spans):
    await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        traced.grpc.wait_started(), traced._loop)), 60)
    image = png(20)
    request = service_pb2.ModelInferRequest(model_name=BOT)
    request.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(len(image).to_bytes(4, "little") + image)

    def call():
        with grpc.insecure_channel(f"127.0.0.1:{traced.grpc.port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            return stub.ModelInfer.with_call(request, metadata=(
                ("traceparent", TRACEPARENT), ("x-request-id", "grpc-7")), timeout=60)

    _, rpc = await asyncio.get_running_loop().run_in_executor(None, call)
    assert ("x-request-id", "grpc-7") in tuple(rpc.trailing_metadata())
    await until(lambda: any(s.kind == SpanKind.SERVER for s in spans()))
    finished = spans()
    server = one(finished, "inference.GRPCInferenceService/ModelInfer")
    assert server.kind == SpanKind.SERVER
    assert hex_trace(server) == TRACE_ID and f"{server.parent.span_id:016x}" == PARENT_ID
    assert (server.attributes["rpc.system"], server.attributes["rpc.service"],
            server.attributes["rpc.method"], server.attributes["rpc.grpc.status_code"]) == (
        "grpc", "inference.GRPCInferenceService", "ModelInfer", 0)
    assert (server.attributes[tracing.BOT], server.attributes[tracing.TENANT],
            server.attributes[tracing.REQUEST_ID]) == (BOT, "default", "grpc-7")
    assert set(children(finished, server)) == {"admission", "decode", "queue_wait", "heads"}
    assert linked_from(one(finished, "trunk_batch"), server)


async def test_websocket_messages_are_spans_under_their_socket(traced, spans):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{traced.url}/ws/classify/{BOT}",
                                      headers={"traceparent": TRACEPARENT}) as ws:
            for seed in (30, 31):
                await ws.send_bytes(png(seed))
                assert "results" in await ws.receive_json(timeout=60)
    await until(lambda: any(s.name == "GET /ws/classify/{bot_id}" for s in spans()))
    finished = spans()
    socket = one(finished, "GET /ws/classify/{bot_id}")
    assert hex_trace(socket) == TRACE_ID
    messages = [s for s in finished if s.name == "WS /ws/classify/{bot_id}"]
    assert len(messages) == 2
    for message in messages:
        assert message.parent.span_id == socket.context.span_id
        assert message.attributes[tracing.BOT] == BOT
        assert message.attributes[tracing.REQUEST_ID].startswith(
            socket.attributes[tracing.REQUEST_ID] + ".")
        assert {"queue_wait", "heads"} <= set(children(finished, message))


# -- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("setting,environ,expected", [
    (None, {}, ()),
    (None, {"OTEL_TRACES_EXPORTER": "none"}, ()),
    (None, {"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
    (None, {"OTEL_TRACES_EXPORTER": " otlp, console "}, ("otlp", "console")),
    (None, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, ()),
    ("console", {"OTEL_TRACES_EXPORTER": "none"}, ("console",)),
    ("none", {"OTEL_TRACES_EXPORTER": "otlp"}, ()),
    ("otlp", {"OTEL_SDK_DISABLED": "TRUE"}, ()),
])
def test_which_exporters_the_flag_and_otel_variables_ask_for(setting, environ, expected):
    assert tracing.exporters(setting, environ) == expected


@pytest.mark.parametrize("environ,message", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "'zipkin' is not served"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTLP protocol 'grpc'"),
])
def test_an_exporter_or_protocol_not_served_is_refused_in_one_line(environ, message):
    with pytest.raises(ServiceError, match=message):
        tracing.Tracing.configure(None, environ)


async def test_tracing_off_never_imports_opentelemetry_while_serving(make_client, monkeypatch):
    """With tracing off (the default: no --tracing, no OTEL_TRACES_EXPORTER), every
    OpenTelemetry module is made unimportable: the server still starts and serves the trunk
    path, a feature-cache hit, an error and a WebSocket message, so nothing of OpenTelemetry
    ran (an import would raise, and the request answer 500), and no span can have been made."""
    for name in [m for m in sys.modules if m == "opentelemetry" or
                 m.startswith("opentelemetry.")] + ["opentelemetry"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import` of it raises ImportError
    with pytest.raises(ImportError):
        from opentelemetry import trace  # noqa: F401 - the block works
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    client = await make_client()
    assert client.app[SERVICE].tracing is None
    for _ in range(2):  # the trunk, then the feature cache
        resp = await client.post(f"/classify/{BOT}", data=png(50),
                                 headers={"Content-Type": "image/png",
                                          "traceparent": TRACEPARENT})
        assert resp.status == 200, await resp.text()
    assert (await client.post("/classify/nobody", data=png(50))).status == 404
    async with client.ws_connect(f"/ws/classify/{BOT}") as ws:
        await ws.send_bytes(png(51))
        assert "results" in await ws.receive_json(timeout=60)


# -- OTLP over HTTP, configured by OTEL_* only, from a `multihead serve` process ----------------

class Receiver:
    """An OTLP/HTTP trace receiver on loopback: POST /v1/traces, protobuf bodies."""

    def __init__(self) -> None:
        self.spans: list = []  # (resource attributes, span)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def receive(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans += [(resource, s) for s in scope_spans.spans]
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def __aenter__(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/v1/traces", self.receive)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


@pytest.mark.timeout(600)  # a server process: TensorFlow's import, the trunk's restore
async def test_a_serve_process_exports_its_spans_over_otlp_http_from_otel_variables_alone(
        trunk_checkpoint, serving_graph_cache, tmp_path):
    store = open_bots_store(tmp_path / "store")
    store.close()
    port = free_port()
    async with Receiver() as receiver:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OTEL_", "MULTIHEAD_TRACING"))}
        env.update(TF_CPP_MIN_LOG_LEVEL="3", OTEL_TRACES_EXPORTER="otlp",
                   OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.port}",
                   OTEL_SERVICE_NAME="multihead-under-test", OTEL_BSP_SCHEDULE_DELAY="50",
                   MULTIHEAD_LOG_FORMAT="json")
        server = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--store", str(tmp_path / "store"),
             "--trunk-checkpoint", trunk_checkpoint, "--port", str(port), "--no-warmup",
             "--runtime", "tf"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as http:
                await serve_ready(http, base, server, lambda: server.stderr.read())
                async with http.post(f"{base}/classify/alpha", data=png(40),
                                     headers={"Content-Type": "image/png",
                                              "traceparent": TRACEPARENT}) as r:
                    assert r.status == 200, await r.text()
                    request_id = r.headers["X-Request-Id"]
            wanted = {"POST /classify/{bot_id}", "admission", "decode", "queue_wait", "heads",
                      "trunk_batch"}
            await until(lambda: wanted <= {s.name for _, s in receiver.spans}, 60,
                        what=lambda: f"spans {sorted({s.name for _, s in receiver.spans})}")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                _, stderr = server.communicate(timeout=60)
            finally:
                if server.poll() is None:
                    server.kill()
    assert server.returncode == 0, stderr
    resource, request = next((r, s) for r, s in receiver.spans
                             if s.name == "POST /classify/{bot_id}")
    assert resource["service.name"] == "multihead-under-test"
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    # Every line Python logged is one JSON object (TensorFlow's C++ runtime writes a line or
    # two of its own to fd 2 at start-up, which no Python formatter sees).
    logged = [line for line in stderr.splitlines() if line.startswith("{")]
    assert not [line for line in stderr.splitlines()
                if re.match(r"\d{4}-\d\d-\d\d[ T]\S+ (DEBUG|INFO|WARNING|ERROR) ", line)]
    lines = [json.loads(line) for line in logged]
    loggers = {x["logger"] for x in lines}
    assert {"multihead.access", "service.core.lifecycle"} <= loggers
    assert "aiohttp.access" not in loggers  # one access line per request: ours
    # The access line of that request names the same trace and span.
    access = [x for x in lines if x["logger"] == "multihead.access"
              and x["request_id"] == request_id]
    assert len(access) == 1, stderr[-3000:]
    assert (access[0]["trace_id"], access[0]["span_id"]) == (TRACE_ID, request.span_id.hex())
    assert access[0]["status"] == 200 and access[0]["bot"] == "alpha"
