"""A tenant's quota holds across two real `multihead serve` processes on one store directory
(issue 34, item 8): each counts the other by its lease (`store.leases`) and enforces half the
rate and half the burst, so that a burst sent to both is accepted about once, not twice; a
process that stops leaves, and the other counts itself alone again."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from bench.pgserver import free_port
from store import open_store
from tests.support.builders import random_head
from tests.support.polling import serve_ready, until_checked
from tests.support.prometheus import metric

pytestmark = pytest.mark.timeout(300)
BURST = 4


def serve(store_dir, trunk_checkpoint, port: int) -> subprocess.Popen:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
           # The default tenant's quota: a burst of 4 images and almost no refill (one image
           # every 100 s), so that what a burst is accepted is the burst alone.
           "MULTIHEAD_TENANT_RATE": "0.01", "MULTIHEAD_TENANT_BURST": str(BURST),
           # Every image costs its decode: no feature-cache hit is free.
           "MULTIHEAD_FEATURE_CACHE_SIZE": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--store", str(store_dir),
         "--trunk-checkpoint", trunk_checkpoint, "--port", str(port), "--no-warmup",
         "--runtime", "tf", "--precision", "fp32"],  # the session's saved graph
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def serving_processes(http, base: str) -> float:
    async with http.get(f"{base}/metrics") as r:
        return metric(await r.text(), "multihead_store_serving_processes")


async def test_a_tenants_burst_is_shared_by_two_serving_processes_on_one_store(
        trunk_checkpoint, serving_graph_cache, tmp_path, jpegs):
    store_dir = tmp_path / "store"
    with open_store(store_dir) as s:
        s.register("bot", *random_head(3, seed=5))
    ports = [free_port(), free_port()]
    servers = [serve(store_dir, trunk_checkpoint, port) for port in ports]
    bases = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        async with aiohttp.ClientSession() as http:
            for base, server in zip(bases, servers):
                await serve_ready(http, base, server, lambda p=server: p.stdout.read())
            for base in bases:  # each has counted the other's lease (a beat every 2 s)
                async def both(base=base) -> bool:
                    return await serving_processes(http, base) == 2
                await until_checked(both, 20, what=f"{base} counting 2 serving processes",
                                    interval_s=0.1)
                async with http.get(f"{base}/readyz") as r:
                    assert (await r.json())["store"]["serving_processes"] == 2

            accepted, refused = [0, 0], [0, 0]
            for i in range(2 * BURST):  # the whole burst to each process, alternating
                for k, base in enumerate(bases):
                    async with http.post(f"{base}/classify/bot", data=jpegs[i % len(jpegs)],
                                         headers={"Content-Type": "image/jpeg"}) as r:
                        body = await r.text()
                        if r.status == 200:
                            accepted[k] += 1
                            continue
                        assert r.status == 429, body
                        assert json.loads(body)["code"] == "rate_limited", body
                        assert "Retry-After" in r.headers
                        refused[k] += 1
            # Half the burst each (4 / 2), the burst in all: not the burst each (8 in all).
            assert accepted == [BURST // 2, BURST // 2], (accepted, refused)

            # One stops (SIGTERM: it drains, closes the store and deletes its lease); the other
            # counts itself alone at its next beat.
            servers[1].send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(servers[1].wait, 60) == 0

            async def alone() -> bool:
                return await serving_processes(http, bases[0]) == 1
            await until_checked(alone, 20, what="the survivor counting itself alone",
                                interval_s=0.1)
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
            server.wait()
