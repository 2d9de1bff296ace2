"""Observability per tenant: a tenant's key reads only its own tenant in `/metrics`, the full
`/readyz` and `/audit`; the operator reads everything.

One real server with `--auth keys` and three tenants, each with a bot and traffic: acme,
globex, and initech (over `metrics_top_tenants=2`: its traffic counts under tenant="other",
and its bot under bot="other" with `metrics_top_bots=2`). All three bots are pinned.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from PIL import Image

from service.transports.http.app import create_app
from store import HeadStore
from tests.backbone.helpers import encode
from tests.support.builders import random_head
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(300)

OPERATOR_TOKEN = "operator-views-token"
TENANTS = ("acme", "globex", "initech")
BOTS = {tenant: f"{tenant}-bot" for tenant in TENANTS}
PNG = encode(Image.new("RGB", (64, 64), (20, 130, 60)))


class World:
    def __init__(self, tmp_path) -> None:
        self.store = HeadStore(tmp_path / "store", pinned=tuple(BOTS.values()))
        self.headers: dict[tuple[str, str], dict[str, str]] = {}
        for seed, tenant in enumerate(TENANTS):
            self.store.add_tenant(tenant)
            self.store.register(BOTS[tenant], *random_head(3, seed=seed), tenant=tenant)
            for scope in ("infer", "manage", "metrics"):
                _, token = self.store.add_key(tenant, scope)
                self.headers[tenant, scope] = {"Authorization": f"Bearer {token}"}
        self.operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


@pytest.fixture(scope="module")
def world(tmp_path_factory, trunk):
    tmp_path = tmp_path_factory.mktemp("views")
    w = World(tmp_path)
    settings = make_settings(tmp_path, auth="keys", admin_token=OPERATOR_TOKEN,
                             metrics_top_bots=2, metrics_top_tenants=2,
                             pin=",".join(BOTS.values()))
    w.server = ThreadedServer(create_app(settings, trunk=trunk, store=w.store))
    yield w
    w.server.close()
    w.store.close()


async def _get(world: World, path: str, headers: dict[str, str]) -> tuple[int, str]:
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{world.server.url}{path}") as resp:
            return resp.status, await resp.text()


@pytest.fixture(scope="module")
def traffic(world):
    """Each tenant classifies with its own bot, in order (acme and globex get the labels)."""
    asyncio.run(_classify_in_order(world))
    return world


async def _classify_in_order(world: World) -> None:
    async with aiohttp.ClientSession() as session:
        for tenant in TENANTS:
            for _ in range(2):
                async with session.post(f"{world.server.url}/classify/{BOTS[tenant]}",
                                        data=PNG, headers={**world.headers[tenant, "infer"],
                                                           "Content-Type": "image/png"}) as r:
                    assert r.status == 200, await r.text()


def _series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


async def test_a_tenants_metrics_key_reads_only_its_own_series(traffic):
    world = traffic
    status, text = await _get(world, "/metrics", world.headers["acme", "metrics"])
    assert status == 200
    for foreign in ("globex", "initech", 'tenant="other"', 'bot="other"'):
        assert foreign not in text, foreign
    series = _series(text)
    assert any(s.startswith('multihead_bot_requests_total{bot="acme-bot"} 2') for s in series)
    assert any(s.startswith('multihead_tenant_images_total{tenant="acme"}') for s in series)
    assert any(s.startswith('multihead_pinned_bot{bot="acme-bot"}') for s in series)
    # The machine's facts stay; what counts every tenant's traffic together does not.
    assert any(s.startswith("multihead_trunk_info{") for s in series)
    for shared in ("multihead_requests_total", "multihead_batch_size", "multihead_queue_depth",
                   "multihead_feature_cache_hits_total", "multihead_request_seconds"):
        assert not any(s.startswith(shared) for s in series), shared


async def test_the_operator_reads_every_tenant(traffic):
    world = traffic
    status, text = await _get(world, "/metrics", world.operator)
    assert status == 200
    for seen in ('bot="acme-bot"', 'bot="globex-bot"', 'bot="other"', 'tenant="acme"',
                 'tenant="globex"', 'tenant="other"', "multihead_requests_total"):
        assert seen in text, seen


async def test_the_full_readyz_shows_a_tenant_its_own_bots_only(traffic):
    world = traffic
    status, text = await _get(world, "/readyz", world.headers["globex", "metrics"])
    assert status == 200
    assert "acme" not in text and "initech" not in text
    report = json.loads(text)
    assert report["heads"]["pinned"] == ["globex-bot"]
    assert "checkpoint" in report["trunk"] and "in_server" not in report["trunk"]
    status, text = await _get(world, "/readyz", world.operator)
    assert json.loads(text)["heads"]["pinned"] == list(BOTS.values())
    assert "in_server" in json.loads(text)["trunk"]


async def test_audit_is_its_own_tenants_for_a_manage_key_and_closed_to_a_metrics_key(traffic):
    world = traffic
    status, text = await _get(world, "/audit", world.headers["acme", "manage"])
    assert status == 200
    assert {r["tenant"] for r in json.loads(text)["records"]} == {"acme"}
    assert "globex" not in text and "initech" not in text
    status, _ = await _get(world, "/audit", world.headers["acme", "metrics"])
    assert status == 403
    status, text = await _get(world, "/audit", world.operator)
    assert {"acme", "globex", "initech"} <= {r["tenant"] for r in json.loads(text)["records"]}


async def _through_ingress(ingress, path: str, headers: dict[str, str],
                           body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP request to the Ray ingress's ASGI app: (status, body)."""
    scope = {"type": "http", "http_version": "1.1", "method": "POST" if body else "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "server": ("127.0.0.1", 8000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in
                         {**headers, "Content-Length": str(len(body))}.items()]}
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await ingress.asgi(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_through_rays_ingress_the_merged_metrics_are_cut_to_the_tenant(world, tmp_path):
    """The Ray transport's own code in-process (`test_same_answers.InProcessModel`: a real
    `Ingress` over a real `Service`): the ingress merges the replicas' texts, then cuts the
    merge to the scope the replica that checked the caller put on its reply."""
    from service.core.service import Service
    from service.transports.ray.ingress import Ingress
    from tests.service.transports.test_same_answers import InProcessModel
    from tests.support.fakes import FakeTrunk

    settings = make_settings(tmp_path, auth="keys", admin_token=OPERATOR_TOKEN,
                             metrics_top_bots=2, metrics_top_tenants=2,
                             pin=",".join(BOTS.values()))
    service = Service(settings, trunk=FakeTrunk(), store=world.store)
    await service.start()
    try:
        assert await service.wait_ready(), service.readiness.error
        ingress = Ingress(InProcessModel(service), settings)
        for tenant in TENANTS:
            status, body = await _through_ingress(
                ingress, f"/classify/{BOTS[tenant]}",
                {**world.headers[tenant, "infer"], "Content-Type": "image/png"}, PNG)
            assert status == 200, body
        status, mine = await _through_ingress(ingress, "/metrics",
                                              world.headers["acme", "metrics"])
        assert status == 200
        for foreign in (b"globex", b"initech", b'"other"', b"multihead_requests_total"):
            assert foreign not in mine, foreign
        assert b'multihead_bot_requests_total{bot="acme-bot"} 1.0' in mine
        assert b"multihead_metrics_replicas 1.0" in mine
        status, everything = await _through_ingress(ingress, "/metrics", world.operator)
        assert status == 200 and b'bot="globex-bot"' in everything
        assert b'tenant="other"' in everything
    finally:
        await service.close()
