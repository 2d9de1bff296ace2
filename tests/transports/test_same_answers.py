"""Every transport answers the same request the same way: status, JSON body or error code,
`Allow`, Server-Timing, and the metrics label it is counted under (the endpoint's name;
`unmatched` for 404/405).

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
- gRPC has no URL routes: a column for it maps an RPC onto the row's endpoint (the lead adds
  it: a function from `Case` to `Answer` in `transports`, for the rows an RPC can express).
"""
from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
from PIL import Image
from starlette.requests import Request as HttpRequest

from service.core.context import Service
from service.core.metrics import Metrics
from service.transports.common.exchange import UNMATCHED
from service.transports.http.app import SERVICE
from service.transports.ray.serve import Call, Ingress, answer
from tests.backbone.helpers import encode
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


JSON_TYPE = {"Content-Type": "application/json"}
PNG_TYPE = {"Content-Type": "image/png"}

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
         "payload_too_large", body=b"x" * (MAX_BODY_BYTES + 1), headers=PNG_TYPE,
         uncounted_on={"ray": "refused by the ingress before any replica sees it: the "
                              "replicas hold the metrics, and a refusal stays cheap"}),
    Case("OIP infer", "POST", "/v2/models/charlie/infer", 200, "oip_infer", body=js(
        {"id": "7", "inputs": [{"name": "image_bytes", "datatype": "BYTES", "shape": [1],
                                "data": [PNG_B64]}]}), headers=JSON_TYPE),
    Case("OIP infer, unknown bot", "POST", "/v2/models/nobody/infer", 404, "oip_infer",
         "unknown_bot", body=js({"inputs": [{"name": "image_bytes", "datatype": "BYTES",
                                             "shape": [1], "data": [PNG_B64]}]}),
         headers=JSON_TYPE),
    Case("OIP infer, malformed JSON", "POST", "/v2/models/charlie/infer", 400, "oip_infer",
         "bad_request", body=b"{not json", headers=JSON_TYPE),
    Case("OIP model metadata", "GET", "/v2/models/charlie", 200, "oip_model_metadata"),
    Case("TF Serving predict", "POST", "/v1/models/delta:predict", 200, "tfs_predict",
         body=js({"instances": [{"b64": PNG_B64}]}), headers=JSON_TYPE),
    Case("TF Serving, unknown verb", "POST", "/v1/models/delta:explain", 404, "tfs_predict",
         body=js({"instances": [{"b64": PNG_B64}]}), headers=JSON_TYPE, same_body=True),
    Case("admin without token", "PUT", "/bots/alpha", 401, "put_bot", body=b"{}",
         headers=JSON_TYPE),
    Case("admin with a wrong token", "DELETE", "/bots/alpha", 403, "delete_bot",
         headers={"Authorization": "Bearer wrong"}),
    Case("metrics", "GET", "/metrics", 200, "metrics", same_body=False),
]


@dataclass(frozen=True)
class Answer:
    """What a transport answered, and the labels its metrics counted the request under."""

    status: int
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
async def through_aiohttp(make_client) -> Transport:
    client = await make_client(**SETTINGS)
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
        resp = await ingress(starlette_request(case))
        return Answer(resp.status_code, {k.lower(): v for k, v in resp.headers.items()},
                      bytes(resp.body), moved(before, requests_counted(service.metrics)))

    yield send
    await service.close()


@pytest.fixture
def transports(through_aiohttp, through_ray) -> dict[str, Transport]:
    return {"aiohttp": through_aiohttp, "ray": through_ray}


def problems(case: Case, name: str, got: Answer) -> list[str]:
    """How `got` differs from what `case` says every transport answers."""
    want_labels = [] if name in case.uncounted_on else [case.label]
    found = [
        (got.status == case.status, f"status {got.status}, not {case.status}"),
        (got.labels == want_labels, f"counted under {got.labels}, not {want_labels}"),
        (not want_labels or got.headers.get("server-timing", "").startswith("app;dur="),
         "no Server-Timing"),
        (case.status != 405 or got.headers.get("allow"), "no Allow"),
        (case.code is None or (got.json() or {}).get("code") == case.code,
         f"code is not {case.code}"),
    ]
    return [f"{case.name} via {name}: {what}: {got.body[:200]!r}" for ok, what in found if not ok]


async def test_every_transport_gives_each_request_the_same_answer(transports):
    wrong = []
    for case in CASES:  # in table order: each transport sees the same history
        answers = {}
        for name, send in transports.items():
            got = await send(case)
            if got is None:  # a request this transport cannot express (no URL routes in gRPC)
                continue
            answers[name] = got
            wrong += problems(case, name, got)
        seen = {name: (got.status, got.headers.get("allow"), got.headers.get("content-type"),
                       got.json() if case.same_body else None)
                for name, got in answers.items()}
        first, *others = seen.values()
        if any(other != first for other in others):
            wrong.append(f"{case.name}: the transports differ: {seen}")
    assert not wrong, "\n".join(wrong)
