"""`multihead serve --ray --replicas 2 --store postgresql://...`, end to end with the real parts.

One real local Ray (loopback) runs two model replicas, each with the real Inception-V4 trunk,
behind Ray's HTTP proxy; the store is a real PostgreSQL 15 server started for this module
(bench/pgserver.py). Bots are registered by the real CLI (`multihead register`) in this process,
as an operator would from another machine. The tests share one deployment and run in order.

Timing rule: a change must reach every replica within 1 s (LISTEN/NOTIFY); the checks allow
1 s more for a busy 2-core machine, and the measured times are in the assertion messages.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from bench import prometheus
from bench.pgserver import free_port
from service.core import connections
from store import HeadStore
from tests.support.heads import random_head, save_checkpoint, write_labels

pytestmark = pytest.mark.timeout(900)

OPERATOR_TOKEN = "ray-operator-token"
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}  # the replicas run with API keys
PROPAGATION_S = 1.0
SLACK_S = 1.0
START_TIMEOUT_S = 300.0


def png_bytes(seed: int) -> bytes:
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class Deployment:
    def __init__(self, url: str, port: int, proc: subprocess.Popen, log: Path) -> None:
        self.store_url = url
        self.base = f"http://127.0.0.1:{port}"
        self.proc = proc
        self.log = log

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


async def replicas_ready(base: str, want: int, timeout_s: float,
                         report: bool = False, headers=OPERATOR) -> dict[str, int]:
    """Polls /readyz until `want` distinct ready replicas answered: {replica: pid}."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(headers=headers) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(base + "/readyz",
                                       timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        body = await r.json()
                        assert r.headers["X-Multihead-Replica"] == body["replica"]["replica"]
                        if report and body["replica"]["replica"] not in seen:
                            print(f"replica {body['replica']} ready: {body['timings']}")
                        seen[body["replica"]["replica"]] = body["replica"]["pid"]
                        if len(seen) >= want:
                            return seen
                        continue
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.5)
    raise AssertionError(f"only {len(seen)} of {want} replicas ready after {timeout_s} s")


@pytest.fixture(scope="module")
def pg(pg_server):
    return pg_server


@pytest.fixture(scope="module")
def deployment(pg, trunk_checkpoint, serving_graph_cache, tmp_path_factory):
    # serving_graph_cache: the replicas import the saved graph instead of building it.
    url = pg.url
    with HeadStore(url) as store:
        for i, bot in enumerate(("alpha", "beta")):
            w, b, labels = random_head(4 + i, seed=10 + i)
            store.register(bot, w, b, labels)
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "MULTIHEAD_WARMUP": "true",
           "MULTIHEAD_AUTH": "keys", "MULTIHEAD_ADMIN_TOKEN": OPERATOR_TOKEN}
    cmd = [sys.executable, "-m", "cli.main", "serve", "--ray", "--replicas", "2",
           "--store", url, "--trunk-checkpoint", trunk_checkpoint,
           "--host", "127.0.0.1", "--port", str(port), "--max-batch-size", "8",
           # The replicas are the subject, not the runtime: TF on the session's saved graph
           # starts each in seconds, where OpenVINO (the default) would convert and compile
           # per replica (OpenVINO and INT8: tests/backbone/test_runners.py, test_int8.py).
           "--runtime", "tf"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    dep = Deployment(url, port, proc, log)
    try:
        asyncio.run(replicas_ready(dep.base, 2, START_TIMEOUT_S, report=True))
    except AssertionError:
        _stop(proc)
        raise AssertionError(f"deployment did not come up:\n{dep.log_tail()}") from None
    yield dep
    _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    else:  # pragma: no cover - it died by itself
        pass
    # Whatever Ray left behind in this session's process group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def register_with_cli(url: str, bot: str, n: int, seed: int, tmp_path: Path) -> None:
    from cli.main import main

    w, b, labels = random_head(n, seed=seed)
    prefix = save_checkpoint(tmp_path / f"{bot}-{seed}" / "head", {"weights": w, "biases": b})
    labels_file = write_labels(tmp_path / f"{bot}-{seed}.txt", labels)
    assert main(["register", bot, "--store", url, "--weights-checkpoint", prefix,
                 "--labels", labels_file]) == 0


async def first_seen(base: str, path: str, predicate, replicas: set[str],
                     timeout_s: float = 10.0, pollers: int = 4,
                     headers=OPERATOR) -> dict[str, float]:
    """Polls GET `path` from `pollers` clients until every replica in `replicas` has answered
    so that `predicate(status, body)` holds; {replica: seconds from the call}. A replica that
    answered so must not answer otherwise a request sent after that answer came.

    NOTE: requests sent before it may: the pollers run at once, and a request the replica took
    before it saw the change can be answered after a later one (a 200 does more work than a
    401; a 200 after a 401 from one replica was seen once in `make test`)."""
    start = time.monotonic()
    seen: dict[str, float] = {}
    regressions: list[str] = []

    async def poll(session: aiohttp.ClientSession) -> None:
        while set(seen) < replicas and time.monotonic() - start < timeout_s:
            sent = time.monotonic() - start
            async with session.get(base + path) as r:
                body = await r.json()
                replica = r.headers["X-Multihead-Replica"]
                if predicate(r.status, body):
                    seen.setdefault(replica, time.monotonic() - start)
                elif replica in seen and sent > seen[replica]:
                    regressions.append(f"{replica}: {r.status} {body} (sent {sent:.3f} s after "
                                       f"the call, the new state seen at {seen[replica]:.3f} s)")

    async with aiohttp.ClientSession(headers=headers) as session:
        await asyncio.gather(*(poll(session) for _ in range(pollers)))
    assert not regressions, f"a replica went back after answering the new state: {regressions}"
    assert set(seen) >= replicas, f"replicas that never answered the new state: " \
                                  f"{replicas - set(seen)} (seen: {seen})"
    return seen


async def classify(session: aiohttp.ClientSession, base: str, bot: str, image: bytes,
                   timeout_s: float = 60.0):
    form = aiohttp.FormData()
    form.add_field("image", image, filename="x.png", content_type="image/png")
    async with session.post(f"{base}/classify/{bot}", data=form,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        return r.status, r.headers.get("X-Multihead-Replica"), await r.read()


async def scrape(session: aiohttp.ClientSession, base: str) -> prometheus.Samples:
    async with session.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
        text = await r.text()
        assert r.status == 200, text
        assert r.headers["Content-Type"].startswith("text/plain"), r.headers
        return prometheus.samples(text)


def series(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def value(samples: prometheus.Samples, name: str, **labels: str) -> float:
    return samples.get(series(name, **labels), 0.0)


CLASSIFIED = dict(name="multihead_requests_total", route="classify", status="200")
CLIENT_LEFT = dict(name="multihead_requests_total", route="classify", status="499")
QUEUED = dict(name="multihead_queue_depth")
ROWS_RUN = dict(name="multihead_batch_size_sum")  # rows of every trunk batch
REPLICAS = dict(name="multihead_metrics_replicas")
MISSING = dict(name="multihead_metrics_replicas_missing")
SUMMED = ("_total", "_bucket", "_count", "_sum")  # samples of counters and histograms


def predictions(body: bytes) -> list[tuple[str, float]]:
    result = json.loads(body)["results"][0]["predictions"]
    return [(p["label"], p["score"]) for p in result]


def same_answer(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> bool:
    # Batches of different sizes may differ in the last float32 digits.
    return [x[0] for x in a] == [x[0] for x in b] and \
        all(abs(x[1] - y[1]) < 1e-4 for x, y in zip(a, b))


# -- the tests, in order -------------------------------------------------------------------------

def test_both_replicas_answer_with_the_same_predictions(deployment):
    image = png_bytes(1)

    async def run():
        answers: dict[str, list] = {}
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            for _ in range(10):
                results = await asyncio.gather(*(classify(session, deployment.base, "alpha", image)
                                                 for _ in range(4)))
                for status, replica, body in results:
                    assert status == 200, body
                    answers.setdefault(replica, predictions(body))
                    assert same_answer(answers[replica], predictions(body))
                if len(answers) == 2:
                    break
        return answers

    answers = asyncio.run(run())
    assert len(answers) == 2, f"answers came from {sorted(answers)} only"
    first, second = answers.values()
    assert same_answer(first, second), answers
    assert len(first) == 4  # alpha has 4 classes: the head registered in PostgreSQL


def test_metrics_are_every_replicas_added_up(deployment):
    """/metrics under Ray holds every replica's metrics, merged, whichever replica Ray's proxy
    hands the scrape to: N requests spread over both replicas show as N in each of several
    scrapes in a row (counters summed, each scrape counted once), rows queued are summed, and
    each replica's own gauges carry its name."""
    image = png_bytes(1)  # its features are cached on both replicas (first test): no trunk run

    async def run():
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            before = await scrape(session, deployment.base)
            served: collections.Counter = collections.Counter()
            while len(served) < 2 or sum(served.values()) < 16:
                assert sum(served.values()) < 64, f"one replica answered everything: {served}"
                for status, replica, body in await asyncio.gather(
                        *(classify(session, deployment.base, "alpha", image) for _ in range(4))):
                    assert status == 200, body
                    served[replica] += 1
            start = time.perf_counter()
            scrapes = [await scrape(session, deployment.base) for _ in range(4)]
            return before, served, scrapes, (time.perf_counter() - start) / len(scrapes)

    before, served, scrapes, scrape_s = asyncio.run(run())
    n = sum(served.values())
    print(f"{n} requests served by {dict(served)}; a scrape took {scrape_s * 1000:.0f} ms")
    scraped = series("multihead_requests_total", route="metrics", status="200")
    for i, after in enumerate(scrapes, 1):
        assert value(after, **CLASSIFIED) - value(before, **CLASSIFIED) == n, i
        assert value(after, "multihead_bot_requests_total", bot="alpha") - \
            value(before, "multihead_bot_requests_total", bot="alpha") == n, i
        assert after[scraped] - before[scraped] == i  # each scrape counted once, by one replica
        assert value(after, **REPLICAS) == 2 and value(after, **MISSING) == 0, i
        assert value(after, **QUEUED) == 0, i
        resident = {dict(labels)["replica"] for name, labels in after
                    if name == "multihead_resident_heads"}
        assert resident == set(served), (resident, served)


def test_a_request_no_endpoint_matches_is_answered_and_counted_by_a_replica(deployment):
    """404/405 as on every transport, counted under `unmatched` by the replica that answered,
    which /metrics (every replica's) shows whichever replica answers the scrape."""
    async def run():
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            before = await scrape(session, deployment.base)
            async with session.get(f"{deployment.base}/nowhere") as resp:
                assert resp.status == 404 and (await resp.json())["code"] == "not_found"
                assert resp.headers["Server-Timing"].startswith("app;dur=")
            async with session.delete(f"{deployment.base}/classify/alpha") as resp:
                assert resp.status == 405 and resp.headers["Allow"] == "POST"
            return before, await scrape(session, deployment.base)

    before, after = asyncio.run(run())
    for status in ("404", "405"):
        unmatched = dict(name="multihead_requests_total", route="unmatched", status=status)
        assert value(after, **unmatched) - value(before, **unmatched) == 1, status


# What a WebSocket client sends to upgrade (RFC 6455), for reading a refused upgrade's answer.
UPGRADE = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
           "Sec-WebSocket-Key": "bXVsdGloZWFkLXJheS0xMg=="}


def test_the_websocket_is_served_behind_rays_proxy(deployment):
    """The WebSocket, a streaming endpoint of the table, under Ray: refused before the upgrade
    with the JSON error (401 without a key, 404 for an unknown bot); else 101 with the socket's
    X-Request-Id, then one answer per message in order, each image answered as POST
    /classify answers it, a text message a 400 on a socket that stays open; counted 101."""
    images = [png_bytes(1), png_bytes(2), png_bytes(3)]  # the first is cached (first test)
    url = f"{deployment.base}/ws/classify/alpha"

    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.get(url, headers=UPGRADE) as resp:
                assert resp.status == 401 and (await resp.json())["code"] == "unauthorized"
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            async with session.get(f"{deployment.base}/ws/classify/nobody",
                                   headers={**OPERATOR, **UPGRADE}) as resp:
                assert resp.status == 404 and (await resp.json())["code"] == "unknown_bot"
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(url)
            assert refused.value.status == 401
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            reference = []
            for image in images:
                status, _, body = await classify(session, deployment.base, "alpha", image)
                assert status == 200, body
                reference.append(predictions(body))
            before = await scrape(session, deployment.base)
            async with session.ws_connect(url, headers={"X-Request-Id": "ray-socket"}) as ws:
                assert ws._response.headers["X-Request-Id"] == "ray-socket"
                for image in images:  # sent at once: the answers keep their order
                    await ws.send_bytes(image)
                await ws.send_str("not an image")
                answers = [await ws.receive_json(timeout=60) for _ in range(4)]
                await ws.send_bytes(images[0])  # still open
                again = await ws.receive_json(timeout=60)
            return reference, answers, again, before, await scrape(session, deployment.base)

    reference, answers, again, before, after = asyncio.run(run())
    for want, got in zip(reference, answers):
        assert got["bot_id"] == "alpha", got
        assert same_answer(want, predictions(json.dumps(got).encode())), (want, got)
    assert answers[3] == {"error": "send each image as one binary message",
                          "code": "bad_request", "status": 400}
    assert same_answer(reference[0], predictions(json.dumps(again).encode()))
    opened = dict(name="multihead_requests_total", route="classify_ws", status="101")
    assert value(after, **opened) - value(before, **opened) == 1


def test_a_client_that_leaves_behind_rays_proxy_has_its_queued_rows_withdrawn(deployment):
    """One request of 32 images (4 trunk batches of 8, on one replica) whose client
    disconnects while its first batch runs and the rest wait in the queue: Ray's proxy cancels
    the ingress's request, the ingress cancels its call to the model replica, whose batcher
    withdraws the rows still queued. Fewer than 32 rows ever run; the replica counts a 499."""
    images = [png_bytes(9000 + i) for i in range(32)]  # distinct: no feature-cache hit

    async def poll(session: aiohttp.ClientSession, done, what: str, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            samples = await scrape(session, deployment.base)
            if done(samples):
                return samples
        raise AssertionError(f"never: {what}")

    async def run():
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            before = await scrape(session, deployment.base)
            form = aiohttp.FormData()
            for i, image in enumerate(images):
                form.add_field("image", image, filename=f"{i}.png", content_type="image/png")
            client = aiohttp.ClientSession(headers=OPERATOR)  # its own connection
            post = asyncio.create_task(client.post(f"{deployment.base}/classify/alpha",
                                                   data=form))
            try:
                queued = await poll(session, lambda s: value(s, **QUEUED) >= 16,
                                    "16 of the 32 rows waiting in the queue")
            finally:
                post.cancel()
                await client.close()  # the client goes away: its connection closes
            left = time.monotonic()
            await poll(session, lambda s: value(s, **QUEUED) == 0 and (
                value(s, **CLIENT_LEFT) > value(before, **CLIENT_LEFT)
                or value(s, **CLASSIFIED) > value(before, **CLASSIFIED)),
                "the request answered or withdrawn")
            answered_s = time.monotonic() - left
            # Then one new image answered by each replica: rows queued before it on its
            # replica (FIFO within a tenant) have run by then, or were withdrawn.
            served: set[str] = set()
            sentinels = 0
            while len(served) < 2:
                assert sentinels < 20, f"one replica answered everything: {served}"
                status, replica, body = await classify(session, deployment.base, "alpha",
                                                       png_bytes(9100 + sentinels))
                assert status == 200, body
                served.add(replica)
                sentinels += 1
            return before, queued, await scrape(session, deployment.base), answered_s, sentinels

    before, queued, after, answered_s, sentinels = asyncio.run(run())
    rows = value(after, **ROWS_RUN) - value(before, **ROWS_RUN) - sentinels
    print(f"client left with {value(queued, **QUEUED):.0f} rows queued; the replica knew "
          f"{answered_s:.1f} s later (at most); {rows:.0f} of its 32 rows ran")
    assert value(after, **CLIENT_LEFT) - value(before, **CLIENT_LEFT) == 1
    assert value(after, **CLASSIFIED) - value(before, **CLASSIFIED) == sentinels
    # The batch in the trunk when it left ran (nothing stops a trunk run); the rest never did.
    assert 32 - value(queued, **QUEUED) <= rows < 32, rows


def test_registration_with_the_cli_reaches_every_replica_within_a_second(deployment, tmp_path):
    replicas = set(asyncio.run(replicas_ready(deployment.base, 2, 30)))
    register_with_cli(deployment.store_url, "gamma", 6, seed=3, tmp_path=tmp_path)
    seen = asyncio.run(first_seen(
        deployment.base, "/bots/gamma",
        lambda status, body: status == 200 and body["version"] == 1, replicas))
    assert max(seen.values()) <= PROPAGATION_S + SLACK_S, seen

    async def answer():
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            status, _, body = await classify(session, deployment.base, "gamma", png_bytes(2))
            assert status == 200, body
            return predictions(body)

    assert len(asyncio.run(answer())) == 5  # top_k 5 of the 6 new classes


def test_rollback_and_removal_reach_every_replica_within_a_second(deployment, tmp_path):
    replicas = set(asyncio.run(replicas_ready(deployment.base, 2, 30)))
    register_with_cli(deployment.store_url, "gamma", 3, seed=4, tmp_path=tmp_path)  # v2
    asyncio.run(first_seen(deployment.base, "/bots/gamma",
                           lambda status, body: status == 200 and body["version"] == 2,
                           replicas))
    from cli.main import main

    assert main(["bots", "rollback", "gamma", "--store", deployment.store_url]) == 0
    seen = asyncio.run(first_seen(
        deployment.base, "/bots/gamma",
        lambda status, body: status == 200 and body["version"] == 1
        and body["n_classes"] == 6, replicas))
    assert max(seen.values()) <= PROPAGATION_S + SLACK_S, seen

    assert main(["bots", "remove", "gamma", "--store", deployment.store_url]) == 0
    seen = asyncio.run(first_seen(
        deployment.base, "/bots/gamma",
        lambda status, body: status == 404 and body["code"] == "unknown_bot", replicas))
    assert max(seen.values()) <= PROPAGATION_S + SLACK_S, seen


def test_a_revoked_key_is_refused_by_every_replica_within_a_second(deployment):
    replicas = set(asyncio.run(replicas_ready(deployment.base, 2, 30)))
    with HeadStore(deployment.store_url) as store:
        store.add_tenant("acme")
        store.register("acme-bot", *random_head(3, seed=7), tenant="acme")
        key, token = store.add_key("acme", "infer")
    own = {"Authorization": f"Bearer {token}"}
    asyncio.run(first_seen(deployment.base, "/bots/acme-bot",
                           lambda status, body: status == 200 and body["tenant"] == "acme",
                           replicas, headers=own))
    asyncio.run(first_seen(deployment.base, "/bots/alpha",  # another tenant's: unknown
                           lambda status, body: status == 404 and body["code"] == "unknown_bot",
                           replicas, headers=own))
    with HeadStore(deployment.store_url) as store:
        store.revoke_key(key.id)
    seen = asyncio.run(first_seen(
        deployment.base, "/bots/acme-bot",
        lambda status, body: status == 401 and body["code"] == "unauthorized", replicas,
        headers=own))
    assert max(seen.values()) <= PROPAGATION_S + SLACK_S, seen


def test_a_revoked_keys_idle_socket_is_closed_through_rays_ingress_within_a_second(deployment):
    """A WebSocket opened through Ray's proxy with a tenant's key, idle when the key is revoked
    in the store: the ingress asks a replica about its sockets' keys and closes this one with
    1008 and the JSON reason, without a message from the client; another key's socket stays
    open."""
    replicas = set(asyncio.run(replicas_ready(deployment.base, 2, 30)))
    with HeadStore(deployment.store_url) as store:
        store.add_tenant("initech")
        store.register("initech-bot", *random_head(3, seed=9), tenant="initech")
        key, token = store.add_key("initech", "infer")
        _, other = store.add_key("initech", "infer")
    asyncio.run(first_seen(deployment.base, "/bots/initech-bot",
                           lambda status, body: status == 200, replicas,
                           headers={"Authorization": f"Bearer {token}"}))
    url = f"{deployment.base}/ws/classify/initech-bot"

    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url, headers={"Authorization": f"Bearer {token}"}) \
                    as doomed, session.ws_connect(
                        url, headers={"Authorization": f"Bearer {other}"}) as kept:
                await kept.send_bytes(png_bytes(1))
                assert (await kept.receive_json(timeout=60))["bot_id"] == "initech-bot"
                with HeadStore(deployment.store_url) as store:
                    store.revoke_key(key.id)
                since = time.monotonic()
                message = await doomed.receive(timeout=PROPAGATION_S + SLACK_S + 5)
                took = time.monotonic() - since
                await kept.send_bytes(png_bytes(2))
                still = await kept.receive_json(timeout=60)
                return message, doomed.close_code, took, still

    message, code, took, still = asyncio.run(run())
    assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), message
    assert code == connections.CLOSE_POLICY, code
    assert json.loads(message.extra)["code"] == "unauthorized", message
    assert took <= PROPAGATION_S + SLACK_S, f"closed {took:.2f} s after the revocation"
    assert still["bot_id"] == "initech-bot", still


def test_a_tenants_quota_is_divided_between_the_replicas_and_set_live(deployment):
    """A rate set in the store reaches every replica within a second (the change
    notification); each replica enforces rate / 2 and burst / 2 (rounded up), so the
    deployment as a whole never passes the tenant's burst of 2, and every refusal is a 429
    rate_limited with a Retry-After."""
    replicas = set(asyncio.run(replicas_ready(deployment.base, 2, 30)))
    with HeadStore(deployment.store_url) as store:
        store.add_tenant("metered")
        store.register("metered-bot", *random_head(3, seed=8), tenant="metered")
    asyncio.run(first_seen(deployment.base, "/bots/metered-bot",
                           lambda status, body: status == 200, replicas))
    with HeadStore(deployment.store_url) as store:
        store.set_tenant_limits("metered", rate=0.001, burst=2)  # nothing refills meanwhile
    time.sleep(PROPAGATION_S + SLACK_S)
    accepted: collections.Counter = collections.Counter()
    refused: collections.Counter = collections.Counter()
    wrong: list[str] = []

    async def run() -> None:
        seeds = iter(range(5000, 5100))  # distinct images: a cache hit would cost nothing

        async def client(session: aiohttp.ClientSession) -> None:
            while min((refused[r] for r in replicas), default=0) < 2:
                form = aiohttp.FormData()
                form.add_field("image", png_bytes(next(seeds)), filename="x.png",
                               content_type="image/png")
                async with session.post(f"{deployment.base}/classify/metered-bot",
                                        data=form) as r:
                    replica, body = r.headers["X-Multihead-Replica"], await r.read()
                    retry_after = r.headers.get("Retry-After", "")
                if r.status == 200:
                    accepted[replica] += 1
                    continue
                refused[replica] += 1
                if (r.status != 429 or json.loads(body)["code"] != "rate_limited"
                        or not retry_after.isdigit()):
                    wrong.append(f"{replica}: {r.status} {retry_after!r} {body[:200]!r}")

        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            await asyncio.gather(*(client(session) for _ in range(4)))

    asyncio.run(run())
    assert not wrong, wrong
    assert all(accepted[r] <= 1 for r in replicas), accepted  # burst 2 / 2 replicas each
    assert sum(accepted.values()) <= 2, accepted


def test_a_killed_replica_is_restarted_and_no_request_gets_a_wrong_answer(deployment):
    """SIGKILL one replica under load: the requests it held are retried on the other one (or
    get an explicit 503), none gets a wrong answer or another error; Ray starts a new one.
    /metrics answers throughout, and its sums never go back: the killed replica's last counts
    stay in them."""
    image = png_bytes(5)
    pids = asyncio.run(replicas_ready(deployment.base, 2, 30))
    victim, pid = sorted(pids.items())[0]
    scrapes: list[prometheus.Samples] = []

    async def run():
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            status, _, body = await classify(session, deployment.base, "beta", image)
            assert status == 200, body
            reference = predictions(body)
            scrapes.append(await scrape(session, deployment.base))
            counts = {"right": 0, "wrong": 0, "503": 0, "other": 0}
            others: list[str] = []
            # Load from 1 s before the kill to 5 s after it: the killed replica holds requests.
            stop = time.monotonic() + 6.0

            async def client():
                while time.monotonic() < stop:
                    status, _, body = await classify(session, deployment.base, "beta", image)
                    if status == 200:
                        counts["right" if same_answer(predictions(body), reference)
                               else "wrong"] += 1
                    elif status == 503 and json.loads(body)["code"] in (
                            "replica_lost", "overloaded", "not_ready"):
                        counts["503"] += 1
                    else:
                        counts["other"] += 1
                        others.append(f"{status} {body[:200]!r}")

            async def killer():
                await asyncio.sleep(1.0)
                os.kill(pid, signal.SIGKILL)
                await asyncio.sleep(0.5)
                scrapes.append(await scrape(session, deployment.base))

            await asyncio.gather(killer(), *(client() for _ in range(4)))
            return counts, others

    counts, others = asyncio.run(run())
    print(f"replica {victim} (pid {pid}) killed under load: {counts}")
    assert counts["wrong"] == 0 and counts["other"] == 0, (counts, others[:5])
    assert counts["right"] > 0
    after = asyncio.run(replicas_ready(deployment.base, 2, 180))
    assert victim not in after, f"the killed replica {victim} still answers"
    assert set(after) & set(pids), "the surviving replica should still answer"

    async def last_scrape():
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            return await scrape(session, deployment.base)

    scrapes.append(asyncio.run(last_scrape()))
    print("metrics replicas (answered, missing) before, just after the kill, after the "
          f"restart: {[(value(s, **REPLICAS), value(s, **MISSING)) for s in scrapes]}")
    assert value(scrapes[-1], **REPLICAS) == 2 and value(scrapes[-1], **MISSING) == 0
    for earlier, later in zip(scrapes, scrapes[1:]):
        went_back = {k: (v, later.get(k)) for k, v in earlier.items()
                     if k[0].endswith(SUMMED) and later.get(k, 0.0) < v}
        assert not went_back, went_back


def test_replicas_survive_a_postgresql_restart_and_see_later_registrations(deployment, pg,
                                                                           tmp_path):
    image = png_bytes(6)
    replicas = set(asyncio.run(replicas_ready(deployment.base, 2, 60)))

    async def load(seconds: float) -> dict[str, int]:
        counts: dict[str, int] = {}
        stop = time.monotonic() + seconds
        async with aiohttp.ClientSession(headers=OPERATOR) as session:
            async def client():
                while time.monotonic() < stop:
                    status, _, body = await classify(session, deployment.base, "alpha", image)
                    key = str(status) if status != 200 else "200"
                    counts[key] = counts.get(key, 0) + 1
            await asyncio.gather(*(client() for _ in range(4)))
        return counts

    async def load_while_down():
        task = asyncio.create_task(load(6.0))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(pg.stop)
        counts = await task
        await asyncio.to_thread(pg.start)
        return counts

    counts = asyncio.run(load_while_down())
    assert set(counts) == {"200"}, f"resident bots must keep being served: {counts}"
    register_with_cli(deployment.store_url, "delta", 3, seed=7, tmp_path=tmp_path)
    # After a reconnect the replicas poll (a notification sent while they were away is lost).
    seen = asyncio.run(first_seen(deployment.base, "/bots/delta",
                                  lambda status, body: status == 200, replicas,
                                  timeout_s=30))
    print(f"after the PostgreSQL restart, delta seen after {seen}")
