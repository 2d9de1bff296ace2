"""Per-tenant shares of the open WebSockets (issue 34, item 5): a tenant opens at most its
weighted share of `max_websockets` (429 `socket_share` beyond it, before the upgrade), and a
tenant within its share is never refused for another's use: the newest socket of the tenant
over its share is closed (1013) to make room. A real server on loopback, `--auth keys`."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from PIL import Image

from service.core.errors import Overloaded, SocketShareExceeded
from service.core.sockets import CLOSE_TRY_LATER, SocketShares
from service.transports.http.app import SERVICE, create_app
from store import HeadStore
from tests.backbone.helpers import encode
from tests.support.builders import tenants_with_bots
from tests.support.fakes import FakeTrunk
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(120)
PNG = encode(Image.new("RGB", (64, 64), (20, 30, 60)))
BOTS = {"acme": "acme-bot", "globex": "globex-bot"}


@pytest.fixture
def world(tmp_path):
    """A server with room for 4 sockets; (server, {tenant: its infer key's token})."""
    store = HeadStore(tmp_path / "store")
    tokens = tenants_with_bots(store, BOTS)
    server = ThreadedServer(create_app(make_settings(tmp_path, auth="keys", max_websockets=4),
                                       trunk=FakeTrunk(), store=store))
    yield server, tokens
    server.close()
    store.close()


async def _open(session, server, tokens, tenant):
    return await session.ws_connect(f"{server.url}/ws/classify/{BOTS[tenant]}",
                                    headers={"Authorization": f"Bearer {tokens[tenant]}"})


async def _refused(session, server, tokens, tenant) -> dict:
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await _open(session, server, tokens, tenant)
    assert info.value.status == 429, info.value
    resp = await session.get(f"{server.url}/ws/classify/{BOTS[tenant]}", headers={
        "Authorization": f"Bearer {tokens[tenant]}", "Connection": "Upgrade",
        "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert resp.status == 429 and "Retry-After" in resp.headers
    return await resp.json()


async def _answers(ws, tenant) -> None:
    await ws.send_bytes(PNG)
    reply = await ws.receive_json(timeout=30)
    assert reply["bot_id"] == BOTS[tenant], reply


async def test_a_tenant_beyond_its_share_of_sockets_is_refused_and_another_still_opens(world):
    server, tokens = world
    async with aiohttp.ClientSession() as session:
        acme = [await _open(session, server, tokens, "acme") for _ in range(4)]  # alone: all
        assert (await _refused(session, server, tokens, "acme"))["code"] == "socket_share"
        # globex, within its share (2 of 4), opens: acme's newest socket makes room.
        globex = [await _open(session, server, tokens, "globex")]
        closed = await acme[-1].receive(timeout=10)
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == CLOSE_TRY_LATER
        assert json.loads(closed.extra)["code"] == "socket_share"
        assert (await _refused(session, server, tokens, "acme"))["code"] == "socket_share"
        globex.append(await _open(session, server, tokens, "globex"))
        assert (await acme[-2].receive(timeout=10)).data == CLOSE_TRY_LATER
        assert (await _refused(session, server, tokens, "globex"))["code"] == "socket_share"
        for ws in globex:
            await _answers(ws, "globex")
        for ws in acme[:2]:
            await _answers(ws, "acme")
        assert server.app[SERVICE].sockets.open_count == 4
        for ws in acme + globex:
            await ws.close()


def test_shares_follow_the_weights_and_no_tenant_over_its_share_means_overloaded():
    weights = {"big": 3.0, "small": 1.0, "third": 0.1}
    closed = []

    def close_of(socket):
        async def close() -> None:
            closed.append(socket)
        return close

    shares = SocketShares(8, weights.__getitem__)
    for n in range(7):
        assert shares.admit("big", ("big", n), close_of(("big", n))) is None
    assert shares.share("big") == 8 and shares.share("small") == 2
    assert shares.admit("small", "s", close_of("s")) is None
    assert shares.share("big") == 6 and shares.open_count == 8
    # Full: a newcomer within its share (one socket) pushes out the newest socket of the
    # tenant most over its share (big: 7 of 5 with the newcomer).
    pushed = shares.admit("third", "t", close_of("t"))
    asyncio.run(pushed())
    assert closed == [("big", 6)] and shares.count("big") == 6 and shares.open_count == 8
    # Every socket taken and no tenant over its share (the floor of one each): 503.
    two = SocketShares(2, lambda tenant: 1.0)
    two.admit("a", "a", close_of("a"))
    two.admit("b", "b", close_of("b"))
    with pytest.raises(Overloaded) as info:
        two.admit("c", "c", close_of("c"))
    assert not isinstance(info.value, SocketShareExceeded)
