"""Hot bots: `--pin` and `--preload` load heads before the service says ready.

Real servers on loopback around the session's real trunk and a real store. What is resident is
read from the store's cache statistics and the service's /metrics, never inferred from timing:
a head whose load is gated shows that readiness waits for it.
"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from bench.prometheus import by_labels
from service.core.lifecycle import PreloadError, check_pinned_bots, most_recent, preload_heads
from service.core.service import Service
from service.core.setting_fields import InvalidSettings
from service.core.settings import Settings
from service.transports.http.app import SERVICE, create_app
from store import HeadStore
from tests.support.builders import random_head
from tests.support.prometheus import metric
from tests.support.servers import BOTS

pytestmark = pytest.mark.timeout(180)

# A 100-class head takes about 0.6 MiB resident: one fits in a 1 MiB budget, two do not.
BIG_CLASSES = 100


class GatedStore(HeadStore):
    """The real store; `get` of a gated bot waits for `gate` (to see what waits for a load)."""

    def __init__(self, *args, gated=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.gated = set(gated)
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def get(self, bot_id):
        if bot_id in self.gated:
            self.waiting.set()
            assert self.gate.wait(60), "gate never opened"
        return super().get(bot_id)


def register_in_order(store: HeadStore, bots: dict[str, int]) -> None:
    """Registers `bots` oldest first, each at a later time than the one before."""
    for seed, (bot_id, n) in enumerate(bots.items()):
        store.register(bot_id, *random_head(n, seed=seed))
        time.sleep(0.005)  # registration times have millisecond resolution


def resident(store: HeadStore, bot_ids) -> dict[str, bool]:
    """Whether each bot's head is resident: a `get` that counts as a cache hit. Ask about the
    expected-resident ones first: a miss loads the head (and may evict another)."""
    out = {}
    for bot_id in bot_ids:
        before = store.cache_stats()["misses"]
        store.get(bot_id)
        out[bot_id] = store.cache_stats()["misses"] == before
    return out


async def start(aiohttp_client, settings: Settings, trunk, store=None, *, wait_ready=True):
    app = create_app(settings, trunk=trunk, store=store)
    client = await aiohttp_client(app)
    if wait_ready:
        await wait_until_ready(client)
    return client, app[SERVICE]


async def wait_until_ready(client) -> dict:
    for _ in range(1000):
        resp = await client.get("/readyz")
        body = await resp.json()
        if resp.status == 200 or body["status"] == "failed":
            return body
        await asyncio.sleep(0.01)
    raise AssertionError("never ready")


def settings_for(tmp_path, **overrides) -> Settings:
    values = dict(store=str(tmp_path / "store"), warmup=False, max_wait_ms=5.0, auth="none")
    values.update(overrides)
    return Settings(**values)


# -- ready means resident ------------------------------------------------------------------------

async def test_pinned_and_preloaded_heads_are_resident_before_ready(aiohttp_client, trunk,
                                                                    tmp_path, request):
    with HeadStore(tmp_path / "store") as setup:
        register_in_order(setup, BOTS)  # alpha oldest ... echo newest
    settings = settings_for(tmp_path, pin="bravo", preload=2)
    store = GatedStore(settings.store, pinned=settings.pinned_bots, gated={"bravo"})
    client, service = await start(aiohttp_client, settings, trunk, store, wait_ready=False)
    request.addfinalizer(store.close)
    assert await asyncio.to_thread(store.waiting.wait, 30)
    # The trunk is up, the pinned head is still loading: not ready.
    await asyncio.sleep(0.3)
    resp = await client.get("/readyz")
    assert resp.status == 503 and (await resp.json())["status"] == "loading"
    assert store.cache_stats()["resident_heads"] == 0
    store.gate.set()
    body = await wait_until_ready(client)
    assert body["status"] == "ready", body
    assert body["heads"] == {"pinned": ["bravo"], "preloaded": 2}
    assert "preload_s" in body["timings"] and body["timings"]["preload_s"] > 0.2

    stats = store.cache_stats()
    assert (stats["resident_heads"], stats["pinned_resident"]) == (3, 1)
    text = await (await client.get("/metrics")).text()
    assert metric(text, "multihead_resident_heads") == 3
    assert metric(text, "multihead_pinned_heads") == 1
    assert metric(text, "multihead_preloaded_heads") == 2
    assert metric(text, 'multihead_pinned_bot{bot="bravo"}') == 1
    store.gated.clear()
    # The two most recently registered besides the pinned one, and nothing else.
    assert resident(store, ["bravo", "echo", "delta", "charlie", "alpha"]) == {
        "bravo": True, "echo": True, "delta": True, "charlie": False, "alpha": False}
    assert service.lifecycle.preloaded.preloaded == ("echo", "delta")


async def test_without_pin_or_preload_no_head_is_loaded_before_ready(aiohttp_client, trunk,
                                                                   tmp_path):
    with HeadStore(tmp_path / "store") as setup:
        register_in_order(setup, BOTS)
    client, service = await start(aiohttp_client, settings_for(tmp_path), trunk)
    body = await (await client.get("/readyz")).json()
    assert body["heads"] == {"pinned": [], "preloaded": 0}
    assert service.store.cache_stats()["resident_heads"] == 0
    text = await (await client.get("/metrics")).text()
    assert metric(text, "multihead_pinned_heads") == 0
    assert by_labels(text, "multihead_pinned_bot") == {}


# -- memory pressure -------------------------------------------------------------------------------

async def test_a_pinned_head_survives_memory_pressure_that_evicts_others(aiohttp_client, trunk,
                                                                        tmp_path):
    bots = {"keep": BIG_CLASSES, "big-1": BIG_CLASSES, "big-2": BIG_CLASSES,
            "big-3": BIG_CLASSES}
    with HeadStore(tmp_path / "store") as setup:
        register_in_order(setup, bots)
    # 2 MiB: three of these heads fit, four do not.
    client, service = await start(aiohttp_client,
                                  settings_for(tmp_path, pin="keep", heads_memory_mb=2), trunk)
    store = service.store
    for _ in range(2):
        for bot_id in ("big-1", "big-2", "big-3"):
            resp = await client.get(f"/v2/models/{bot_id}/ready")  # loads the head
            assert resp.status == 200, await resp.text()
    stats = store.cache_stats()
    assert stats["evictions"] >= 4 and stats["pinned_resident"] == 1
    assert stats["resident_heads"] == 3  # the pinned one and the last two asked for
    text = await (await client.get("/metrics")).text()
    assert metric(text, "multihead_pinned_heads") == 1
    # The pinned head, registered first and asked for least recently, is still resident (a
    # cache hit); the least recently used unpinned one was evicted.
    assert resident(store, ["keep", "big-3", "big-2", "big-1"]) == {
        "keep": True, "big-3": True, "big-2": True, "big-1": False}
    resp = await client.post("/classify/keep", data=_png(), headers={"Content-Type": "image/png"})
    assert resp.status == 200 and (await resp.json())["bot_id"] == "keep"


async def test_preload_stops_at_the_heads_memory_budget(aiohttp_client, trunk, tmp_path):
    bots = {f"big-{i}": BIG_CLASSES for i in range(4)}  # big-3 is the newest
    with HeadStore(tmp_path / "store") as setup:
        register_in_order(setup, bots)
    client, service = await start(aiohttp_client,
                                  settings_for(tmp_path, preload=3, heads_memory_mb=1), trunk)
    body = await (await client.get("/readyz")).json()
    assert body["heads"] == {"pinned": [], "preloaded": 1, "preload_skipped": 2}
    assert service.store.cache_stats()["evictions"] == 0  # none loaded only to be thrown out
    assert resident(service.store, ["big-3", "big-2"]) == {"big-3": True, "big-2": False}


def test_most_recent_orders_by_registration_time_then_id(tmp_path):
    with HeadStore(tmp_path / "store") as store:
        register_in_order(store, {"b": 2, "a": 2, "d": 2, "c": 2})
        infos = store.list()
        assert [i.bot_id for i in most_recent(infos, 3)] == ["c", "d", "a"]
        assert [i.bot_id for i in most_recent(infos, 9, exclude=["d"])] == ["c", "a", "b"]
        assert most_recent(infos, 0) == []
        # A rollback makes an older registration active: it then counts as that old.
        store.register("b", *random_head(2, seed=7))
        assert most_recent(store.list(), 1)[0].bot_id == "b"
        store.rollback("b")
        assert most_recent(store.list(), 1)[0].bot_id == "c"


def test_preload_heads_loads_pinned_then_newest_and_reports_what_it_left_out(tmp_path):
    bots = {"old": BIG_CLASSES, "small": 2, "mid": BIG_CLASSES, "new": BIG_CLASSES}
    with HeadStore(tmp_path / "store") as setup:
        register_in_order(setup, bots)
    with HeadStore(tmp_path / "store", heads_memory_mb=1.3, pinned=["old"]) as store:
        report = preload_heads(store, ["old"], 3)
        # Pinned 'old' (0.6 MiB) + 'new' (0.6 MiB) fill the budget; 'mid' does not fit, the
        # older but small 'small' still does.
        assert (report.pinned, report.preloaded, report.skipped) == (
            ("old",), ("new", "small"), ("mid",))
        assert store.cache_stats()["evictions"] == 0


# -- pins that cannot be honoured --------------------------------------------------------------

def test_an_unknown_pin_is_refused_at_start_with_one_line_and_exit_2(tmp_path, trunk_checkpoint,
                                                                   capsys, monkeypatch):
    import service.transports.http.app
    from cli.main import main

    with HeadStore(tmp_path / "store") as setup:
        register_in_order(setup, {"alpha": 2})
    served = []
    monkeypatch.setattr(service.transports.http.app, "run_app",
                        lambda settings, listeners=(): served.append(settings))  # never block
    args = ["serve", "--store", str(tmp_path / "store"), "--trunk-checkpoint", trunk_checkpoint,
            "--device", "cpu", "--precision", "fp32"]

    assert main([*args, "--pin", "alpha,ghost,phantom"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("multihead serve: error: --pin: 'ghost', 'phantom' not registered in "
                          f"store '{tmp_path / 'store'}'")

    monkeypatch.setenv("MULTIHEAD_PIN", "ghost")
    assert main(args) == 2
    assert "'ghost' not registered" in capsys.readouterr().err

    monkeypatch.setenv("MULTIHEAD_PIN", "../etc")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("multihead serve: error: pin: invalid bot id")

    monkeypatch.setenv("MULTIHEAD_PIN", "alpha")
    assert main(args) == 0 and len(served) == 1 and served[0].pinned_bots == ("alpha",)


@pytest.mark.parametrize("pin,preload,message", [
    ("a b", 0, "pin: invalid bot id 'a b'"),
    ("", -1, "preload must be >= 0"),
])
def test_invalid_hot_bot_settings_are_refused(pin, preload, message):
    with pytest.raises(InvalidSettings, match=message):
        Settings(pin=pin, preload=preload)


def test_pin_lists_are_trimmed_and_deduplicated():
    assert Settings(pin=" b, a,,b ").pinned_bots == ("b", "a")
    assert Settings().pinned_bots == ()


async def test_a_pin_missing_from_the_store_leaves_the_service_not_ready(aiohttp_client, trunk,
                                                                       tmp_path):
    # What a transport without the CLI's check (Ray Serve) sees: readiness fails, naming it.
    with HeadStore(tmp_path / "store") as setup:
        register_in_order(setup, {"alpha": 2})
    client, _ = await start(aiohttp_client, settings_for(tmp_path, pin="alpha,ghost"), trunk,
                            wait_ready=False)
    body = await wait_until_ready(client)
    assert body["status"] == "failed"
    assert body["error"].startswith("head preload failed: --pin: 'ghost' not registered")
    resp = await client.post("/classify/alpha", data=_png(), headers={"Content-Type": "image/png"})
    assert resp.status == 503 and (await resp.json())["code"] == "not_ready"


def test_check_pinned_bots_names_every_missing_bot(tmp_path):
    with HeadStore(tmp_path / "store") as store:
        register_in_order(store, {"alpha": 2})
        check_pinned_bots(store, ["alpha"])
        with pytest.raises(PreloadError, match=r"--pin: 'x', 'y' not registered in the store"):
            check_pinned_bots(store, ["x", "alpha", "y"])


def test_a_given_store_must_pin_what_the_settings_pin(tmp_path):
    settings = settings_for(tmp_path, pin="alpha")
    with HeadStore(tmp_path / "store") as unpinned, pytest.raises(ValueError, match="pins"):
        Service(settings, store=unpinned)


# -- /bots ------------------------------------------------------------------------------------------

async def test_bots_and_bot_pages_mark_pinned_bots(aiohttp_client, trunk, tmp_path):
    with HeadStore(tmp_path / "store") as setup:
        register_in_order(setup, BOTS)
    client, _ = await start(aiohttp_client, settings_for(tmp_path, pin="charlie,alpha"), trunk)
    listed = (await (await client.get("/bots")).json())["bots"]
    assert {b["bot_id"]: b["pinned"] for b in listed} == {
        "alpha": True, "bravo": False, "charlie": True, "delta": False, "echo": False}
    for bot_id, pinned in (("alpha", True), ("bravo", False)):
        body = await (await client.get(f"/bots/{bot_id}")).json()
        assert body["pinned"] is pinned and body["bot_id"] == bot_id


def _png() -> bytes:
    from PIL import Image

    from tests.backbone.helpers import encode

    return encode(Image.fromarray(np.full((32, 32, 3), 90, np.uint8)))
