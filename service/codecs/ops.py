"""Operations: `GET /healthz` (the process answers), `GET /readyz` (the trunk is loaded and
warm; 503 with the reason otherwise) and `GET /metrics` (Prometheus text format)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from service.codecs.base import Endpoint, Reply, Request, json_reply

if TYPE_CHECKING:  # pragma: no cover
    from service.runtime import Service


async def healthz(service: Service, request: Request) -> Reply:
    return json_reply({"status": "alive"})


async def readyz(service: Service, request: Request) -> Reply:
    return json_reply(service.readiness_report(),
                      status=200 if service.readiness.ready else 503)


async def metrics(service: Service, request: Request) -> Reply:
    stats = service.store.cache_stats()
    service.metrics.set_resident_heads(stats["resident_heads"], stats["resident_bytes"])
    body, content_type = service.metrics.render()
    return Reply(200, body, content_type)


ENDPOINTS = [
    Endpoint("GET", "/healthz", "healthz", healthz, summary="liveness: the process answers"),
    Endpoint("GET", "/readyz", "readyz", readyz,
             summary="readiness: trunk loaded and warm (503 while loading or after a failure)"),
    Endpoint("GET", "/metrics", "metrics", metrics, summary="Prometheus metrics"),
]
