"""Decoding a hostile tenant's huge images apart, end to end: a real server (`--auth keys`, two
tenants, one ordinary decode thread) where acme's request of four 36-megapixel 16-bit PNGs
holds the heavy lane (its thread at the lowest CPU priority), and globex's one small JPEG,
sent after, is decoded and answered while acme's first PNG is still being decoded.

The order is read from a recording `preprocess` stand-in (the decode of acme's first PNG waits
until the test releases it; no timing decides anything)."""
from __future__ import annotations

import asyncio
import os
import threading

import aiohttp
import numpy as np
import pytest
from PIL import Image

import service.core.engine as engine_module
from backbone.spec import INPUT
from service.transports.http.app import SERVICE, create_app
from store import HeadStore
from tests.backbone.helpers import encode, png_header
from tests.support.builders import random_head
from tests.support.fakes import FakeTrunk
from tests.support.polling import until
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0
BOTS = {"acme": "acme-bot", "globex": "globex-bot"}
# 36 megapixels of 16-bit gray each (234 tokens): headers only, the stand-in never decodes.
HUGE = [png_header(6000, 6000 + i, 16, 0) for i in range(4)]
JPEG = encode(Image.new("RGB", (64, 64), (20, 130, 60)), "JPEG")


class RecordingDecode:
    """`preprocess` stand-in: records each image it is given; the first of `HUGE` waits for
    `release`."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.order: list[bytes] = []
        self.threads: dict[bytes, tuple[str, int]] = {}  # image -> (thread name, its nice)
        self._lock = threading.Lock()

    def __call__(self, data: bytes, *, max_pixels: int) -> np.ndarray:
        with self._lock:
            self.order.append(bytes(data))
            self.threads[bytes(data)] = (threading.current_thread().name,
                                         os.getpriority(os.PRIO_PROCESS, 0))
        if bytes(data) == HUGE[0]:
            assert self.release.wait(WAIT_S), "the test never released the decode"
        return np.zeros(INPUT.shape, np.float32)


@pytest.fixture
def world(tmp_path, monkeypatch):
    decode = RecordingDecode()
    monkeypatch.setattr(engine_module, "preprocess", decode)
    store = HeadStore(tmp_path / "store")
    headers = {}
    for i, (tenant, bot) in enumerate(BOTS.items()):
        store.add_tenant(tenant)
        store.register(bot, *random_head(3, seed=i), tenant=tenant)
        _, token = store.add_key(tenant, "infer")
        headers[tenant] = {"Authorization": f"Bearer {token}"}
    settings = make_settings(tmp_path, auth="keys", preprocess_threads=1)
    server = ThreadedServer(create_app(settings, trunk=FakeTrunk(), store=store))
    yield server, headers, decode
    decode.release.set()
    server.close()
    store.close()


async def _classify(session, server, headers, tenant: str, images: list[bytes],
                    content_type: str) -> int:
    form = aiohttp.FormData()
    for i, data in enumerate(images):
        form.add_field("image", data, filename=f"{i}", content_type=content_type)
    async with session.post(f"{server.url}/classify/{BOTS[tenant]}", data=form,
                            headers=headers[tenant]) as resp:
        await resp.read()
        return resp.status


async def test_a_small_jpeg_is_answered_while_another_tenants_huge_pngs_hold_the_heavy_lane(
        world):
    server, headers, decode = world
    pool = server.app[SERVICE].engine.decode_pool
    async with aiohttp.ClientSession() as session:
        acme = asyncio.ensure_future(
            _classify(session, server, headers, "acme", HUGE, "image/png"))
        await until(lambda: decode.order == [HUGE[0]] and pool.queued == 3, timeout_s=WAIT_S)
        # acme's first PNG is still being decoded (held): globex's JPEG is answered anyway.
        assert await asyncio.wait_for(_classify(
            session, server, headers, "globex", [JPEG], "image/jpeg"), WAIT_S) == 200
        assert not acme.done()
        decode.release.set()
        assert await asyncio.wait_for(acme, WAIT_S) == 200
    assert decode.order == [HUGE[0], JPEG, *HUGE[1:]]
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the process's (its main thread's)
    assert decode.threads[JPEG] == ("multihead-decode_0", base)
    for png in HUGE:
        assert decode.threads[png] == ("multihead-decode_heavy_0", 19)
