"""Every transport answers the same request the same way: status, JSON body or error code,
`Allow`, Server-Timing, and the metrics label it is counted under (the endpoint's name;
`unmatched` for 404/405), as far as the transport can carry each of them (`CARRIES`).

ONE table of requests (`CASES`, plain data: add a row for a new route or error) goes through
each transport of the `transports` fixture; each row also says what the answer must be, so two transports
that are wrong alike still fail.

- `aiohttp`: the real app (`create_app`) on a real loopback server, over the session's trunk.
- `ray`: the Ray transport's own code, in-process: a real `Ingress` (routing, body within the
  limits, retries) called with a Starlette request built from the ASGI scope Ray's proxy would
  pass, and a stand-in for the deployment handle that pickles each `Call` and `Reply` (as Ray
  does between processes) and runs the model replica's `answer` on a real `Service` over the
  same trunk and store. Not a Ray cluster: starting one costs 20-40 s and a trunk per replica
  on 2 cores, and what could differ between transports is this glue, not Ray's actor
  plumbing, which tests/scaleout/test_ray.py covers with real replicas.
- `grpc`: a real grpc.aio server on loopback, the gRPC listener of the `aiohttp` column's
  server (one process, one `Service`, as `multihead serve --grpc-port` runs them), called with
  Triton's and TF Serving's generated stubs on a grpc.aio channel. gRPC has no URL routes: the
  row is routed as REST routes it, and an endpoint with an RPC twin becomes that RPC with the
  same model, version and content (`grpc_column`: OIP JSON inputs as typed contents, TF Serving
  `instances` as a DT_STRING tensor, `?top_k=` as `top_k` metadata); rows with no message form
  (unknown paths, 405s, HEAD, the native and admin routes, /metrics, a body that is not JSON)
  have no gRPC column. Its answer: the status is the HTTP status the error table gives the
  domain code of the trailing metadata (`multihead-code`; OK: 200), the labels are the same
  metrics diff on the server's `Service`, and the body is the REST body the response stands
  for (`grpc_column.Rpc.as_rest`: tensors decoded as REST's JSON `data`, an error as its
  message and code), so that `same_body` rows compare their whole content (the ranked outputs,
  the metadata, the error message) with the HTTP columns. The gRPC status code is checked
  against the error table's gRPC column for the row's code. gRPC carries no HTTP headers
  (Server-Timing, `Allow`, content type): those checks skip it, by name (`CARRIES`).
  `test_every_rpc_with_a_rest_twin_has_a_row` keeps every RPC the product maps to an endpoint in
  the table.
"""
from __future__ import annotations

import asyncio
import base64
import json
import pickle
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
import pytest
from PIL import Image
from starlette.requests import Request as HttpRequest

from service.codecs.pipeline import UNMATCHED
from service.core.metrics import Metrics
from service.core.service import Service
from service.transports.grpc import kserve as grpc_kserve
from service.transports.grpc import tfserving as grpc_tfserving
from service.transports.grpc.common import CODE_KEY
from service.transports.http.app import LISTENERS, SERVICE
from service.transports.ray.ingress import Ingress
from service.transports.ray.replica import Call, answer
from tests.backbone.helpers import encode
from tests.docs.reference import error_codes
from tests.service.transports import grpc_column
from tests.support.servers import make_settings

pytestmark = pytest.mark.timeout(300)

TOKEN = "s3cret-token"
MAX_BODY_BYTES = 200_000
SETTINGS = dict(admin_token=TOKEN, max_body_bytes=MAX_BODY_BYTES)

PNG = encode(Image.new("RGB", (64, 64), (200, 30, 60)))
PNG_B64 = base64.b64encode(PNG).decode()


def js(obj) -> bytes:
    return json.dumps(obj).encode()


@dataclass(frozen=True)
class Case:
    """One request and what every transport must answer.

    Attributes:
        name: the row's name (the test id).
        method, target: request line (`target`: path and query).
        body: the request body (None: none, no Content-Length).
        headers: request headers.
        status: the status every transport answers with.
        label: the metrics label the request is counted under.
        code: the JSON error `code` (error answers), or None.
        same_body: the whole JSON body must be equal across transports (False for bodies that
            hold timings: only the status, code and label are compared).
        uncounted_on: transports that answer this request without counting it, and why.
        bare_on: transports that refuse this request themselves, before the service sees it,
            with their own status and no domain code (gRPC: the status code the error table
            gives `code`, e.g. RESOURCE_EXHAUSTED for an oversized message), and why.
    """

    name: str
    method: str
    target: str
    status: int
    label: str
    code: str | None = None
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    same_body: bool = True
    uncounted_on: dict[str, str] = field(default_factory=dict)
    bare_on: dict[str, str] = field(default_factory=dict)


JSON_TYPE = {"Content-Type": "application/json"}
PNG_TYPE = {"Content-Type": "image/png"}
GRPC_REFUSES = ("gRPC refuses a message over max_receive_message_length (`max_body_bytes`) "
                "before any handler runs: nothing counts it, and no trailing metadata is sent")


def oip_infer(*images: bytes, **fields) -> bytes:
    """An OIP v2 JSON inference request: the images as the BYTES input `image_bytes`."""
    return js({**fields, "inputs": [{
        "name": "image_bytes", "datatype": "BYTES", "shape": [len(images)],
        "data": [base64.b64encode(i).decode() for i in images]}]})


CASES = [
    Case("known route", "GET", "/healthz", 200, "healthz"),
    Case("readiness", "GET", "/readyz", 200, "readyz", same_body=False),
    Case("unknown path", "GET", "/nowhere", 404, UNMATCHED, "not_found"),
    Case("unknown path under a prefix", "GET", "/v2/models/a/b/ready", 404, UNMATCHED,
         "not_found"),
    Case("wrong method", "DELETE", "/classify/alpha", 405, UNMATCHED, "method_not_allowed"),
    Case("wrong method, several allowed", "POST", "/bots/alpha", 405, UNMATCHED,
         "method_not_allowed"),
    Case("HEAD of a GET route", "HEAD", "/healthz", 405, UNMATCHED, same_body=False),
    Case("classify", "POST", "/classify/alpha?top_k=1", 200, "classify", body=PNG,
         headers=PNG_TYPE),
    Case("a repeated query parameter", "POST",
         "/classify/bravo?top_k=1&top_k=3", 200, "classify", body=PNG, headers=PNG_TYPE),
    Case("unknown bot", "POST", "/classify/nobody", 404, "classify", "unknown_bot", body=PNG,
         headers=PNG_TYPE),
    Case("malformed body", "POST", "/classify/alpha", 400, "classify", "invalid_image",
         body=b"not an image", headers=PNG_TYPE),
    Case("body over the size limit", "POST", "/classify/alpha", 413, "classify",
         "payload_too_large", body=b"x" * (MAX_BODY_BYTES + 1), headers=PNG_TYPE),
    Case("OIP server live", "GET", "/v2/health/live", 200, "oip_server_live"),
    Case("OIP server ready", "GET", "/v2/health/ready", 200, "oip_server_ready"),
    Case("OIP server metadata", "GET", "/v2", 200, "oip_server_metadata"),
    Case("OIP model ready", "GET", "/v2/models/charlie/ready", 200, "oip_model_ready"),
    Case("OIP model ready, unknown bot", "GET", "/v2/models/nobody/ready", 404,
         "oip_model_ready", "unknown_bot"),
    Case("OIP infer", "POST", "/v2/models/charlie/infer", 200, "oip_infer",
         body=oip_infer(PNG, id="7"), headers=JSON_TYPE),
    Case("OIP infer, classification", "POST", "/v2/models/charlie/versions/1/infer", 200,
         "oip_infer_version", body=oip_infer(PNG, outputs=[
             {"name": "probabilities", "parameters": {"classification": 2}}]),
         headers=JSON_TYPE),
    Case("OIP infer, unknown bot", "POST", "/v2/models/nobody/infer", 404, "oip_infer",
         "unknown_bot", body=oip_infer(PNG), headers=JSON_TYPE),
    Case("OIP infer, not an image", "POST", "/v2/models/charlie/infer", 400, "oip_infer",
         "invalid_image", body=oip_infer(b"not an image"), headers=JSON_TYPE),
    Case("OIP infer, malformed JSON", "POST", "/v2/models/charlie/infer", 400, "oip_infer",
         "bad_request", body=b"{not json", headers=JSON_TYPE),
    Case("OIP infer, body over the size limit", "POST", "/v2/models/charlie/infer", 413,
         "oip_infer", "payload_too_large", body=oip_infer(b"x" * (MAX_BODY_BYTES + 1)),
         headers=JSON_TYPE, uncounted_on={"grpc": GRPC_REFUSES},
         bare_on={"grpc": GRPC_REFUSES}),
    Case("OIP model metadata", "GET", "/v2/models/charlie", 200, "oip_model_metadata"),
    Case("OIP model metadata, another version", "GET", "/v2/models/charlie/versions/2", 404,
         "oip_model_metadata_version", "unknown_version"),
    Case("TF Serving predict", "POST", "/v1/models/delta:predict", 200, "tfs_predict",
         body=js({"instances": [{"b64": PNG_B64}]}), headers=JSON_TYPE),
    Case("TF Serving predict, unknown bot", "POST", "/v1/models/nobody:predict", 404,
         "tfs_predict", "unknown_bot", body=js({"instances": [{"b64": PNG_B64}]}),
         headers=JSON_TYPE),
    Case("TF Serving classify", "POST", "/v1/models/delta:classify", 404, "tfs_predict",
         "not_found", body=js({"examples": [{}]}), headers=JSON_TYPE),
    Case("TF Serving regress, a version", "POST", "/v1/models/delta/versions/1:regress", 404,
         "tfs_predict_version", "not_found", body=js({"examples": [{}]}), headers=JSON_TYPE),
    Case("TF Serving, unknown verb", "POST", "/v1/models/delta:explain", 404, "tfs_predict",
         "not_found", body=js({"instances": [{"b64": PNG_B64}]}), headers=JSON_TYPE),
    Case("TF Serving model status", "GET", "/v1/models/delta", 200, "tfs_status"),
    Case("TF Serving metadata", "GET", "/v1/models/delta/metadata", 200, "tfs_metadata"),
    Case("admin without token", "PUT", "/bots/alpha", 401, "put_bot", body=b"{}",
         headers=JSON_TYPE),
    # The pipeline checks the caller before admission: no credential, whatever the body.
    Case("admin without token, body over the size limit", "PUT", "/bots/alpha", 401,
         "put_bot", "unauthorized", body=b"x" * (MAX_BODY_BYTES + 1), headers=JSON_TYPE),
    Case("admin with a wrong token", "DELETE", "/bots/alpha", 403, "delete_bot",
         headers={"Authorization": "Bearer wrong"}),
    Case("metrics", "GET", "/metrics", 200, "metrics", same_body=False),
]


@dataclass(frozen=True)
class Answer:
    """What a transport answered, and the labels its metrics counted the request under.

    Attributes:
        status: the HTTP status, or the one the same outcome has on HTTP; None for an answer
            with no such status (a gRPC status without a domain code).
        headers: HTTP headers, or gRPC's status (`grpc-status`) and trailing metadata.
        body: the body, or the REST body a gRPC answer stands for.
    """

    status: int | None
    headers: dict[str, str]  # names lower-cased
    body: bytes
    labels: list[str]

    def json(self):
        return json.loads(self.body) if self.body else None


def requests_counted(metrics: Metrics) -> dict[tuple[str, str], float]:
    """(route label, status) -> requests counted so far."""
    return {(s.labels["route"], s.labels["status"]): s.value
            for family in metrics.requests_total.collect() for s in family.samples
            if s.name.endswith("_total")}


def moved(before: dict, after: dict) -> list[str]:
    return sorted(label for (label, _), n in after.items() if n != before.get((label, _), 0))


# A transport's column: the answer to a row, or None for a row it cannot express.
Transport = Callable[[Case], Awaitable["Answer | None"]]


@pytest.fixture
async def served(make_client):
    """The real app on loopback, with its gRPC listener: (aiohttp test client, gRPC address)."""
    client = await make_client(grpc_port=0, **SETTINGS)
    listener = client.app[LISTENERS][0]
    await asyncio.wait_for(listener.wait_started(), 60)
    return client, f"127.0.0.1:{listener.port}"


@pytest.fixture
async def through_aiohttp(served) -> Transport:
    client, _ = served
    metrics = client.server.app[SERVICE].metrics

    async def send(case: Case) -> Answer:
        before = requests_counted(metrics)
        async with client.request(case.method, case.target, data=case.body,
                                  headers=case.headers) as resp:
            body = await resp.read()
        return Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()}, body,
                      moved(before, requests_counted(metrics)))

    return send


class InProcessModel:
    """Stands in for Ray's deployment handle to the model replicas: `handle.remote(call)` runs
    the replica's `answer` on one real `Service`, the call and its reply pickled on the way as
    Ray does between processes."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.handle = self

    def remote(self, call: Call):
        return self._run(pickle.dumps(call))

    async def _run(self, sent: bytes):
        return pickle.loads(pickle.dumps(await answer(self.service, pickle.loads(sent))))

    def broadcast(self, method: str) -> InProcessBroadcast:
        """`handle.broadcast(method)` to the one replica (what the ingress merges /metrics
        from), as Ray 2.60's broadcast response is read: one result per replica."""
        assert method == "metrics_text", method
        return InProcessBroadcast(self.service)


class InProcessBroadcast:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def _fetch_replica_results_async(self) -> list[InProcessBroadcast]:
        return [self]

    async def get_async(self) -> tuple[str, str]:
        body, _ = self.service.render_metrics()
        return pickle.loads(pickle.dumps(("in-process", body.decode())))


def starlette_request(case: Case) -> HttpRequest:
    """The request Ray's HTTP proxy hands the ingress, from the ASGI scope of `case`."""
    url = urlsplit(case.target)
    headers = dict(case.headers)
    if case.body is not None:
        headers["Content-Length"] = str(len(case.body))
    scope = {"type": "http", "http_version": "1.1", "method": case.method, "scheme": "http",
             "path": url.path, "raw_path": url.path.encode(), "root_path": "",
             "query_string": url.query.encode(), "server": ("127.0.0.1", 8000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    chunks = [case.body[i:i + 65536] for i in range(0, len(case.body or b""), 65536)] or [b""]

    async def receive():
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    return HttpRequest(scope, receive)


@pytest.fixture
async def through_ray(trunk, store, tmp_path) -> Transport:
    settings = make_settings(tmp_path, **SETTINGS)
    service = Service(settings, trunk=trunk, store=store)
    await service.start()
    assert await service.wait_ready(), service.readiness.error
    ingress = Ingress(InProcessModel(service), settings)

    async def send(case: Case) -> Answer:
        before = requests_counted(service.metrics)
        resp = await ingress.respond(starlette_request(case))
        return Answer(resp.status_code, {k.lower(): v for k, v in resp.headers.items()},
                      bytes(resp.body), moved(before, requests_counted(service.metrics)))

    yield send
    await service.close()


# code -> (HTTP status, gRPC status code name), from the one error table.
ERROR_TABLE = {e.code: (e.http, e.grpc) for e in error_codes()}


@pytest.fixture
async def through_grpc(served) -> Transport:
    client, address = served
    metrics = client.server.app[SERVICE].metrics
    channel = grpc.aio.insecure_channel(address)
    stub_of = grpc_column.stubs(channel)

    async def send(case: Case) -> Answer | None:
        rpc = grpc_column.rpc_of(case.method, case.target, case.body)
        if rpc is None:
            return None
        before = requests_counted(metrics)
        got = await grpc_column.call(stub_of, rpc, CODE_KEY)
        if got.code == grpc.StatusCode.OK.name:
            status = 200
        else:
            known = ERROR_TABLE.get(got.body.get("code"))
            status = known[0] if known else None
        return Answer(status, {"grpc-status": got.code, **got.trailing},
                      json.dumps(got.body).encode(), moved(before, requests_counted(metrics)))

    yield send
    await channel.close()


@pytest.fixture
def transports(through_aiohttp, through_ray, through_grpc) -> dict[str, Transport]:
    return {"aiohttp": through_aiohttp, "ray": through_ray, "grpc": through_grpc}


HTTP_HEADERS = frozenset({"server-timing", "allow", "content-type"})
# What each transport's answers carry besides a status, a body and metrics: the checks and the
# comparison of anything else skip that transport.
CARRIES = {"aiohttp": HTTP_HEADERS, "ray": HTTP_HEADERS, "grpc": frozenset({"grpc-status"})}


def problems(case: Case, name: str, got: Answer) -> list[str]:
    """How `got` differs from what `case` says every transport answers."""
    want_labels = [] if name in case.uncounted_on else [case.label]
    bare = name in case.bare_on
    want_status, want_code = (None, None) if bare else (case.status, case.code)
    carries = CARRIES[name]
    want_grpc = "OK" if case.status < 400 else ERROR_TABLE.get(case.code, (0, None))[1]
    found = [
        (got.status == want_status, f"status {got.status}, not {want_status}"),
        (got.labels == want_labels, f"counted under {got.labels}, not {want_labels}"),
        ("server-timing" not in carries or not want_labels
         or got.headers.get("server-timing", "").startswith("app;dur="), "no Server-Timing"),
        ("allow" not in carries or case.status != 405 or got.headers.get("allow"), "no Allow"),
        ((case.code is None and not bare) or (got.json() or {}).get("code") == want_code,
         f"code is not {want_code}"),
        ("grpc-status" not in carries or got.headers.get("grpc-status") == want_grpc,
         f"gRPC status {got.headers.get('grpc-status')}, not {want_grpc}"),
    ]
    return [f"{case.name} via {name}: {what}: {got.body[:200]!r}" for ok, what in found if not ok]


def compared(case: Case, name: str, got: Answer) -> dict[str, object]:
    """What of `got` must be the same across transports: what `name` carries of it."""
    fields = {"status": got.status, "allow": got.headers.get("allow"),
              "content-type": got.headers.get("content-type"),
              "body": got.json() if case.same_body else None}
    if name in case.bare_on:  # its own refusal: `problems` checked it
        del fields["status"], fields["body"]
    return {key: value for key, value in fields.items()
            if key in ("status", "body") or key in CARRIES[name]}


async def test_every_transport_gives_each_request_the_same_answer(transports):
    wrong = []
    for case in CASES:  # in table order: each transport sees the same history
        seen = {}
        for name, send in transports.items():
            got = await send(case)
            if got is None:  # a request this transport cannot express (no URL routes in gRPC)
                continue
            wrong += problems(case, name, got)
            seen[name] = compared(case, name, got)
        for key in ("status", "allow", "content-type", "body"):
            values = {name: fields[key] for name, fields in seen.items() if key in fields}
            first, *others = values.values() or [None]
            if any(other != first for other in others):
                wrong.append(f"{case.name}: the transports differ in {key}: {values}")
    assert not wrong, "\n".join(wrong)


def test_every_rpc_with_a_rest_twin_has_a_row():
    """Each RPC the product maps to a REST endpoint (metrics label) is driven by some row."""
    mapped = set(grpc_kserve.ENDPOINT_NAMES) | set(grpc_tfserving.ENDPOINT_NAMES)
    rpcs = [grpc_column.rpc_of(case.method, case.target, case.body) for case in CASES]
    assert mapped <= {rpc.name for rpc in rpcs if rpc is not None}
