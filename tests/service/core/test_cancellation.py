"""Cancellation: a client that goes away takes its queued rows with it, on every transport.

Each test holds the real trunk at a gate with one request's row in it, queues 16 single-image
requests from 16 clients behind it, makes 8 of those clients go away (an HTTP client closes its
connection; a gRPC call's deadline passes or the client cancels it), waits until the server has
withdrawn their rows (the queue depth drops to 8), then opens the gate: the trunk runs the
blocker's row and exactly the other 8, and their clients get their answers. Nothing here waits
for time except for the server to notice a disconnect, which is polled. With
`cancel_on_disconnect` off, the same 8 HTTP clients leave and the trunk runs their rows all the
same.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.utils import InferenceServerException

from service.transports.http import app as http_app
from service.transports.http.app import LISTENERS, SERVICE
from tests.backbone.helpers import encode, pattern
from tests.support.fakes import GatedTrunk
from tests.support.polling import until
from tests.support.prometheus import metric

pytestmark = pytest.mark.timeout(120)

BOT = "charlie"
CLIENTS, LEAVING = 16, 8


@pytest.fixture(scope="module")
def images():
    """17 distinct small PNGs (no feature-cache hit among them): the blocker's, then 16."""
    return [encode(pattern(300 + i, size=(64, 48)), "PNG") for i in range(CLIENTS + 1)]


async def blocked(make_client, trunk, images, **overrides):
    """A server around the gated real trunk, the trunk busy with the blocker's row (a first
    HTTP request, returned as a task): (test client, gated trunk, blocker task)."""
    gated = GatedTrunk(trunk)
    client = await make_client(trunk_obj=gated, max_batch_size=CLIENTS, **overrides)
    blocker = asyncio.create_task(client.post(f"/classify/{BOT}", data=images[0],
                                              headers={"Content-Type": "image/png"}))
    await until(gated.entered.is_set, what="the blocker's row in the trunk")
    return client, gated, blocker


async def finish(gated, blocker):
    """Opens the gate; the blocker gets its answer."""
    gated.gate.set()
    resp = await blocker
    assert resp.status == 200, await resp.text()


async def test_http_clients_that_disconnect_leave_the_queue(make_client, trunk, images, caplog):
    caplog.set_level(logging.WARNING)
    client, gated, blocker = await blocked(make_client, trunk, images)
    service = client.app[SERVICE]
    batcher = service.engine.batcher
    sessions = [aiohttp.ClientSession() for _ in range(CLIENTS)]  # one connection each
    url = client.make_url(f"/classify/{BOT}")
    try:
        posts = [asyncio.create_task(s.post(url, data=image, headers={"Content-Type": "image/png"}))
                 for s, image in zip(sessions, images[1:])]
        await until(lambda: batcher.queue_depth == CLIENTS, what="16 rows queued")
        for post, session in zip(posts[:LEAVING], sessions[:LEAVING]):
            post.cancel()
            await session.close()  # the client goes away: its connection closes
        await until(lambda: batcher.queue_depth == CLIENTS - LEAVING,
                    what=lambda: f"8 rows withdrawn (queue depth {batcher.queue_depth})")
        # The leavers' bodies are no longer held against the in-flight budget.
        assert service.inflight.used_bytes == sum(map(len, images[LEAVING + 1:] + images[:1]))
        await finish(gated, blocker)
        for post in posts[LEAVING:]:
            resp = await post
            body = await resp.json()
            assert resp.status == 200, body
            assert len(body["results"][0]["predictions"]) == 5
    finally:
        gated.gate.set()
        for session in sessions:
            await session.close()
    assert sum(gated.batches) == 1 + CLIENTS - LEAVING  # the blocker's row and the 8 that stayed
    assert all(post.cancelled() for post in posts[:LEAVING])
    assert service.inflight.used_bytes == 0
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, 'multihead_requests_total{route="classify",status="499"}') == LEAVING
    assert metric(metrics, 'multihead_requests_total{route="classify",status="200"}') == \
        1 + CLIENTS - LEAVING
    noise = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noise, [r.getMessage() for r in noise]  # a client leaving is no error


async def test_with_cancellation_off_the_rows_of_clients_that_left_still_run(make_client, trunk,
                                                                            images, caplog):
    """`--no-cancel-on-disconnect`: the 8 clients leave as above (the server sees their
    connections close), yet their rows stay queued and the trunk runs all 16; nothing is
    counted 499, every handler runs to its answer (a 200 nobody reads)."""
    caplog.set_level(logging.WARNING)
    client, gated, blocker = await blocked(make_client, trunk, images, cancel_on_disconnect=False)
    service = client.app[SERVICE]
    batcher = service.engine.batcher
    server = client.server.runner.server  # aiohttp's connection handling
    sessions = [aiohttp.ClientSession() for _ in range(CLIENTS)]
    url = client.make_url(f"/classify/{BOT}")
    try:
        posts = [asyncio.create_task(s.post(url, data=image, headers={"Content-Type": "image/png"}))
                 for s, image in zip(sessions, images[1:])]
        await until(lambda: batcher.queue_depth == CLIENTS, what="16 rows queued")
        connected = sum(h.connected for h in server.connections)
        for post, session in zip(posts[:LEAVING], sessions[:LEAVING]):
            post.cancel()
            await session.close()
        await until(lambda: sum(h.connected for h in server.connections) == connected - LEAVING,
                    what="the server sees 8 connections closed")
        await asyncio.sleep(0)  # what a cancellation would have done by now (one loop step)
        assert batcher.queue_depth == CLIENTS
        await finish(gated, blocker)
        for post in posts[LEAVING:]:
            resp = await post
            assert resp.status == 200, await resp.text()
        # The leavers' handlers run to their answers too (their 200s go nowhere).
        await until(lambda: service.inflight.used_bytes == 0,
                    what=lambda: f"every handler done ({service.inflight.used_bytes} B held)")
    finally:
        gated.gate.set()
        for session in sessions:
            await session.close()
    assert sum(gated.batches) == 1 + CLIENTS  # the leavers' 8 rows ran
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, 'multihead_requests_total{route="classify",status="499"}') == 0
    assert metric(metrics, 'multihead_requests_total{route="classify",status="200"}') == \
        1 + CLIENTS
    noise = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noise, [r.getMessage() for r in noise]


async def test_websocket_closed_while_its_image_waits(make_client, trunk, images):
    """A socket whose connection closes while its image waits for the trunk: the row leaves
    the queue and the socket's in-flight bytes are given back."""
    client, gated, blocker = await blocked(make_client, trunk, images)
    service = client.app[SERVICE]
    batcher = service.engine.batcher
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(client.make_url(f"/ws/classify/{BOT}"))
        await ws.send_bytes(images[1])
        await until(lambda: batcher.queue_depth == 1, what="the socket's row queued")
    # the session closed the connection without a close handshake
    try:
        await until(lambda: batcher.queue_depth == 0, what="the socket's row withdrawn")
        await until(lambda: service.inflight.used_bytes == len(images[0]),
                    what="the socket's bytes given back")
        await finish(gated, blocker)
    finally:
        gated.gate.set()
    assert sum(gated.batches) == 1
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, 'multihead_requests_total{route="classify_ws",status="499"}') == 1


def infer_input(image: bytes) -> triton.InferInput:
    inp = triton.InferInput("image_bytes", [1], "BYTES")
    inp.set_data_from_numpy(np.array([image], dtype=object))
    return inp


@pytest.mark.parametrize("leave", ["deadline", "cancel"])
async def test_grpc_calls_that_end_leave_the_queue(make_client, trunk, images, leave):
    """8 of 16 KServe ModelInfer calls end while queued: their deadline passes (the client
    gets DEADLINE_EXCEEDED) or the client cancels them."""
    client, gated, blocker = await blocked(make_client, trunk, images, grpc_port=0)
    server = client.app[LISTENERS][0]
    await asyncio.wait_for(server.wait_started(), 60)
    batcher = client.app[SERVICE].engine.batcher
    clients = [triton_aio.InferenceServerClient(f"127.0.0.1:{server.port}")
               for _ in range(CLIENTS)]
    try:
        staying = [asyncio.create_task(c.infer(BOT, [infer_input(image)]))
                   for c, image in zip(clients[LEAVING:], images[LEAVING + 1:])]
        await until(lambda: batcher.queue_depth == CLIENTS - LEAVING, what="8 rows queued")
        timeout = 1 if leave == "deadline" else None
        leaving = [asyncio.create_task(c.infer(BOT, [infer_input(image)], client_timeout=timeout))
                   for c, image in zip(clients[:LEAVING], images[1:LEAVING + 1])]
        if leave == "deadline":
            for call in leaving:
                with pytest.raises(InferenceServerException) as info:
                    await call
                assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED", info.value
        else:
            await until(lambda: batcher.queue_depth == CLIENTS, what="16 rows queued")
            for call in leaving:
                call.cancel()
        await until(lambda: batcher.queue_depth == CLIENTS - LEAVING,
                    what=lambda: f"8 rows withdrawn (queue depth {batcher.queue_depth})")
        await finish(gated, blocker)
        for call in staying:
            result = await call
            assert result.as_numpy("probabilities").shape[-1] == 5
    finally:
        gated.gate.set()
        for c in clients:
            await c.close()
    assert sum(gated.batches) == 1 + CLIENTS - LEAVING
    metrics = await (await client.get("/metrics")).text()
    closed = metric(metrics, 'multihead_requests_total{route="oip_infer",status="499"}')
    passed = metric(metrics, 'multihead_requests_total{route="oip_infer",status="504"}')
    # NOTE: a deadline's cancellation may reach the server while it still counts a little time
    # left (the client's timer started first): counted as the client's cancel then.
    assert closed + passed == LEAVING and (leave == "deadline" or closed == LEAVING)
    assert metric(metrics, 'multihead_requests_total{route="oip_infer",status="200"}') == \
        CLIENTS - LEAVING
    assert client.app[SERVICE].inflight.used_bytes == 0


@pytest.mark.parametrize("cancel", [True, False])
def test_the_served_app_cancels_handlers_of_clients_that_left(monkeypatch, cancel):
    """`run_app` (what `multihead serve` runs) makes aiohttp cancel a handler whose client
    disconnected, as the servers of the tests above do (aiohttp's default does not), unless
    `--no-cancel-on-disconnect`."""
    import types

    seen = {}
    service = types.SimpleNamespace(freeze_gc_when_ready=False)
    monkeypatch.setattr(http_app.web, "run_app", lambda app, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(http_app, "create_app",
                        lambda settings, listeners: {http_app.SERVICE: service})
    http_app.run_app(http_app.Settings(warmup=False, auth="none", cancel_on_disconnect=cancel))
    assert seen["handler_cancellation"] is cancel
    assert seen["lingering_time"] == 0  # a body refused unread is not read after its answer
    assert service.freeze_gc_when_ready  # the process's one service: gc.freeze once ready
