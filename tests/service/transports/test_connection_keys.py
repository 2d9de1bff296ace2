"""Keys for the life of a connection (issue 34, item 1): a WebSocket opened with an API key is
closed with code 1008 and a JSON reason once the key is revoked (or its tenant removed), in
this process within a second and in another process on the same store within its snapshot's
refresh interval and a second; a message sent after the revocation is never answered; another
tenant's socket stays open and keeps answering.

Two real servers on loopback (`--auth keys`, an operator token) serve one directory store,
each through its own `HeadStore` (as two processes would: the second learns of a change by
its refresher's poll). The revocations go through the API of the first.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from PIL import Image

from service.core.connections import CLOSE_POLICY, Connections
from service.transports.http.app import SERVICE, create_app
from store import HeadStore
from tests.backbone.helpers import encode
from tests.support.builders import random_head
from tests.support.fakes import FakeTrunk
from tests.support.polling import until
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(120)

OPERATOR_TOKEN = "operator-s3cret-token"
PNG = encode(Image.new("RGB", (64, 64), (200, 30, 60)))
BOTS = {"acme": "acme-bot", "globex": "globex-bot"}
# Same process: closed within this of the revocation (the watcher reads every 0.1 s).
LOCAL_BOUND_S = 1.0


@pytest.fixture
def world(tmp_path):
    """Two servers on one store: (first, second, the first's store, the second's)."""
    stores = [HeadStore(tmp_path / "store"), HeadStore(tmp_path / "store")]
    first = stores[0]
    for i, (tenant, bot) in enumerate(BOTS.items()):
        first.add_tenant(tenant)
        first.register(bot, *random_head(3, seed=i), tenant=tenant)
    servers = []
    for store in stores:
        settings = make_settings(tmp_path, auth="keys", admin_token=OPERATOR_TOKEN)
        servers.append(ThreadedServer(create_app(settings, trunk=FakeTrunk(), store=store)))
    yield servers[0], servers[1], first, stores[1]
    for server in servers:
        server.close()
    for store in stores:
        store.close()


async def _open(session: aiohttp.ClientSession, server, tenant: str, token: str):
    ws = await session.ws_connect(f"{server.url}/ws/classify/{BOTS[tenant]}",
                                  headers={"Authorization": f"Bearer {token}"})
    await _classifies(ws, tenant)
    return ws


async def _classifies(ws, tenant: str) -> None:
    await ws.send_bytes(PNG)
    reply = await ws.receive_json(timeout=30)
    assert reply["bot_id"] == BOTS[tenant] and len(reply["results"]) == 1, reply


async def _closed_within(ws, bound_s: float, since: float) -> float:
    """Waits for the socket's close (no answer may come before it); returns when it came."""
    msg = await ws.receive(timeout=bound_s + 5.0)
    took = time.monotonic() - since
    assert msg.type == aiohttp.WSMsgType.CLOSE, (msg.type, msg.data)
    assert ws.close_code == CLOSE_POLICY
    reason = json.loads(msg.extra)
    assert reason["status"] == 401 and reason["code"] == "unauthorized", reason
    assert took <= bound_s, f"closed {took:.2f} s after the revocation (bound {bound_s} s)"
    return took


async def _seen_by(store: HeadStore, *key_ids: str) -> None:
    """Waits until the second server's store knows the keys added through the first."""
    await until(lambda: all(k in store.key_table() for k in key_ids), 10.0,
                what="the second store seeing the new keys")


async def _revoked_through_the_api(server, path: str) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.delete(f"{server.url}{path}",
                                  headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as resp:
            assert resp.status in (200, 204), await resp.text()
    return time.monotonic()


async def test_a_revoked_keys_sockets_close_in_every_process_and_others_stay_open(world):
    first, second, store, other = world
    acme_key, acme_token = store.add_key("acme", "infer")
    globex_key, globex_token = store.add_key("globex", "infer")
    await _seen_by(other, acme_key.id, globex_key.id)
    async with aiohttp.ClientSession() as session:
        acme_here = await _open(session, first, "acme", acme_token)
        acme_there = await _open(session, second, "acme", acme_token)
        globex_here = await _open(session, first, "globex", globex_token)
        globex_there = await _open(session, second, "globex", globex_token)

        since = await _revoked_through_the_api(first, f"/keys/{acme_key.id}")
        await _closed_within(acme_here, LOCAL_BOUND_S, since)
        await _closed_within(acme_there, HeadStore.change_poll_s + LOCAL_BOUND_S, since)

        for ws, tenant in ((globex_here, "globex"), (globex_there, "globex")):
            assert not ws.closed
            await _classifies(ws, tenant)
        # The revoked key opens no new socket either.
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(f"{first.url}/ws/classify/acme-bot",
                                     headers={"Authorization": f"Bearer {acme_token}"})
        assert refused.value.status == 401
        for ws in (globex_here, globex_there):
            await ws.close()


async def test_a_message_after_the_revocation_is_refused_by_the_close(world):
    """Before the watcher's round (here: never), a message on a revoked key's socket gets no
    answer: the socket is closed instead."""
    first, _, store, _ = world
    first_service = first.app[SERVICE]
    first_service.connections = Connections(store.key_table, every_s=3600.0)
    key, token = store.add_key("acme", "infer")
    async with aiohttp.ClientSession() as session:
        ws = await _open(session, first, "acme", token)
        since = await _revoked_through_the_api(first, f"/keys/{key.id}")
        assert not ws.closed
        await ws.send_bytes(PNG)
        await _closed_within(ws, LOCAL_BOUND_S, since)


async def test_removing_a_tenant_closes_its_sockets_in_every_process(world):
    first, second, store, other = world
    store.add_tenant("initech")
    store.register("initech-bot", *random_head(3, seed=7), tenant="initech")
    BOTS["initech"] = "initech-bot"
    try:
        key, token = store.add_key("initech", "infer")
        globex_key, globex_token = store.add_key("globex", "infer")
        await _seen_by(other, key.id, globex_key.id)
        async with aiohttp.ClientSession() as session:
            here = await _open(session, first, "initech", token)
            there = await _open(session, second, "initech", token)
            globex = await _open(session, second, "globex", globex_token)
            since = await _revoked_through_the_api(first, "/tenants/initech?force=true")
            await asyncio.gather(
                _closed_within(here, LOCAL_BOUND_S, since),
                _closed_within(there, HeadStore.change_poll_s + LOCAL_BOUND_S, since))
            await _classifies(globex, "globex")
            await globex.close()
    finally:
        BOTS.pop("initech")


async def test_through_rays_ingress_a_message_after_the_revocation_closes_the_socket(
        world, tmp_path):
    """The Ray transport's own code in-process (`test_same_answers.InProcessModel`: a real
    `Ingress`, each call pickled to the replica's `answer` on a real `Service`): the replica
    checks the key per message, and the ingress closes the socket with 1008 when it refuses
    one. (An idle socket stays open until its next message: the ingress holds no key table.)"""
    from service.core.service import Service
    from service.transports.ray.ingress import Ingress
    from tests.service.transports.test_same_answers import InProcessModel

    _, _, store, _ = world
    settings = make_settings(tmp_path, auth="keys", admin_token=OPERATOR_TOKEN)
    service = Service(settings, trunk=FakeTrunk(), store=store)
    await service.start()
    assert await service.wait_ready(), service.readiness.error
    key, token = store.add_key("acme", "infer")
    incoming: asyncio.Queue = asyncio.Queue()
    sent: asyncio.Queue = asyncio.Queue()
    scope = {"type": "websocket", "path": "/ws/classify/acme-bot", "raw_path": b"",
             "query_string": b"", "root_path": "", "scheme": "ws", "server": ("127.0.0.1", 80),
             "headers": [(b"authorization", f"Bearer {token}".encode())], "subprotocols": [],
             "extensions": {"websocket.http.response": {}}}
    try:
        socket = asyncio.create_task(
            Ingress(InProcessModel(service), settings).asgi(scope, incoming.get, sent.put))
        await incoming.put({"type": "websocket.connect"})
        assert (await asyncio.wait_for(sent.get(), 30))["type"] == "websocket.accept"
        await incoming.put({"type": "websocket.receive", "bytes": PNG})
        answer = await asyncio.wait_for(sent.get(), 30)
        assert json.loads(answer["text"])["bot_id"] == "acme-bot", answer
        store.revoke_key(key.id)
        await incoming.put({"type": "websocket.receive", "bytes": PNG})
        closed = await asyncio.wait_for(sent.get(), 30)
        assert closed["type"] == "websocket.close" and closed["code"] == CLOSE_POLICY, closed
        assert json.loads(closed["reason"])["code"] == "unauthorized"
        await incoming.put({"type": "websocket.disconnect", "code": CLOSE_POLICY})
        await asyncio.wait_for(socket, 30)
    finally:
        await service.close()
