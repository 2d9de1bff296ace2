"""The store as a snapshot, end to end: a real server on loopback (the session's real trunk, a
real directory store, `--auth keys`) answers a tenant's requests for its known bots while its
store's registry reads are blocked for 5 s right after a change another store object committed
(a new bot and a new key); the change shows up once the reads go through.

The gate (`tests.support.stores.BackendReads`) stands in front of every bots and accounts read
of the serving store: its refresher, which learns of the change from `PRAGMA data_version`,
blocks there. The test asserts an order, not a duration: each answer arrived while the gate was
still closed. The gate opens 5 s after the refresher blocked, or once those answers came if
they took longer (a loaded machine). A lookup on the request path that read the registry would
make its request wait for the gate, which would then open only by its safety timer, after
which that answer arrives: the test fails.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from store import HeadStore
from tests.support.builders import random_head
from tests.support.polling import until, until_checked
from tests.support.prometheus import metric
from tests.support.servers import make_settings, started
from tests.support.stores import BackendReads

pytestmark = pytest.mark.timeout(300)

OPERATOR_TOKEN = "snapshot-operator"
TENANT = "acme"
BOTS = ("alpha", "bravo", "charlie")
NEW_BOT = "delta"
JPEG = {"Content-Type": "image/jpeg"}
BLOCK_S = 5.0  # how long the registry reads block at least
SAFETY_S = 60.0  # the gate opens by itself then, so that a broken rule fails, not hangs


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **JPEG}


async def snapshot_age(client) -> tuple[float, float]:
    """The store snapshot's age as the full /readyz and /metrics give it (operator token)."""
    auth = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    async with client.get("/readyz", headers=auth) as resp:
        store = (await resp.json())["store"]
    assert store["kind"] == "sqlite" and store["read"] is True
    async with client.get("/metrics", headers=auth) as resp:
        age = metric(await resp.text(), "multihead_store_snapshot_age_seconds")
    await asyncio.sleep(0.05)
    return store["snapshot_age_s"], age


@pytest.fixture
def serving(tmp_path):
    """The serving store (closed after the server that serves it)."""
    s = HeadStore(tmp_path / "store")
    yield s
    s.close()


async def test_known_bots_with_keys_are_answered_while_the_store_reads_block(
        serving, aiohttp_client, trunk, tmp_path, jpegs, monkeypatch):
    root = serving.root
    serving.add_tenant(TENANT)
    _, token = serving.add_key(TENANT, "infer")
    for seed, bot_id in enumerate(BOTS):
        serving.register(bot_id, *random_head(3, seed=seed), tenant=TENANT)
    reads = BackendReads(serving, monkeypatch)
    try:
        settings = make_settings(tmp_path, auth="keys", admin_token=OPERATOR_TOKEN)
        client = await started(aiohttp_client, settings, trunk=trunk, store=serving)

        async def classify(path: str, image: bytes, headers: dict) -> tuple[int, bool]:
            """(status, whether the gate was open when the answer arrived)."""
            async with client.post(path, data=image, headers=headers) as resp:
                await resp.read()
                return resp.status, reads.gate.is_set()

        # Known bots: each answered once with the key (heads resident, the store watched).
        for bot_id in BOTS:
            assert (await classify(f"/classify/{bot_id}", jpegs[0], bearer(token)))[0] == 200

        # A change committed by another store object (as the admin CLI in another process),
        # while the serving store's registry reads block.
        reads.close(after_s=SAFETY_S)
        with HeadStore(root) as other:
            other.register(NEW_BOT, *random_head(3, seed=9), tenant=TENANT)
            _, new_token = other.add_key(TENANT, "infer")
        await until(reads.blocked.is_set, 30, what="the serving store reading the change")
        blocked_s = time.monotonic()

        # New images (trunk runs: the batch thread too), each known bot, and all at once; and
        # what the change brings, not seen yet: the new key is unknown, the new bot too.
        during = await asyncio.gather(
            *(classify(f"/classify/{bot_id}", jpegs[1 + i], bearer(token))
              for i, bot_id in enumerate(BOTS)),
            classify(f"/classify?bots={','.join(BOTS)}", jpegs[4], bearer(token)),
            classify(f"/classify/{BOTS[0]}", jpegs[0], bearer(new_token)),
            classify(f"/classify/{NEW_BOT}", jpegs[0], bearer(token)))
        assert not any(opened for _, opened in during), \
            f"answered only once the registry reads went through: {during}"
        assert [status for status, _ in during] == [200] * (len(BOTS) + 1) + [401, 404]
        assert reads.blocked.is_set() and not reads.gate.is_set()
        assert NEW_BOT not in serving.snapshot.active
        # Operations see how old the snapshot is, from the full /readyz and /metrics: while
        # the reads block, it is never confirmed again, so it only grows.
        ages = [await snapshot_age(client) for _ in range(2)]
        assert ages[0][0] <= ages[1][0] and ages[0][1] <= ages[1][1]

        await asyncio.sleep(max(0.0, BLOCK_S - (time.monotonic() - blocked_s)))
        reads.open()

        async def new_bot_answers() -> bool:
            status, _ = await classify(f"/classify/{NEW_BOT}", jpegs[5], bearer(new_token))
            return status == 200

        await until_checked(new_bot_answers, 30, what="the new bot and key served",
                            interval_s=0.05)
    finally:
        reads.open()
