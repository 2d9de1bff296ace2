"""Fixtures for the service tests: a real store, real heads, the session's real trunk."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from heads import HeadStore
from service.core.settings import Settings
from service.transports.http.app import SERVICE, create_app
from tests.backbone.helpers import encode, pattern

BOTS = {"alpha": 2, "bravo": 3, "charlie": 5, "delta": 7, "echo": 11}


def random_head(seed: int, n: int):
    rng = np.random.default_rng(seed)
    # Scaled so that softmax scores are spread (not all mass on one class).
    return (rng.standard_normal((1536, n)).astype(np.float32) * 0.05,
            rng.standard_normal(n).astype(np.float32) * 0.1,
            [f"class-{seed}-{i}" for i in range(n)])


@pytest.fixture
def store(tmp_path):
    s = HeadStore(tmp_path / "store")
    for seed, (bot_id, n) in enumerate(BOTS.items()):
        s.register(bot_id, *random_head(seed, n))
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


class GatedTrunk:
    """The real trunk behind a gate: `features` blocks until `gate` is set (for readiness and
    overload tests). Everything else is the real trunk's."""

    def __init__(self, trunk):
        self._trunk = trunk
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.checkpoint_prefix = trunk.checkpoint_prefix
        self.device = trunk.device

    def features(self, images):
        self.entered.set()
        self.gate.wait(60)
        return self._trunk.features(images)


def make_settings(tmp_path, **overrides) -> Settings:
    values = dict(store=str(tmp_path / "store"), warmup=False, max_wait_ms=20.0)
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def make_client(aiohttp_client, trunk, store, tmp_path):
    """Starts a real aiohttp test server around the shared trunk and the store; waits ready."""
    import asyncio

    async def make(*, trunk_obj=None, wait_ready=True, **overrides):
        settings = make_settings(tmp_path, **overrides)
        listeners = []
        if settings.grpc_port is not None:
            from service.transports.grpc.server import GrpcServer

            listeners.append(GrpcServer)
        app = create_app(settings, trunk=trunk_obj or trunk, store=store, listeners=listeners)
        client = await aiohttp_client(app)
        if wait_ready:
            for _ in range(500):
                if app[SERVICE].readiness.ready:
                    break
                await asyncio.sleep(0.01)
            assert app[SERVICE].readiness.ready, app[SERVICE].readiness.error
        return client

    return make
