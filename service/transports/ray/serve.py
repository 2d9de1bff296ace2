"""The Ray Serve transport: the same service, as N replicas behind Ray's HTTP proxy.

Two deployments form the application:
- `Multihead`, the model replicas (`service.transports.ray.replica`): each is one Ray actor
  process holding one `Service`. It builds the trunk once, runs its own cross-bot batcher and
  opens the store itself (a `postgresql://` store is what lets replicas on several machines see
  the same bots). It answers each request through the SAME request pipeline and codecs as the
  aiohttp server (`service.codecs.pipeline`), so every protocol behaves the same on both
  transports.
- `MultiheadIngress`, what Ray's HTTP proxy calls (`service.transports.ray.ingress`): a light
  ASGI app without TensorFlow that routes, reads the body within the size limit and byte
  budget, and passes each request to a model replica through a deployment handle (Ray balances
  the replicas), retrying once on another replica when one dies; it serves the WebSocket
  (a streaming endpoint of the table) the same way, one call per message.

Metrics are the replicas'; `/metrics` answers their merge. Cancellation: a client that
disconnects cancels its call to the model replica, whose batcher withdraws the request's rows.
Unlike the aiohttp server, the body is read before the caller and the bot are checked (a
refusal of the body is still answered after the caller step, by a replica).

Readiness: a model replica's constructor returns only when its trunk is loaded and warm, and
its health check fails if the service stops being ready, so Ray hands requests only to ready
replicas: `/readyz` is 200 exactly when at least one replica is ready (with none, the ingress
answers 503 `not_ready` after `ingress.PROBE_TIMEOUT_S`). Every answer names its model replica
in `X-Multihead-Replica`; `/readyz` also gives that replica's pid.

Entry points: `run(settings)` for `multihead serve --ray` (starts a local Ray unless
`--ray-address` names a cluster, deploys, serves until SIGTERM/SIGINT, then removes the
application), and `app_builder(args)` for Ray's own tooling (`serve run`, a `RayService`
manifest): `import_path: service.transports.ray.serve:app_builder`, `args` holding settings by
field name.
"""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray import serve

from service.core.settings import Settings
from service.transports.ray.ingress import Ingress
from service.transports.ray.replica import Replica

log = logging.getLogger(__name__)

APP_NAME = "multihead"
DEPLOYMENT_NAME = "Multihead"
INGRESS_NAME = "MultiheadIngress"


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
    # `serve.ingress()`: the ingress is an ASGI app (`Ingress.__serve_build_asgi_app__`), the
    # one way Ray's proxy hands a deployment a WebSocket.
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
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
