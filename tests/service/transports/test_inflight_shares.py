"""Per-tenant shares of the in-flight request bytes (issue 34, item 5): a tenant holding bytes
holds at most its weighted share of `max_inflight_bytes` (429 `inflight_share` beyond it,
before its body is read), and a tenant within its share is never refused for another's use:
the newest request of the tenant over its share that is still reading its body, or its newest
WebSocket, is pushed out to make room. A real server on loopback, `--auth keys`."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from PIL import Image

from service.core.sockets import CLOSE_TRY_LATER
from service.transports.http.app import SERVICE, create_app
from store import HeadStore
from tests.backbone.helpers import encode
from tests.support.builders import tenants_with_bots
from tests.support.fakes import FakeTrunk
from tests.support.polling import until
from tests.support.prometheus import metric
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(120)
BOTS = {"acme": "acme-bot", "globex": "globex-bot"}
PNG = encode(Image.new("RGB", (64, 64), (20, 30, 60)))
BODY = PNG + b"\0" * 95_000  # a PNG with trailing bytes decodes fine
LIMIT = 2 * len(BODY) + 1_000  # room for two bodies, not three


@pytest.fixture
def world(tmp_path):
    """A server with room for two bodies in flight; (server, {tenant: its infer key})."""
    store = HeadStore(tmp_path / "store")
    tokens = tenants_with_bots(store, BOTS)
    server = ThreadedServer(create_app(
        make_settings(tmp_path, auth="keys", max_inflight_bytes=LIMIT,
                      max_body_bytes=len(BODY), max_ws_message_bytes=len(BODY)),
        trunk=FakeTrunk(), store=store))
    yield server, tokens
    server.close()
    store.close()


async def _half_then(gate: asyncio.Event):
    yield BODY[:len(BODY) // 2]
    await gate.wait()
    yield BODY[len(BODY) // 2:]


def _post(session, server, tokens, tenant, data=BODY):
    return session.post(f"{server.url}/classify/{BOTS[tenant]}", data=data, headers={
        "Authorization": f"Bearer {tokens[tenant]}", "Content-Type": "image/png",
        "Content-Length": str(len(BODY))})


async def _status(request) -> tuple[int, str | None]:
    """(status, code) of a request's answer; (0, None) when its connection was closed before
    the answer could be read (a body pushed out is not read on)."""
    try:
        async with request as resp:
            body = await resp.json() if resp.status != 200 else {}
            return resp.status, body.get("code")
    except aiohttp.ClientError:
        return 0, None


async def test_a_tenant_over_its_share_of_bytes_is_refused_and_pushed_out_for_another(world):
    server, tokens = world
    inflight = server.app[SERVICE].inflight
    gate = asyncio.Event()

    def upload(tenant: str) -> asyncio.Future:  # stopped half-way until the gate opens
        return asyncio.ensure_future(_status(_post(session, server, tokens, tenant,
                                                   _half_then(gate))))

    async with aiohttp.ClientSession() as session:
        # acme alone: two uploads stopped half-way hold the whole budget (its share: all).
        acme = [upload("acme"), upload("acme")]
        await until(lambda: inflight.held("acme") == 2 * len(BODY), what="acme's uploads held")
        # globex, within its share (half), is admitted: acme's newest upload makes room.
        globex = upload("globex")
        await until(lambda: inflight.held("globex") == len(BODY), what="globex's upload held")
        assert inflight.held("acme") == len(BODY)
        # acme holds its share (half): another of its bodies is refused before it is read.
        assert await _status(_post(session, server, tokens, "acme")) == (429, "inflight_share")
        refusals = metric(server.app[SERVICE].render_metrics()[0].decode(),
                          'multihead_tenant_refusals_total{tenant="acme",code="inflight_share"}')
        assert refusals >= 1  # the refusal (and the push-out, when its answer was sent)
        gate.set()
        assert await globex == (200, None)
        outcomes = await asyncio.gather(*acme)
        # The pushed-out upload fails at its next chunk (429, connection closed: the client
        # may see the close before the answer); the other one is answered.
        outcomes.remove((200, None))
        assert outcomes[0] in ((0, None), (429, "inflight_share"))
    await until(lambda: inflight.used_bytes == 0, what="every byte given back")


async def test_a_websocket_over_its_tenants_share_of_bytes_is_closed_for_another(world):
    server, tokens = world
    inflight = server.app[SERVICE].inflight
    async with aiohttp.ClientSession() as session:
        acme = [await session.ws_connect(f"{server.url}/ws/classify/{BOTS['acme']}", headers={
            "Authorization": f"Bearer {tokens['acme']}"}) for _ in range(2)]  # the budget
        assert inflight.held("acme") == 2 * len(BODY)
        assert await _status(_post(session, server, tokens, "globex")) == (200, None)
        closed = await acme[-1].receive(timeout=10)
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == CLOSE_TRY_LATER
        assert json.loads(closed.extra)["code"] == "inflight_share"
        await acme[0].send_bytes(PNG)  # the older socket still answers
        assert (await acme[0].receive_json(timeout=30))["bot_id"] == BOTS["acme"]
        await acme[0].close()
    await until(lambda: inflight.used_bytes == 0, what="every byte given back")
