"""Hardening: admission before work, and the correctness risks found by reading the service as
an attacker would. Each test here failed on the code before its fix."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading

import aiohttp
import pytest
from PIL import Image

from bench.prometheus import value
from service.core.batcher import Batcher
from service.core.lifecycle import READY
from service.core.service import Service
from service.transports.http.app import SERVICE
from tests.backbone.helpers import encode
from tests.support.fakes import GatedTrunk
from tests.support.polling import until
from tests.support.prometheus import metric
from tests.support.servers import make_settings

pytestmark = pytest.mark.timeout(300)
PNG = {"Content-Type": "image/png"}


def _png(colour, size=(64, 64)) -> bytes:
    return encode(Image.new("RGB", size, colour))


# -- admission by bytes, before the body is read ------------------------------------------------

async def _slow_body(first: bytes, gate: asyncio.Event, rest: bytes):
    yield first
    await gate.wait()
    yield rest


async def test_a_body_that_does_not_fit_the_budget_is_refused_before_it_is_read(make_client):
    client = await make_client(max_inflight_bytes=300_000, max_body_bytes=200_000,
                               max_ws_message_bytes=100_000)
    gate = asyncio.Event()
    body = _png((1, 2, 3)) + b"\0" * 150_000  # a PNG with trailing bytes decodes fine
    half = len(body) // 2
    # The first upload declares its length and stops half-way: it holds its bytes.
    holder = asyncio.ensure_future(client.post(
        "/classify/alpha", data=_slow_body(body[:half], gate, body[half:]),
        headers={**PNG, "Content-Length": str(len(body))}))
    service = client.server.app[SERVICE]
    await until(lambda: service.inflight.used_bytes >= len(body), what="the first upload held")
    # The second one cannot fit: refused with the JSON error while the first is still open.
    refused = await client.post("/classify/alpha", data=body, headers=PNG)
    assert refused.status == 503, await refused.text()
    assert (await refused.json())["code"] == "overloaded"
    assert int(refused.headers["Retry-After"]) >= 1
    gate.set()
    assert (await holder).status == 200
    assert service.inflight.used_bytes == 0  # everything given back
    assert (await client.post("/classify/alpha", data=body, headers=PNG)).status == 200


async def test_a_declared_length_over_the_limit_is_413_and_a_chunked_body_is_cut(make_client):
    client = await make_client(max_body_bytes=10_000)
    big = b"\0" * 20_000
    resp = await client.post("/classify/alpha", data=big, headers=PNG)
    assert resp.status == 413 and (await resp.json())["code"] == "payload_too_large"

    async def chunked():
        for _ in range(20):
            yield b"\0" * 1_000

    resp = await client.post("/classify/alpha", data=chunked(), headers=PNG)
    assert resp.status == 413 and (await resp.json())["code"] == "payload_too_large"
    assert client.server.app[SERVICE].inflight.used_bytes == 0


async def test_concurrent_large_uploads_beyond_the_budget_are_refused_the_rest_answered(
        make_client, trunk):
    """A small version of the 300 x 10 MB overload: admitted uploads hold their bytes until
    answered (the trunk is gated), the excess gets 503 before being read."""
    gated = GatedTrunk(trunk)
    gated.gate.set()
    upload = _png((9, 99, 199)) + b"\0" * 1_000_000  # 1 MB each
    client = await make_client(trunk_obj=gated, max_inflight_bytes=3_500_000,
                               max_body_bytes=1_100_000, max_ws_message_bytes=1_000_000,
                               feature_cache_size=0)
    gated.gate.clear()
    posts = [asyncio.ensure_future(client.post("/classify/bravo", data=upload, headers=PNG))
             for _ in range(8)]
    service = client.server.app[SERVICE]
    # Three admitted (held in the trunk's gate), the five others refused.
    await until(lambda: sum(p.done() for p in posts) == 5, what="five uploads refused")
    assert service.inflight.used_bytes == 3 * len(upload)
    gated.gate.set()
    responses = await asyncio.gather(*posts)
    statuses = sorted(r.status for r in responses)
    assert statuses == [200] * 3 + [503] * 5
    for r in responses:
        body = await r.json()
        if r.status == 200:
            assert body["bot_id"] == "bravo" and len(body["results"][0]["predictions"]) == 3
        else:
            assert body["code"] == "overloaded" and "Retry-After" in r.headers
    assert service.inflight.used_bytes == 0


async def test_each_open_websocket_holds_its_message_size_of_the_budget(make_client):
    client = await make_client(max_inflight_bytes=2_000_000, max_ws_message_bytes=1_000_000,
                               max_body_bytes=1_000_000)
    first = await client.ws_connect("/ws/classify/alpha")
    second = await client.ws_connect("/ws/classify/alpha")
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect("/ws/classify/alpha")
    assert refused.value.status == 503
    await first.send_bytes(_png((3, 3, 3)))
    assert (await first.receive_json())["bot_id"] == "alpha"
    await first.close()
    await second.close()
    service = client.server.app[SERVICE]
    await until(lambda: service.inflight.used_bytes == 0, 2, what="every byte given back")


async def test_a_websocket_message_over_its_limit_closes_with_1009(make_client):
    client = await make_client(max_ws_message_bytes=50_000)
    async with client.ws_connect("/ws/classify/alpha") as ws:
        await ws.send_bytes(b"\0" * 60_000)
        message = await ws.receive()
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1009


# -- the queue refuses before decoding ------------------------------------------------------------

async def test_a_full_queue_refuses_before_decoding(make_client, trunk, monkeypatch):
    import service.core.engine as engine_module

    decoded = []
    real = engine_module.preprocess

    def counting(data, **kwargs):
        decoded.append(data)
        return real(data, **kwargs)

    monkeypatch.setattr(engine_module, "preprocess", counting)
    gated = GatedTrunk(trunk)
    gated.gate.set()
    client = await make_client(trunk_obj=gated, max_queue_rows=2, max_batch_size=1,
                               max_wait_ms=0.0, feature_cache_size=0, max_images_per_request=2)
    gated.gate.clear()
    gated.entered.clear()
    running = asyncio.ensure_future(client.post("/classify/alpha", data=_png((1, 1, 1)),
                                                headers=PNG))
    await until(gated.entered.is_set, what="the first request in the trunk")
    queued = [asyncio.ensure_future(client.post("/classify/alpha", data=_png((2, i, 2)),
                                                headers=PNG)) for i in range(2)]
    await until(lambda: client.server.app[SERVICE].engine.batcher.queue_depth >= 2,
                what="two requests queued")
    before = len(decoded)
    refused = await client.post("/classify/alpha", data=_png((4, 4, 4)), headers=PNG)
    assert refused.status == 503 and (await refused.json())["code"] == "overloaded"
    assert len(decoded) == before  # refused before its image was decoded
    gated.gate.set()
    assert [r.status for r in await asyncio.gather(running, *queued)] == [200] * 3


# -- nothing blocks the event loop ------------------------------------------------------------

async def test_heads_of_a_fully_cached_request_run_off_the_event_loop(make_client, monkeypatch):
    import service.core.engine as engine_module

    threads = []
    real = engine_module.score

    def recording(features, items, *more):
        threads.append(threading.current_thread())
        return real(features, items, *more)

    monkeypatch.setattr(engine_module, "score", recording)
    client = await make_client()
    image = _png((7, 70, 170))
    for _ in range(2):  # the second request is answered from the feature cache
        assert (await client.post("/classify/alpha", data=image, headers=PNG)).status == 200
    assert len(threads) == 2
    assert threading.main_thread() not in threads


async def test_head_lookups_never_wait_behind_the_default_executor(store, tmp_path):
    service = Service(make_settings(tmp_path), store=store, trunk=object())
    service.readiness.status = READY  # a head is looked up for a request only once ready
    loop = asyncio.get_running_loop()
    release = threading.Event()
    blockers = [loop.run_in_executor(None, release.wait, 30) for _ in range(40)]
    try:
        (head,) = await asyncio.wait_for(service.bots.heads(["alpha"]), timeout=10)
        info = await asyncio.wait_for(service.bots.info("bravo"), timeout=10)
        assert (head.bot_id, info.bot_id) == ("alpha", "bravo")
    finally:
        release.set()
        await asyncio.gather(*blockers)
        await service.close()


async def test_engine_close_waits_for_decoding_without_blocking_the_loop(make_client):
    client = await make_client()
    engine = client.server.app[SERVICE].engine
    loop = asyncio.get_running_loop()
    finished = threading.Event()
    busy = loop.run_in_executor(engine.decode_pool, finished.wait, 3)
    closed = []
    seen_by_ticker = []

    async def ticker():
        await asyncio.sleep(0.05)
        seen_by_ticker.append(bool(closed))  # did close() finish before the loop ran again?
        finished.set()  # lets the decode job, and so close(), finish

    tick = asyncio.ensure_future(ticker())
    await engine.close()
    closed.append(True)
    await busy
    await tick
    assert seen_by_ticker == [False]


# -- one exception instance per waiting request -------------------------------------------------

async def test_a_failed_batch_gives_each_request_its_own_exception():
    def run_batch(rows):
        raise RuntimeError("trunk exploded")

    batcher = Batcher(run_batch, max_batch_size=4, max_wait_ms=50, max_queue_rows=8)
    results = await asyncio.gather(*(batcher.submit(i, group="g") for i in range(3)),
                                   return_exceptions=True)
    await batcher.close()
    assert all(isinstance(r, RuntimeError) and str(r) == "trunk exploded" for r in results)
    assert len({id(r) for r in results}) == 3


# -- logs keep their tracebacks; the latency histogram only has requests ------------------------

async def test_a_trunk_that_fails_to_load_is_logged_with_its_traceback(store, tmp_path, caplog):
    settings = make_settings(tmp_path, trunk_checkpoint=str(tmp_path / "missing.ckpt"))
    service = Service(settings, store=store)
    with caplog.at_level(logging.ERROR, logger="service.core.lifecycle"):
        await service.start()
        assert not await service.wait_ready()
    assert service.readiness.status == "failed" and "missing.ckpt" in service.readiness.error
    (record,) = [r for r in caplog.records if "trunk failed to load" in r.getMessage()]
    assert record.exc_info is not None
    await service.close()


class BrokenTrunk(GatedTrunk):
    def features(self, images):
        raise RuntimeError("/secret/path: kernel launch failed")


async def test_a_websocket_internal_error_is_logged_and_never_leaks(make_client, trunk,
                                                                    caplog):
    client = await make_client(trunk_obj=BrokenTrunk(trunk), feature_cache_size=0)
    with caplog.at_level(logging.ERROR):
        async with client.ws_connect("/ws/classify/alpha") as ws:
            await ws.send_bytes(_png((5, 6, 7)))
            reply = await ws.receive_json()
            assert reply == {"error": "internal server error", "code": "internal", "status": 500}
            await ws.send_str("not an image")  # the socket is still usable
            assert (await ws.receive_json())["code"] == "bad_request"
    assert any(r.exc_info and "kernel launch failed" in str(r.exc_info[1])
               for r in caplog.records)


async def test_a_websocket_lifetime_is_not_a_request_latency(make_client):
    client = await make_client()
    async with client.ws_connect("/ws/classify/alpha") as ws:
        await ws.send_bytes(_png((8, 8, 8)))
        await ws.receive_json()
    text = await (await client.get("/metrics")).text()
    route = 'route="classify_ws"'
    assert metric(text, f'multihead_requests_total{{{route},status="101"}}') == 1
    assert value(text, f"multihead_request_seconds_count{{{route}}}") is None


# -- serve never creates a trunk -------------------------------------------------------------

def test_serve_without_a_trunk_refuses_with_one_line(tmp_path):
    store = tmp_path / "empty-store"
    out = subprocess.run([sys.executable, "-m", "cli", "serve", "--store", str(store),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("multihead serve")]
    assert len(lines) == 1 and "multihead demo" in lines[0]
    assert not (store / "trunk").exists()  # nothing written


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_serve_refuses_a_precision_this_cpu_cannot_run(trunk_checkpoint, tmp_path, precision):
    from backbone.device import detect_device, maybe_has_gpu

    if maybe_has_gpu() or (precision == "bf16" and detect_device("cpu").bf16):
        pytest.skip(f"this machine can run {precision}")
    out = subprocess.run([sys.executable, "-m", "cli", "serve", "--store",
                          str(tmp_path / "store"), "--trunk-checkpoint", trunk_checkpoint,
                          "--precision", precision, "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("multihead serve")]
    assert len(lines) == 1 and f"precision '{precision}'" in lines[0], out.stderr
