"""The HTTP service end to end: a real aiohttp server on loopback, the real trunk, a real store."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
from PIL import Image

from service.transports.http.app import SERVICE
from tests.backbone.helpers import encode
from tests.support.builders import random_head
from tests.support.fakes import GatedTrunk
from tests.support.polling import until
from tests.support.prometheus import metric
from tests.support.servers import BOTS


class CountingTrunk:
    """The real trunk, recording the batch size of every call."""

    def __init__(self, trunk):
        self._trunk = trunk
        self.batch_sizes: list[int] = []
        self.checkpoint_prefix = trunk.checkpoint_prefix
        self.device = trunk.device

    def features(self, images):
        self.batch_sizes.append(len(images))
        return self._trunk.features(images)

pytestmark = pytest.mark.timeout(300)


def expected(store, bot_id, features, k):
    head = store.get(bot_id)
    return [(label, score) for label, score in head.top_k(features[None], k)[0]]


def assert_predictions(body_result, want):
    got = [(p["label"], p["score"]) for p in body_result["predictions"]]
    assert [g[0] for g in got] == [w[0] for w in want]
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], atol=1e-4)


def multipart(images):
    form = aiohttp.FormData()
    for i, data in enumerate(images):
        form.add_field("image", data, filename=f"{i}.jpg", content_type="image/jpeg")
    return form


async def test_single_image(make_client, store, jpegs, features_of):
    client = await make_client()
    resp = await client.post("/classify/charlie?top_k=3", data=jpegs[0],
                             headers={"Content-Type": "image/jpeg"})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["bot_id"] == "charlie" and body["version"] == 1 and len(body["results"]) == 1
    assert_predictions(body["results"][0], expected(store, "charlie", features_of[jpegs[0]], 3))


async def test_several_images_keep_upload_order(make_client, store, jpegs, features_of):
    client = await make_client()
    resp = await client.post("/classify/delta", data=multipart(jpegs[:3]))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert len(body["results"]) == 3
    for result, jpeg in zip(body["results"], jpegs[:3]):
        assert_predictions(result, expected(store, "delta", features_of[jpeg], 5))


async def test_several_bots_in_one_request(make_client, store, jpegs, features_of):
    client = await make_client()
    resp = await client.post("/classify?bots=alpha,echo&top_k=2", data=multipart(jpegs[1:3]))
    assert resp.status == 200, await resp.text()
    results = (await resp.json())["results"]
    assert set(results) == {"alpha", "echo"}
    for bot_id in ("alpha", "echo"):
        for result, jpeg in zip(results[bot_id]["results"], jpegs[1:3]):
            assert_predictions(result, expected(store, bot_id, features_of[jpeg], 2))


async def test_top_k_is_capped_at_the_class_count(make_client):
    client = await make_client()
    resp = await client.post("/classify/alpha?top_k=50", data=multipart([_png((1, 2, 3))]))
    body = await resp.json()
    assert resp.status == 200 and len(body["results"][0]["predictions"]) == BOTS["alpha"]
    scores = [p["score"] for p in body["results"][0]["predictions"]]
    assert scores == sorted(scores, reverse=True) and abs(sum(scores) - 1) < 1e-5


async def test_websocket_answers_in_order(make_client, trunk, store, jpegs, features_of):
    """A slow image (its trunk call held at a gate) then a fast one (cached features): the fast
    one's answer must not overtake the slow one's; replies come one per image, in order."""
    gated = GatedTrunk(trunk)
    gated.gate.set()
    client = await make_client(trunk_obj=gated)
    warm = await client.post("/classify/bravo", data=jpegs[1],
                             headers={"Content-Type": "image/jpeg"})  # caches jpegs[1]
    assert warm.status == 200
    gated.gate.clear()
    gated.entered.clear()
    async with client.ws_connect("/ws/classify/bravo?top_k=2") as ws:
        await ws.send_bytes(jpegs[0])  # a cache miss: waits at the gate
        while not gated.entered.is_set():
            await asyncio.sleep(0.01)
        await ws.send_bytes(jpegs[1])  # a cache hit: could be answered at once
        with pytest.raises(asyncio.TimeoutError):
            await ws.receive_json(timeout=0.5)  # nothing may arrive before the first answer
        gated.gate.set()
        replies = [await ws.receive_json(timeout=60) for _ in range(2)]
    for reply, jpeg in zip(replies, jpegs[:2]):
        assert_predictions(reply["results"][0], expected(store, "bravo", features_of[jpeg], 2))


async def test_websocket_errors_keep_the_socket_open(make_client, store, jpegs, features_of):
    client = await make_client()
    async with client.ws_connect("/ws/classify/bravo?top_k=1") as ws:
        await ws.send_str("not an image")
        assert await ws.receive_json(timeout=60) == {
            "error": "send each image as one binary message", "code": "bad_request",
            "status": 400}
        await ws.send_bytes(b"\xff\xd8\xff\xe0 truncated")
        bad = await ws.receive_json(timeout=60)
        assert (bad["status"], bad["code"]) == (400, "invalid_image")
        await ws.send_bytes(jpegs[2])
        reply = await ws.receive_json(timeout=60)
    assert_predictions(reply["results"][0], expected(store, "bravo", features_of[jpegs[2]], 1))


async def test_a_websocket_deadline_counts_for_each_message_from_its_arrival(
        make_client, jpegs):
    """The upgrade's X-Multihead-Deadline-Ms is each message's deadline, from the message's
    arrival: a socket opened with 3 s answers a message sent 3.5 s after the upgrade (no
    deadline for the socket's life); one of 0.001 ms answers each message 504
    deadline_exceeded and stays open; a malformed one is refused before the upgrade."""
    client = await make_client()
    headers = {"X-Multihead-Deadline-Ms": "3000"}
    async with client.ws_connect("/ws/classify/bravo?top_k=1", headers=headers) as ws:
        await asyncio.sleep(3.5)
        await ws.send_bytes(jpegs[3])
        assert "results" in await ws.receive_json(timeout=60)
    async with client.ws_connect("/ws/classify/bravo?top_k=1",
                                 headers={"X-Multihead-Deadline-Ms": "0.001"}) as ws:
        for jpeg in jpegs[4:6]:
            await ws.send_bytes(jpeg)
            reply = await ws.receive_json(timeout=60)
            assert (reply["status"], reply["code"]) == (504, "deadline_exceeded"), reply
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await client.ws_connect("/ws/classify/bravo",
                                headers={"X-Multihead-Deadline-Ms": "later"})
    assert info.value.status == 400


async def test_websocket_to_an_unknown_bot_is_a_json_404_before_the_upgrade(make_client):
    client = await make_client()
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await client.ws_connect("/ws/classify/nobody")
    assert info.value.status == 404
    resp = await client.get("/ws/classify/nobody")
    assert resp.status == 404 and (await resp.json())["code"] == "unknown_bot"


async def test_concurrent_requests_over_many_bots_equal_single_requests(
        make_client, trunk, store, jpegs, features_of):
    """40 concurrent requests over 5 bots share trunk batches; mixing bots changes nothing.

    The trunk is counted: ONE trunk call per batch, however many bots the batch holds."""
    counting = CountingTrunk(trunk)
    # NOTE: a deadline far beyond the 5 batches of 8 these 40 requests make, so that a slow
    # or busy machine only makes the test slower (the subject is batching, not deadlines).
    client = await make_client(trunk_obj=counting, feature_cache_size=0, max_batch_size=8,
                               max_wait_ms=50.0, request_timeout_s=300.0)
    # NOTE: bots interleaved: rows arrive in about this order, so any batch of two or more
    # consecutive rows mixes bots (grouped by bot, a batch of 8 could hold one bot only).
    jobs = [(bot_id, jpeg) for jpeg in jpegs for bot_id in BOTS]

    async def one(bot_id, jpeg):
        resp = await client.post(f"/classify/{bot_id}?top_k=2", data=jpeg,
                                 headers={"Content-Type": "image/jpeg"})
        assert resp.status == 200, await resp.text()
        return await resp.json()

    bodies = await asyncio.gather(*(one(b, j) for b, j in jobs))
    for (bot_id, jpeg), body in zip(jobs, bodies):
        assert body["bot_id"] == bot_id
        assert_predictions(body["results"][0], expected(store, bot_id, features_of[jpeg], 2))
    metrics = await (await client.get("/metrics")).text()
    bots_sum = metric(metrics, "multihead_batch_bots_sum")
    batches = metric(metrics, "multihead_batch_bots_count")
    rows = metric(metrics, "multihead_batch_size_sum")
    assert rows == len(jobs)  # every request went through the trunk (no cache)
    assert batches < len(jobs) and bots_sum > batches  # batched, and batches mixed bots
    assert len(counting.batch_sizes) == batches  # one trunk call per (mixed) batch
    assert sum(counting.batch_sizes) == len(jobs) and max(counting.batch_sizes) > 1


def _png(colour, size=(64, 64)):
    return encode(Image.new("RGB", size, colour))


async def test_bots_change_while_requests_run(make_client, store, jpegs):
    """Register, replace, remove and re-register a bot while clients keep classifying with it:
    no 500s; every answer comes from a version registered before it arrived and has that
    version's class count; a 404 only for a request in flight while the bot was removed.
    Each step waits for answers, not for time, so a slow machine only makes it slower."""
    client = await make_client(max_wait_ms=5.0)
    loop = asyncio.get_running_loop()
    n_classes, registered_at, removed = {}, {}, []
    answers, not_found = [], []
    stop = asyncio.Event()

    async def register(seed, n):
        start = time.monotonic()  # the version cannot be served before the call starts
        version = await loop.run_in_executor(
            None, lambda: store.register("live", *random_head(n, seed=seed)))
        n_classes[version], registered_at[version] = n, start

    async def load(jpeg):
        while not stop.is_set():
            sent = time.monotonic()
            resp = await client.post("/classify/live?top_k=50", data=jpeg,
                                     headers={"Content-Type": "image/jpeg"})
            body = await resp.json()
            received = time.monotonic()
            if resp.status == 200:
                answers.append((body["version"], len(body["results"][0]["predictions"]),
                                received))
            else:
                assert (resp.status, body["code"]) == (404, "unknown_bot"), body
                not_found.append((sent, received))

    async def admin():
        for i in range(4):  # replace it four times, each after two answers of the last one
            seen = len(answers)
            await until(lambda seen=seen: len(answers) >= seen + 2)
            await register(51 + i, 4 + i)
        seen = len(answers)
        await until(lambda: len(answers) >= seen + 2)
        start = time.monotonic()
        await loop.run_in_executor(None, store.remove, "live")
        await until(lambda: len(not_found) >= 1)
        await register(60, 3)
        removed.append((start, time.monotonic()))
        seen = len(answers)
        await until(lambda: len(answers) >= seen + 2)
        stop.set()

    await register(50, 3)
    await asyncio.gather(admin(), *(load(j) for j in jpegs[:3]))
    for version, n, answered in answers:
        assert registered_at[version] <= answered, (version, answered)
        assert n == n_classes[version], (version, n)
    (gone, back), = removed
    for sent, received in not_found:
        assert received >= gone and sent <= back, (sent, received, gone, back)
    assert len({v for v, _, _ in answers}) >= 5  # the replacements were served


@pytest.mark.parametrize("path,kwargs,status,code", [
    ("/classify/alpha", dict(data=b"\xff\xd8\xff\xe0 truncated", headers={"Content-Type": "image/jpeg"}), 400, "invalid_image"),
    ("/classify/alpha", dict(data=b"hello", headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type"),
    ("/classify/nobody", dict(data=b"x", headers={"Content-Type": "image/png"}), 404, "unknown_bot"),
    ("/classify/bad%20id", dict(data=b"x", headers={"Content-Type": "image/png"}), 400, "invalid_bot_id"),
    ("/classify/alpha?top_k=0", dict(data=b"x", headers={"Content-Type": "image/png"}), 400, "bad_request"),
    ("/classify/alpha?top_k=two", dict(data=b"x", headers={"Content-Type": "image/png"}), 400, "bad_request"),
    ("/classify", dict(data=b"x", headers={"Content-Type": "image/png"}), 400, "bad_request"),
    ("/classify/alpha", dict(data=b"x" * 5000, headers={"Content-Type": "image/png"}), 413, "payload_too_large"),
])
async def test_errors_are_json_with_their_status(make_client, path, kwargs, status, code):
    client = await make_client(max_body_bytes=4096)
    resp = await client.post(path, **kwargs)
    body = await resp.json()
    assert resp.status == status, body
    assert body["code"] == code and body["error"]


async def test_pixel_bomb_is_413(make_client):
    client = await make_client()
    bomb = encode(Image.new("1", (12_000, 12_000)))
    resp = await client.post("/classify/alpha", data=bomb, headers={"Content-Type": "image/png"})
    assert resp.status == 413 and (await resp.json())["code"] == "image_too_large"


async def test_unknown_route_is_json_404(make_client):
    client = await make_client()
    resp = await client.get("/no/such/route")
    assert resp.status == 404 and (await resp.json())["code"] == "not_found"


async def test_readiness_before_and_after_warmup(make_client, trunk):
    gated = GatedTrunk(trunk)
    client = await make_client(trunk_obj=gated, wait_ready=False, warmup=True, max_batch_size=2)
    assert (await client.get("/healthz")).status == 200
    resp = await client.get("/readyz")
    assert resp.status == 503 and (await resp.json())["status"] == "loading"
    early = await client.post("/classify/alpha", data=_png((9, 9, 9)),
                              headers={"Content-Type": "image/png"})
    assert early.status == 503 and (await early.json())["code"] == "not_ready"
    assert "Retry-After" in early.headers
    gated.gate.set()
    for _ in range(500):
        if (await client.get("/readyz")).status == 200:
            break
        await asyncio.sleep(0.02)
    body = await (await client.get("/readyz")).json()
    assert body["status"] == "ready" and body["trunk"]["device"] == trunk.device


async def test_overload_is_503_and_queued_requests_survive(make_client, trunk):
    gated = GatedTrunk(trunk)
    gated.gate.set()
    client = await make_client(trunk_obj=gated, max_queue_rows=3, max_batch_size=1,
                               max_wait_ms=0.0, feature_cache_size=0,
                               max_images_per_request=1)
    gated.gate.clear()
    gated.entered.clear()
    images = [_png((i * 40, 10, 200 - i * 40)) for i in range(5)]

    def post(data):
        return asyncio.ensure_future(client.post("/classify/alpha", data=data,
                                                 headers={"Content-Type": "image/png"}))

    running = post(images[0])  # occupies the trunk thread
    while not gated.entered.is_set():
        await asyncio.sleep(0.01)
    queued = [post(img) for img in images[1:4]]  # fills the queue (3 rows)
    app = client.server.app
    while app[SERVICE].engine.batcher.queue_depth < 3:
        await asyncio.sleep(0.01)
    rejected = await client.post("/classify/alpha", data=images[4],
                                 headers={"Content-Type": "image/png"})
    assert rejected.status == 503
    assert (await rejected.json())["code"] == "overloaded" and int(rejected.headers["Retry-After"]) >= 1
    gated.gate.set()
    for resp in await asyncio.gather(running, *queued):
        assert resp.status == 200, await resp.text()


async def test_metrics_move(make_client, jpegs):
    """Two requests for one image: the first runs the trunk, the second is a cache hit that
    skips it; every counter moves by exactly what happened."""
    client = await make_client()
    before = await (await client.get("/metrics")).text()
    for _ in range(2):
        resp = await client.post("/classify/alpha", data=jpegs[5],
                                 headers={"Content-Type": "image/jpeg"})
        assert resp.status == 200
    after = await (await client.get("/metrics")).text()

    def moved(name):
        return metric(after, name) - metric(before, name)

    assert moved('multihead_requests_total{route="classify",status="200"}') == 2
    assert moved("multihead_feature_cache_hits_total") == 1
    assert moved("multihead_feature_cache_misses_total") == 1
    assert moved("multihead_trunk_seconds_count") == 1  # the hit never reached the trunk
    assert moved("multihead_batch_size_sum") == 1
    assert metric(after, "multihead_resident_heads") >= 1


async def test_too_many_images_is_413(make_client):
    client = await make_client(max_images_per_request=2)
    resp = await client.post("/classify/alpha", data=multipart([_png((i, i, i)) for i in range(3)]))
    assert resp.status == 413 and (await resp.json())["code"] == "payload_too_large"


async def test_corrupt_head_on_disk_is_500_and_other_bots_still_work(make_client, store, tmp_path):
    """A registered bot whose files were damaged after registration: a clear 500, no crash."""
    store.register("broken", *random_head(3, seed=90))
    version_dir = store.heads_dir / "broken" / "v1"
    for path in version_dir.iterdir():
        if ".data-" in path.name:
            path.write_bytes(b"\0" * path.stat().st_size)
    client = await make_client()
    resp = await client.post("/classify/broken", data=_png((5, 5, 5)),
                             headers={"Content-Type": "image/png"})
    body = await resp.json()
    assert resp.status == 500 and body["code"] == "head_unavailable" and "broken" in body["error"]
    ok = await client.post("/classify/alpha", data=_png((5, 5, 5)),
                           headers={"Content-Type": "image/png"})
    assert ok.status == 200
