"""Per-tenant storage limits on a real server (`--auth keys`, the auth matrix's world: tenants
`acme` and `globex`), issue 34 item 4: acme reaches each of its limits (set by the operator over
`PATCH /tenants/acme`, shown by `GET /tenants`) and gets a clear refusal (JSON body, never a
5xx) while globex registers fine; the operator registering into acme is held to acme's limits.
"""
from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest

from service.transports.http.app import SERVICE, create_app
from tests.backbone.helpers import encode, pattern
from tests.service.codecs.test_auth import OPERATOR_TOKEN, OTHER, OTHER_BOT, OWN, World
from tests.support.heads import stored_entries
from tests.support.polling import until
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(300)
OK = (200, 201)  # a new version of a live bot, a new bot


@pytest.fixture(scope="module")
def world(tmp_path_factory, trunk):
    w = World(tmp_path_factory.mktemp("limits"))
    # Serve defaults of no bound (but versions, kept by the default of 20) for what the tests
    # do not set; acme's own limits are set per test.
    settings = make_settings(w.tmp_path, auth="keys", admin_token=OPERATOR_TOKEN,
                             tenant_max_bots=None, tenant_max_head_bytes=None,
                             tenant_registrations_per_minute=None)
    w.server = ThreadedServer(create_app(settings, trunk=trunk, store=w.store))
    yield w
    w.server.close()
    w.store.close()


async def put_bot(world: World, credential: str, bot: str, query: str = "") -> tuple:
    upload, content_type = world.upload()
    async with aiohttp.ClientSession(headers=world.headers[credential]) as session:
        async with session.put(f"{world.server.url}/bots/{bot}{query}", data=upload,
                               headers={"Content-Type": content_type}) as resp:
            return resp.status, await resp.json(), dict(resp.headers)


async def set_limits(world: World, tenant: str, **limits) -> dict:
    async with aiohttp.ClientSession(headers=world.headers["operator"]) as session:
        async with session.patch(f"{world.server.url}/tenants/{tenant}", json=limits) as resp:
            assert resp.status == 200, await resp.text()
        async with session.get(f"{world.server.url}/tenants") as resp:
            return {t["name"]: t["limits"] for t in (await resp.json())["tenants"]}[tenant]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def test_max_bots_refuses_acme_a_new_bot_while_globex_registers(world):
    owned = len(world.store.list(tenant=OWN))
    shown = await set_limits(world, OWN, max_bots=owned + 1)
    assert shown["max_bots"] == owned + 1
    try:
        assert (await put_bot(world, "own_manage", new_id("acme")))[0] in OK
        status, body, _ = await put_bot(world, "own_manage", new_id("acme"))
        assert status == 403 and body == {
            "error": f"tenant limit max_bots={owned + 1} reached: tenant 'acme' owns "
                     f"{owned + 1} bot(s)", "code": "tenant_limit"}
        # The operator registering into acme: acme's limit holds.
        status, body, _ = await put_bot(world, "operator", new_id("acme"), f"?tenant={OWN}")
        assert status == 403 and body["code"] == "tenant_limit"
        for _ in range(2):
            assert (await put_bot(world, "other_manage", new_id("globex")))[0] in OK
    finally:
        await set_limits(world, OWN, max_bots=None)


async def test_max_versions_prunes_acme_oldest_versions(world):
    bot = world.fresh_bot(versions=1)
    shown = await set_limits(world, OWN, max_versions=2)
    assert shown["max_versions"] == 2
    try:
        for _ in range(3):
            assert (await put_bot(world, "own_manage", bot))[0] in OK
        info = world.store.info(bot)
        assert (info.version, info.versions) == (4, [3, 4])
        assert stored_entries(world.store.location, bot) == ["v3", "v4"]
        other = new_id("globex")
        for _ in range(3):  # globex keeps the serve default (20): nothing pruned
            assert (await put_bot(world, "other_manage", other))[0] in OK
        assert world.store.info(other).versions == [1, 2, 3]
    finally:
        await set_limits(world, OWN, max_versions=None)


async def test_max_head_bytes_refuses_acme_a_head_past_it(world):
    shown = await set_limits(world, OWN, max_head_bytes=1)
    assert shown["max_head_bytes"] == 1
    try:
        status, body, _ = await put_bot(world, "own_manage", new_id("acme"))
        assert status == 403 and body["code"] == "tenant_limit"
        assert body["error"].startswith("tenant limit max_head_bytes=1 reached: ")
        assert (await put_bot(world, "other_manage", new_id("globex")))[0] in OK
    finally:
        await set_limits(world, OWN, max_head_bytes=None)


async def test_registrations_per_minute_answers_429_with_retry_after(world):
    shown = await set_limits(world, OWN, registrations_per_minute=2)
    assert shown["registrations_per_minute"] == 2
    try:
        bot = new_id("acme")
        assert [(await put_bot(world, "own_manage", bot))[0] for _ in range(2)] == [201, 200]
        status, body, headers = await put_bot(world, "own_manage", bot)
        assert status == 429 and body["code"] == "registration_rate"
        assert "registrations_per_minute=2" in body["error"]
        assert 1 <= int(headers["Retry-After"]) <= 30
        # Whoever registers into acme: the operator too.
        status, body, _ = await put_bot(world, "operator", bot, f"?tenant={OWN}")
        assert status == 429 and body["code"] == "registration_rate"
        assert world.store.info(bot).version == 2
        for _ in range(3):
            assert (await put_bot(world, "other_manage", new_id(OTHER)))[0] in OK
    finally:
        await set_limits(world, OWN, registrations_per_minute=None)


async def head_only(world: World, credential: str, method: str, path: str, *,
                    length: int = 50_000,
                    content_type: str = "multipart/form-data; boundary=b") -> tuple[int, str]:
    """(status, code) of a request that declares a body of `length` bytes and never sends it:
    answered only by a refusal made before the body is read (else the body's rate limit ends
    it, 408)."""
    import json
    from urllib.parse import urlsplit

    url = urlsplit(str(world.server.url))
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    auth = world.headers[credential]["Authorization"]
    writer.write((f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n"
                  f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
                  ).encode())
    await writer.drain()
    try:
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)).decode("latin-1")
        length = next(int(h.split(":", 1)[1]) for h in head.split("\r\n")
                      if h.lower().startswith("content-length:"))
        body = json.loads(await reader.readexactly(length))
        if int(head.split(" ")[1]) != 408:  # refused unread: closed, the rest never read
            assert "connection: close" in head.lower(), head
            assert await asyncio.wait_for(reader.read(), 30) == b""
        return int(head.split(" ")[1]), body["code"]
    finally:
        writer.close()


async def test_an_empty_bucket_refuses_before_the_body_is_read(world):
    """A tenant whose bucket cannot hold one more (images of its quota, or registrations) is
    refused from the request's head: a flood of requests refused anyway costs the server their
    heads, not their bodies. Another tenant's requests are read as ever."""
    bot = world.fresh_bot(versions=1)
    await set_limits(world, OWN, registrations_per_minute=1, rate=0.001, burst=1)
    try:
        statuses = [(await put_bot(world, "own_manage", bot))[0] for _ in range(2)]
        assert statuses[-1] == 429  # the minute's one is spent (here or by an earlier test)
        refused = asyncio.ensure_future(head_only(world, "own_manage", "PUT", f"/bots/{bot}"))
        # Answered late (RefusalPacer: min(Retry-After, 1 s)), held meanwhile.
        pacer = world.server.app[SERVICE].pacer
        await until(lambda: pacer.held.get(OWN) == 1 or refused.done(), what="held")
        assert pacer.held.get(OWN) == 1
        assert await refused == (429, "registration_rate")
        async with aiohttp.ClientSession(headers=world.headers["own_infer"]) as session:
            form = aiohttp.FormData()
            form.add_field("image", encode(pattern(77, size=(64, 48)), "JPEG"),
                           filename="x.jpg", content_type="image/jpeg")
            async with session.post(f"{world.server.url}/classify/{bot}", data=form) as resp:
                assert resp.status == 200, await resp.text()  # the burst's one image
        for path in (f"/classify/{bot}", f"/v2/models/{bot}/infer"):
            assert await head_only(world, "own_infer", "POST", path) == (429, "rate_limited")
        # globex's bodies are still read (and, never sent whole, timed out: 408).
        assert (await head_only(world, "other_infer", "POST", f"/classify/{OTHER_BOT}"))[0] == 408
    finally:
        await set_limits(world, OWN, registrations_per_minute=None, rate=None, burst=None)


async def _empty_then(world: World, burst: int) -> object:
    """acme's bucket of `burst` images, full, that refills once a thousand seconds; the
    service's quotas."""
    quotas = world.server.app[SERVICE].tenancy.quotas
    await set_limits(world, OWN, rate=1000.0, burst=burst)
    await asyncio.sleep(0.01)
    assert quotas.tokens(OWN) == burst  # refilled
    await set_limits(world, OWN, rate=0.001, burst=burst)
    return quotas


async def test_an_upload_is_refused_from_its_head_when_its_length_costs_more_than_the_bucket(
        world):
    """A native upload's declared length says what it costs at least (its bytes / 640 x 480 x
    3 images): a bucket of 4 tokens refuses a declared 5 MB image (5.7 images' worth) or
    multipart body from its head, before a byte of it is read, where it used to pass the head
    on one token, be read whole and be refused after it; a 2 MB one passes the head (its
    body then never comes: 408). OIP's JSON says nothing of its cost by its length: 1."""
    bot = world.fresh_bot(versions=1)
    quotas = await _empty_then(world, burst=8)
    try:
        quotas.take(OWN, 4)
        for content_type in ("image/jpeg", "multipart/form-data; boundary=b"):
            assert await head_only(world, "own_infer", "POST", f"/classify/{bot}",
                                   length=5_000_000, content_type=content_type) == (
                429, "rate_limited")
            assert (await head_only(world, "own_infer", "POST", f"/classify?bots={bot}",
                                    length=5_000_000, content_type=content_type)) == (
                429, "rate_limited")
            assert (await head_only(world, "own_infer", "POST", f"/classify/{bot}",
                                    length=2_000_000, content_type=content_type))[0] == 408
        assert (await head_only(world, "own_infer", "POST", f"/v2/models/{bot}/infer",
                                length=5_000_000, content_type="application/json"))[0] == 408
        assert quotas.tokens(OWN) == pytest.approx(4, abs=0.1)  # refused or unread: untaken
    finally:
        await set_limits(world, OWN, rate=None, burst=None)


async def test_requests_whose_bodies_are_being_read_hold_their_place_in_the_bucket(world):
    """Two requests whose bodies are still arriving hold a bucket of two images: a third is
    refused from its head (429), where it used to pass the head (the bucket then still held
    two), have its body read, and be refused after it (a tenant's 30 concurrent clients made
    the server read gigabytes a second of bodies refused anyway)."""
    bot = world.fresh_bot(versions=1)
    quotas = await _empty_then(world, burst=2)
    try:
        slow = [asyncio.ensure_future(head_only(world, "own_infer", "POST", f"/classify/{bot}"))
                for _ in range(2)]
        await until(lambda: quotas.claimed(OWN) == 2, what="two bodies awaited")
        assert await head_only(world, "own_infer", "POST", f"/classify/{bot}") == (
            429, "rate_limited")
        assert [await s for s in slow] == [(408, "request_timeout")] * 2  # never sent
        assert quotas.claimed(OWN) == 0 and quotas.tokens(OWN) == pytest.approx(2, abs=0.01)
    finally:
        await set_limits(world, OWN, rate=None, burst=None)


async def test_the_rest_of_a_body_refused_before_it_was_read_is_not_read(world):
    """A request refused from its head has its answer sent, then its connection closed: the
    server does not read (and drop) the rest of its body, as aiohttp's lingering close did
    for up to 10 s (a tenant sending 10 MB bodies had every byte of them read)."""
    from urllib.parse import urlsplit

    bot = world.fresh_bot(versions=1)
    quotas = await _empty_then(world, burst=1)
    quotas.take(OWN, 1)
    length = world.server.app[SERVICE].settings.max_body_bytes
    url = urlsplit(str(world.server.url))
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    sent = 0

    async def send() -> None:
        nonlocal sent
        auth = world.headers["own_infer"]["Authorization"]
        writer.write((f"POST /classify/{bot} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n"
                      f"Content-Type: image/jpeg\r\nContent-Length: {length}\r\n\r\n").encode())
        chunk = b"\0" * 65536
        while sent < length:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)

    try:
        sending = asyncio.ensure_future(send())
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).decode("latin-1")
        assert head.startswith("HTTP/1.1 429"), head
        done, _ = await asyncio.wait([sending], timeout=30)
        assert done, "the server went on reading the body"
        assert isinstance(sending.exception(), ConnectionError), sending.exception()
        assert sent < length
    finally:
        writer.close()
        await set_limits(world, OWN, rate=None, burst=None)


async def test_a_deadline_is_read_only_once_the_caller_is_known(world):
    """A malformed X-Multihead-Deadline-Ms: 401 without a credential (the credential first,
    as every other refusal), 400 invalid_deadline with one."""
    bot = world.fresh_bot(versions=1)
    image = encode(pattern(78, size=(64, 48)), "JPEG")
    headers = {"Content-Type": "image/jpeg", "X-Multihead-Deadline-Ms": "soon"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{world.server.url}/classify/{bot}", data=image,
                                headers=headers) as resp:
            assert resp.status == 401, await resp.text()
    async with aiohttp.ClientSession(headers=world.headers["own_infer"]) as session:
        async with session.post(f"{world.server.url}/classify/{bot}", data=image,
                                headers=headers) as resp:
            assert resp.status == 400 and (await resp.json())["code"] == "invalid_deadline"


async def test_a_tenants_default_deadline_holds_its_requests_that_give_none(world):
    """`deadline_ms` (tenants set --deadline-ms, PATCH /tenants/{name}): the deadline of the
    tenant's requests without X-Multihead-Deadline-Ms, HTTP and each WebSocket message; a
    request's own header wins; another tenant's requests are not touched."""
    bot = world.fresh_bot(versions=1)
    image = encode(pattern(79, size=(64, 48)), "JPEG")
    jpeg = {"Content-Type": "image/jpeg"}
    url = f"{world.server.url}/classify/{bot}"
    assert (await set_limits(world, OWN, deadline_ms=0.001))["deadline_ms"] == 0.001
    try:
        async with aiohttp.ClientSession(headers=world.headers["own_infer"]) as session:
            async with session.post(url, data=image, headers=jpeg) as resp:
                body = await resp.json()
                assert resp.status == 504, body
                assert body["code"] in ("deadline_exceeded", "deadline_unmeetable")
            async with session.post(url, data=image, headers={
                    **jpeg, "X-Multihead-Deadline-Ms": "60000"}) as resp:
                assert resp.status == 200, await resp.text()
            async with session.ws_connect(f"{world.server.url}/ws/classify/{bot}") as ws:
                await ws.send_bytes(image)
                reply = await ws.receive_json(timeout=60)
                assert (reply["status"], reply["code"]) == (504, "deadline_exceeded"), reply
        async with aiohttp.ClientSession(headers=world.headers["other_infer"]) as session:
            async with session.post(f"{world.server.url}/classify/{OTHER_BOT}", data=image,
                                    headers=jpeg) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        assert (await set_limits(world, OWN, deadline_ms=None))["deadline_ms"] is None
    async with aiohttp.ClientSession(headers=world.headers["own_infer"]) as session:
        async with session.post(url, data=image, headers=jpeg) as resp:
            assert resp.status == 200, await resp.text()
