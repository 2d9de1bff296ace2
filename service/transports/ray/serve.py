"""The Ray Serve transport: the same service, as N replicas behind Ray's HTTP proxy.

Two deployments form the application:
- `Multihead`, the model replicas: each is one Ray actor process holding one `Service`. It
  builds the trunk once, runs its own cross-bot batcher and opens the store itself (a
  `postgresql://` store is what lets replicas on several machines see the same bots). It answers
  each request through the SAME codecs as the aiohttp server (`dispatch`), so every protocol
  behaves the same on both transports.
- `MultiheadIngress`, what Ray's HTTP proxy calls: light processes without TensorFlow that
  route with `service.transports.common.router.Router` over `service.codecs.routes.ENDPOINTS`,
  read the body within the size limit and byte budget, and pass the request to a model
  replica through a deployment handle (Ray balances the replicas). A request no endpoint
  matches goes to a replica too (without its body), which answers 404/405 and counts it: the
  replicas hold the metrics, by endpoint name as on every transport
  (`service.transports.common.exchange`). So does a request the ingress
  refuses itself (a body over `max_body_bytes`, the byte budget full, a lost replica): its
  error answer goes to a replica (without the body) to be counted and returned; only with no
  replica answering within PROBE_TIMEOUT_S does the ingress answer it uncounted. When a model
  replica dies with requests in flight, a request that is safe to repeat (everything but the
  admin writes) is retried once on another replica, and the rest get 503 `replica_lost` +
  Retry-After (counted by another replica), never a bare 500.

Metrics: `/metrics` goes to a replica like any request (it checks the caller's access and
counts the scrape); then the ingress asks every model replica for its metrics
(`DeploymentHandle.broadcast`), waits at most METRICS_TIMEOUT_S for each, and answers their
merge (`service.core.metrics_merge`: counters and histograms summed, gauges by meaning,
`multihead_metrics_replicas_missing` for replicas that did not answer).

Cancellation: a client that disconnects makes Ray's proxy cancel the ingress's request, which
cancels its call to the model replica: the replica counts a 499 and its batcher withdraws the
request's rows still queued for the trunk (as on aiohttp and gRPC).

What only aiohttp does (the WebSocket route, the web page) is not served here; unlike the
aiohttp server, the body is read before the bot is looked up.

Readiness: a model replica's constructor returns only when its trunk is loaded and warm, and
its health check fails if the service stops being ready, so Ray hands requests only to ready
replicas: `/readyz` is 200 exactly when at least one replica is ready (with none, the ingress
answers 503 `not_ready` after PROBE_TIMEOUT_S). Every answer names its model replica in
`X-Multihead-Replica`; `/readyz` also gives that replica's pid.

Entry points: `run(settings)` for `multihead serve --ray` (starts a local Ray unless
`--ray-address` names a cluster, deploys, serves until SIGTERM/SIGINT, then removes the
application), and `app_builder(args)` for Ray's own tooling (`serve run`, a `RayService`
manifest): `import_path: service.transports.ray.serve:app_builder`, `args` holding settings by
field name.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from service.codecs.base import Endpoint, Reply, Request, dispatch, error_reply
from service.codecs.routes import ENDPOINTS
from service.core import memory
from service.core.admission import ByteBudget, Reservation
from service.core.errors import (
    DeadlineExceeded,
    NotReady,
    Overloaded,
    ReplicaLost,
    ServiceError,
)
from service.core.logs import REQUEST_ID_HEADER, configure, request_scope
from service.core.metrics_merge import Aggregate
from service.core.service import Service
from service.core.settings import Settings
from service.transports.common.exchange import (
    CLIENT_CLOSED,
    SERVER_TIMING,
    admit_body,
    build_request,
    chunks,
    content_length,
    metric_label,
    no_route,
    record,
)
from service.transports.common.router import Match, Router, route_template

log = logging.getLogger(__name__)

APP_NAME = "multihead"
DEPLOYMENT_NAME = "Multihead"
INGRESS_NAME = "MultiheadIngress"
REPLICA_HEADER = "X-Multihead-Replica"
# Readiness endpoints (ops /readyz, OIP v2 server ready): answered "not ready" by the ingress
# when no model replica takes them within PROBE_TIMEOUT_S.
READINESS_PROBES = frozenset({"readyz", "oip_server_ready"})
PROBE_TIMEOUT_S = 2.0
# The endpoint whose answer the ingress builds from every model replica's metrics, and how
# long it waits for each replica.
METRICS_ENDPOINT = "metrics"
METRICS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Call:
    """One routed request, as the ingress hands it to a model replica (picklable).

    `endpoint` is the matched endpoint's name, or None when no endpoint matched: the replica
    then answers 404, or 405 with `allowed`, and counts it like any request (the ingress
    counts nothing itself: the replicas hold the metrics). `refused`: the ingress's own error answer
    to the request (its body over the limit, ...), which the replica counts and returns as is.
    """

    endpoint: str | None
    request: Request  # without its body reader: the body travels as bytes
    body: bytes = b""
    allowed: tuple[str, ...] = ()
    refused: Reply | None = None

    def local_answer(self) -> Reply | None:
        """What the ingress answers itself, uncounted, when no replica takes this call in
        time: a no-route or refused call's answer; None for a routed call (it needs one)."""
        if self.refused is not None:
            return self.refused
        return no_route(self.allowed) if self.endpoint is None else None


ENDPOINTS_BY_NAME = {endpoint.name: endpoint for endpoint in ENDPOINTS}


async def answer(service: Service, call: Call) -> Reply:
    """Runs one routed request through the codecs of `service`, as the aiohttp transport does:
    the same dispatch, the same no-route answer, metrics and Server-Timing by endpoint name,
    request id (`X-Request-Id`), span and access line. What a model replica does with each
    call; a function of the `Service` so that it runs without Ray too
    (tests/service/transports/test_same_answers.py)."""
    request = call.request
    endpoint = ENDPOINTS_BY_NAME[call.endpoint] if call.endpoint is not None else None
    with request_scope(service.tracing, service.settings.access_log, protocol="http",
                       method=request.method, route=metric_label(endpoint), path=request.path,
                       headers=request.headers, span_name=(
                           f"{request.method} {route_template(endpoint.path)}" if endpoint
                           else request.method),
                       attributes=({"http.request.method": request.method,
                                    "url.path": request.path}
                                   if service.tracing is not None else None)) as req:
        reply = await _answer(service, call, endpoint)
        req.status = reply.status
        return dataclasses.replace(reply, headers={**reply.headers,
                                                   REQUEST_ID_HEADER: req.request_id})


async def _answer(service: Service, call: Call, endpoint: Endpoint | None) -> Reply:
    start = time.perf_counter()
    if call.refused is not None:
        reply = call.refused
    elif endpoint is None:
        reply = no_route(call.allowed)
    else:
        # NOTE: the body is already in this process: held against this replica's budget too,
        # until the answer is built.
        with Reservation(service.inflight) as held:
            try:
                held.take(len(call.body))
            except Overloaded as exc:
                reply = error_reply(exc)
            else:
                body = call.body

                async def read_body() -> bytes:
                    return body

                try:
                    reply = await dispatch(service, endpoint,
                                           dataclasses.replace(call.request, read_body=read_body))
                except asyncio.CancelledError:
                    # The client left: Ray's proxy cancelled the ingress's request, which
                    # cancelled this call (`Ingress._call`); the batcher has withdrawn the
                    # request's queued rows. Counted as on aiohttp and gRPC.
                    record(service.metrics, metric_label(endpoint), CLIENT_CLOSED, start)
                    raise
    timing = record(service.metrics, metric_label(endpoint), reply.status, start)
    return dataclasses.replace(reply, headers={**reply.headers, SERVER_TIMING: timing})


class Replica:
    """One model replica: one `Service` (trunk, batcher, store) in one Ray actor process."""

    async def __init__(self, settings: Settings) -> None:
        # NOTE: this actor's lines go where Ray sends its workers' stderr (files, the driver).
        configure(settings.log_format)
        self.settings = settings
        self.service = Service(settings)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.service.identity = {"replica": self.name, "pid": os.getpid()}
        await self.service.start()
        if not await self.service.wait_ready():
            # Ray retries a replica whose constructor fails, and routes nothing to it meanwhile.
            raise RuntimeError(self.service.readiness.error or "bring-up failed")
        log.info("replica %s ready (pid %d)", self.name, os.getpid())

    async def check_health(self) -> None:
        """Ray calls this periodically; raising makes Ray replace the replica."""
        if not self.service.readiness.ready:
            raise RuntimeError(self.service.readiness.error or "not ready")

    async def handle(self, call: Call) -> Reply:
        """Answers one routed request (`answer`), naming this replica in the reply."""
        reply = await answer(self.service, call)
        return dataclasses.replace(reply, headers={**reply.headers, REPLICA_HEADER: self.name})

    async def metrics_text(self) -> tuple[str, str]:
        """(this replica's name, its Prometheus text): what the ingress merges into the answer
        to /metrics. A call of the ingress to every replica, not a request: not counted."""
        body, _ = self.service.render_metrics()
        return self.name, body.decode()

    async def __del__(self) -> None:
        # Ray calls this when it stops the replica, after draining its ongoing requests.
        await self.service.close()


class Ingress:
    """What Ray's HTTP proxy calls: routes, reads the body within the limits, and hands the
    request to a model replica through a deployment handle.

    NOTE: a separate, light deployment (no TensorFlow) so that a model replica that dies with
    requests in flight costs those requests a retry on another replica (classification and
    every read are safe to repeat) or an explicit 503, never the proxy's bare 500.
    """

    def __init__(self, model: DeploymentHandle, settings: Settings) -> None:
        self.model = model
        self.settings = settings
        self.router = Router(ENDPOINTS)
        self.inflight = ByteBudget(settings.max_inflight_bytes, on_burst_end=memory.Trimmer())
        self.metrics = Aggregate()
        self._asked = 0  # model replicas asked for their metrics at the last scrape

    async def __call__(self, http: HttpRequest) -> Response:
        match = self.router.match(http.method, http.url.path)
        try:
            reply = await self._forward(http, match)
            if (match.endpoint is not None and match.endpoint.name == METRICS_ENDPOINT
                    and reply.status == 200):
                reply = await self._all_metrics(reply)
        except Exception as exc:  # noqa: BLE001 - every error becomes a JSON answer
            reply = error_reply(exc)
        body = b"" if http.method == "HEAD" else reply.body
        return Response(body, status_code=reply.status, headers=dict(reply.headers),
                        media_type=reply.content_type)

    async def _forward(self, http: HttpRequest, match: Match) -> Reply:
        endpoint = match.endpoint
        query, headers = http.query_params.multi_items(), http.headers.items()
        request = build_request(http.method, http.url.path, match.params, query, headers)
        name = None if endpoint is None else endpoint.name
        with Reservation(self.inflight) as held:
            if endpoint is None:  # a replica answers it (and counts it); its body is not read
                body: bytes | bytearray = b""
            else:
                try:
                    read_body = admit_body(chunks(http.stream(), ClientDisconnect),
                                           content_length(http.headers),
                                           self.settings.max_body_bytes, held)
                    body = await read_body()
                except ServiceError as exc:  # refused here: a replica counts the answer
                    return await self._call(Call(name, request, refused=error_reply(exc)))
            call = Call(name, request, bytes(body), match.allowed)
            del body
            # Admin writes are not repeated behind a client; everything else is safe to repeat.
            tries = 1 if endpoint is not None and endpoint.admin else 2
            for attempt in range(1, tries + 1):
                try:
                    return await self._call(call)
                except RayActorError:
                    log.warning("a replica died serving %s %s (try %d of %d)",
                                call.request.method, call.request.path, attempt, tries)
        lost = ReplicaLost(
            "the replica serving this request stopped; retry (another replica answers)")
        return await self._call(Call(call.endpoint, call.request, refused=error_reply(lost)))

    async def _all_metrics(self, reply: Reply) -> Reply:
        """The answer to /metrics: every model replica's metrics, merged
        (`service.core.metrics_merge`). `reply` is the answer of the replica that checked the
        caller's access and counted the scrape, as for any request; its body is replaced."""
        texts, missing = await self._replica_metrics()
        body, content_type = self.metrics.merge(texts, missing)
        return dataclasses.replace(reply, body=body, content_type=content_type)

    async def _replica_metrics(self) -> tuple[dict[str, str], int]:
        """{replica name: its Prometheus text} of every model replica that answers within
        METRICS_TIMEOUT_S, and how many replicas asked did not (killed, stuck)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + METRICS_TIMEOUT_S
        # NOTE: the public `results_async` has one timeout for all the replicas: one stuck
        # replica would lose every answer. So each replica's result is awaited within the
        # deadline on its own, through `_fetch_replica_results_async` (the step `results_async`
        # starts with in Ray 2.60, pinned in setup.py; tests/scaleout/test_ray.py calls it).
        try:
            broadcast = self.model.broadcast("metrics_text")
            results = await asyncio.wait_for(broadcast._fetch_replica_results_async(),
                                             METRICS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - no replica to ask: the sums remembered
            log.warning("no model replica could be asked for its metrics: %r", exc)
            return {}, max(self._asked, 1)
        answers = await asyncio.gather(
            *(asyncio.wait_for(result.get_async(), max(deadline - loop.time(), 0.1))
              for result in results), return_exceptions=True)
        texts: dict[str, str] = {}
        for got in answers:
            if isinstance(got, BaseException):
                log.warning("a model replica did not give its metrics: %r", got)
            else:
                name, text = got
                texts[name] = text
        self._asked = len(answers)
        return texts, len(answers) - len(texts)

    async def _call(self, call: Call) -> Reply:
        # NOTE: with no model replica ready, Ray queues the call until one is: a readiness
        # probe must not wait for that, it must say "not ready", and a request no endpoint
        # matches or the ingress refused is still answered at once (uncounted: no replica to
        # count it).
        local = call.local_answer()
        probe = local is not None or call.endpoint in READINESS_PROBES
        timeout = PROBE_TIMEOUT_S if probe else self.settings.request_timeout_s + 5.0
        response = self.model.handle.remote(call)
        try:
            return await asyncio.wait_for(response, timeout)
        except asyncio.CancelledError:
            # The client left: Ray's proxy cancelled this request. The model replica's handler
            # must be cancelled too (its batcher then withdraws the request's queued rows).
            # NOTE: Ray 2.60 does it by itself (measured with tests/scaleout/test_ray.py, this
            # line taken out), but awaiting a DeploymentResponse in a cancelled task does not
            # cancel the call: done here so as not to depend on how Ray does it.
            response.cancel()
            raise
        except (TimeoutError, RayActorError) as exc:
            if isinstance(exc, TimeoutError):
                response.cancel()  # given up: not to be assigned or run for nobody
            if local is not None:
                return local
            if isinstance(exc, RayActorError):
                raise
            if probe:
                raise NotReady("no replica is ready") from None
            raise DeadlineExceeded(f"no replica answered within {timeout:.0f} s") from None


def deployment_options(settings: Settings) -> dict[str, Any]:
    """Ray Serve options of the replica deployment, from the settings."""
    actor: dict[str, Any] = {"num_cpus": settings.deployment.replica_cpus}
    if settings.deployment.replica_gpus:
        actor["num_gpus"] = settings.deployment.replica_gpus
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": actor,
        # NOTE: Ray's default (5) would starve the cross-bot batcher, which needs many requests
        # in one replica at once; the replica's own queue limit and byte budget still apply.
        "max_ongoing_requests": settings.deployment.max_ongoing_requests,
        "graceful_shutdown_timeout_s": settings.request_timeout_s,
        "health_check_period_s": 5.0,
    }
    if settings.deployment.max_replicas is not None:
        options["autoscaling_config"] = {
            "min_replicas": settings.deployment.fewest_replicas,
            "max_replicas": settings.deployment.max_replicas,
            "target_ongoing_requests": settings.deployment.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = settings.deployment.replicas
    return options


def _absolute(settings: Settings) -> Settings:
    """Replicas run in other processes (other directories): local paths made absolute."""
    changes: dict[str, Any] = {}
    if "://" not in settings.store:
        changes["store"] = str(Path(settings.store).resolve())
    if settings.trunk_checkpoint and "://" not in settings.trunk_checkpoint:
        changes["trunk_checkpoint"] = str(Path(settings.trunk_checkpoint).resolve())
    return settings.replace(**changes) if changes else settings


def build_app(settings: Settings) -> serve.Application:
    """The Ray Serve application of these settings (not yet running): the ingress, bound to the
    model replicas."""
    settings = _absolute(settings)
    model = serve.deployment(Replica).options(**deployment_options(settings))
    ingress = serve.deployment(Ingress).options(
        name=INGRESS_NAME, num_replicas=settings.deployment.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=(settings.deployment.max_ongoing_requests
                              * max(1, settings.deployment.replicas)))
    return ingress.bind(model.bind(settings), settings)


def app_builder(args: Mapping[str, Any]) -> serve.Application:
    """For Ray's tooling (`serve run service.transports.ray.serve:app_builder key=value ...`, a
    `RayService` manifest): the settings come from MULTIHEAD_* variables overridden by `args`
    (field names, values as text)."""
    return build_app(Settings.from_mapping(args))


def run(settings: Settings) -> None:
    """`multihead serve --ray`: deploy, serve until SIGTERM/SIGINT, then remove the app (and
    stop the local Ray this process started)."""
    import ray
    from ray.serve.config import HTTPOptions

    local = settings.deployment.ray_address is None
    ray.init(address="local" if local else settings.deployment.ray_address,
             include_dashboard=False, log_to_driver=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options=HTTPOptions(host=settings.host, port=settings.port))
        log.info("deploying %d replica(s) on Ray %s", settings.deployment.replicas,
                 "(local)" if local else settings.deployment.ray_address)
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
        log.info("serving on http://%s:%d (Ray Serve)", settings.host, settings.port)
        stop.wait()
        log.info("stopping: draining the replicas")
        serve.delete(APP_NAME)
    finally:
        if local:
            serve.shutdown()
            ray.shutdown()
