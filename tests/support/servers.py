"""Real servers for the end-to-end tests: the service's aiohttp app on loopback around the
session's real trunk (tests/conftest.py) and a real store.

Fixtures (a conftest imports them by name):
- `store`: a directory store holding the five `BOTS` (function scope: tests may write to it).
- `jpegs`, `features_of`: eight 640x480 JPEG uploads and their reference features.
- `make_client`: a fresh server per call, with any settings or trunk of the test's.
- `shared_client`: a client of ONE server for the whole session (default settings, the `BOTS`),
  for the tests that only read. A test that registers, removes or rolls back a bot, or needs
  other settings, uses `make_client`.
"""
from __future__ import annotations

import asyncio
import threading

import aiohttp
import numpy as np
import pytest
import yarl
from aiohttp import web
from aiohttp.test_utils import TestServer

from service.core.settings import Settings
from service.transports.http.app import SERVICE, create_app, server_options
from store import HeadStore
from tests.backbone.helpers import encode, pattern
from tests.support.builders import random_head

BOTS = {"alpha": 2, "bravo": 3, "charlie": 5, "delta": 7, "echo": 11}


def make_settings(tmp_path, **overrides) -> Settings:
    """The tests' serving settings: a store under `tmp_path`, no warm-up, a short batch wait,
    no API keys (tests/service/codecs/test_auth.py is where keys are tested)."""
    values = dict(store=str(tmp_path / "store"), warmup=False, max_wait_ms=20.0, auth="none")
    values.update(overrides)
    return Settings(**values)


def open_bots_store(path) -> HeadStore:
    """A directory store at `path` holding the five `BOTS` (seeds 0..4)."""
    s = HeadStore(path)
    for seed, (bot_id, n) in enumerate(BOTS.items()):
        s.register(bot_id, *random_head(n, seed=seed))
    return s


@pytest.fixture
def store(tmp_path):
    s = open_bots_store(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture(scope="session")
def jpegs():
    """Eight distinct 640x480 JPEG uploads."""
    return [encode(pattern(100 + i, size=(640, 480)), "JPEG", quality=90) for i in range(8)]


@pytest.fixture(scope="session")
def features_of(trunk, jpegs):
    """Reference features of each JPEG, computed directly with the trunk (one batch)."""
    from backbone import preprocess

    features = trunk.features(np.stack([preprocess(j) for j in jpegs]))
    return {j: f for j, f in zip(jpegs, features)}


class AppServer(TestServer):
    """aiohttp's test server made as `run_app` makes the service's server, with the app's
    `server_options` (its own always cancels the handlers of clients that went away)."""

    async def _make_runner(self, **kwargs) -> web.AppRunner:
        kwargs.update(server_options(self.app[SERVICE].settings))
        return web.AppRunner(self.app, **kwargs)


async def started(aiohttp_client, settings: Settings, *, trunk, store, listeners=(),
                  wait_ready: bool = True):
    """A test client of the app on loopback; with `wait_ready`, once the service is ready."""
    app = create_app(settings, trunk=trunk, store=store, listeners=list(listeners))
    client = await aiohttp_client(AppServer(app))
    if wait_ready:
        service = app[SERVICE]
        assert await service.wait_ready(), service.readiness.error
    return client


@pytest.fixture
def make_client(aiohttp_client, trunk, store, tmp_path):
    """`await make_client(trunk_obj=None, wait_ready=True, **settings)`: a real aiohttp server
    around the session's trunk (or `trunk_obj`) and the `store`, ready unless told not to wait."""

    async def make(*, trunk_obj=None, wait_ready=True, **overrides):
        settings = make_settings(tmp_path, **overrides)
        listeners = []
        if settings.grpc_port is not None:
            from service.transports.grpc.server import GrpcServer

            listeners.append(GrpcServer)
        return await started(aiohttp_client, settings, trunk=trunk_obj or trunk, store=store,
                             listeners=listeners, wait_ready=wait_ready)

    return make


class ThreadedServer:
    """The service app served on 127.0.0.1 by an event loop in a thread of its own, so that
    tests on their own (function-scoped) event loops can all talk to it over loopback."""

    def __init__(self, app: web.Application) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shared-server",
                                        daemon=True)
        self._thread.start()
        self.app = app
        self._runner = web.AppRunner(app, **server_options(app[SERVICE].settings))  # as run_app
        self.url = self._call(self._start(app))

    def _call(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _start(self, app: web.Application) -> yarl.URL:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        service = app[SERVICE]
        assert await service.wait_ready(), service.readiness.error
        host, port = self._runner.addresses[0][:2]
        return yarl.URL.build(scheme="http", host=host, port=port)

    def close(self) -> None:
        self._call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class SharedClient:
    """What the tests use of aiohttp's test client, on the shared server: `get` and `post` of a
    path, and `make_url`."""

    def __init__(self, url: yarl.URL) -> None:
        self.url = url
        self.session = aiohttp.ClientSession(base_url=url)

    def make_url(self, path: str) -> yarl.URL:
        return self.url.join(yarl.URL(path))

    def get(self, path: str, **kwargs):
        return self.session.get(path, **kwargs)

    def post(self, path: str, **kwargs):
        return self.session.post(path, **kwargs)


@pytest.fixture(scope="session")
def shared_server(trunk, tmp_path_factory):
    """The session's one read-only server (see `shared_client`)."""
    tmp_path = tmp_path_factory.mktemp("shared-server")
    store = open_bots_store(tmp_path / "store")
    server = ThreadedServer(create_app(make_settings(tmp_path), trunk=trunk, store=store))
    yield server
    server.close()
    store.close()


@pytest.fixture
async def shared_client(shared_server):
    """A client of the session's one server: default settings, the five `BOTS`. For tests that
    only read; every other test starts its own with `make_client`."""
    client = SharedClient(shared_server.url)
    yield client
    await client.session.close()
