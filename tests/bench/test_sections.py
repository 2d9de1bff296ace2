"""Tiny real runs of the HTTP sections' measuring code: the session's real trunk behind a real
aiohttp server on loopback (in this process: no extra trunk is built), real JPEGs, a real store.

Only shapes and bookkeeping are asserted; timings belong to `multihead bench`, not to tests.
Images repeat on purpose (a pool of two, feature cache on), so the trunk runs a handful of
times in the whole module.
"""
from __future__ import annotations

import collections
import math
import os

import numpy as np
import pytest

from backbone import FEATURE_DIM
from bench import prometheus
from bench.bots import bot_id, random_head, register_bots
from bench.context import Context
from bench.load import (
    ServerProcess,
    Workload,
    client_session,
    closed_loop,
    make_jpeg,
    make_jpegs,
    open_loop,
    scrape_metrics,
    serve_command,
)
from bench.plan import Plan
from bench.report import evaluate_targets, write_reports
from bench.sections import cancellation, fairness_load, fairness_numbers, fanout, scale, service
from bench.stats import rss_bytes


@pytest.fixture(scope="module")
def jpegs():
    return make_jpegs(2)


def test_jpegs_are_distinct_640x480_uploads(jpegs):
    from backbone import decode_image

    assert jpegs[0] != jpegs[1] and make_jpeg(0) == jpegs[0]
    assert decode_image(jpegs[0]).shape == (480, 640, 3)
    assert 30_000 < len(jpegs[0]) < 400_000  # a realistic upload, not a flat image


def test_server_command_is_multihead_serve_with_the_options(tmp_path):
    server = ServerProcess("x", str(tmp_path / "store"), "/ckpt/prefix", str(tmp_path),
                           {"batch-policy": "per_group", "feature-cache-size": 0,
                            "warmup": False})
    server.port = 1234
    cmd = server.command()
    assert cmd[:len(serve_command())] == serve_command() and "serve" in cmd
    joined = " ".join(cmd)
    for part in ("--port 1234", "--host 127.0.0.1", "--trunk-checkpoint /ckpt/prefix",
                 "--batch-policy per_group", "--feature-cache-size 0", "--no-warmup"):
        assert part in joined


def _plan(**overrides) -> Plan:
    values = dict(concurrency=(1, 2), closed_min_requests=3, closed_requests_per_client=1,
                  poisson_requests=3, poisson_rate=20.0, fanout_bots=3, fanout_requests=1,
                  scale_levels=(3, 6), cold_samples=2, classes=5, progress=False)
    values.update(overrides)
    return Plan(**values)


def _context(tmp_path, jpegs) -> Context:
    return Context(_plan(), tmp_path / "out", tmp_path, jpegs=list(jpegs))


async def _serve(aiohttp_server, trunk, store_dir, **settings):
    """The service app in this process around the session's trunk; returns (url, store) once
    its /readyz says 200, as the benchmark would see it."""
    import asyncio

    from service.core.settings import Settings
    from service.transports.http.app import create_app
    from store import HeadStore

    store = HeadStore(store_dir)
    app = create_app(Settings(store=str(store_dir), warmup=False, max_wait_ms=2.0, auth="none",
                            **settings),
                     trunk=trunk, store=store)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with client_session() as session:
        for _ in range(500):
            async with session.get(f"{url}/readyz") as response:
                status, body = response.status, await response.text()
            if status == 200 or '"failed"' in body:
                break
            await asyncio.sleep(0.01)
    assert status == 200, body
    return url, store


async def test_service_points_and_fanout_measure_a_real_server(aiohttp_server, trunk, jpegs,
                                                               tmp_path):
    bots = register_bots(tmp_path / "store", 5, classes=5, seed=0)
    assert bots == [bot_id(i) for i in range(5)]
    url, store = await _serve(aiohttp_server, trunk, tmp_path / "store")
    try:
        context = _context(tmp_path, jpegs)
        data = {"points": []}
        result = service.ServiceResult(policies={"mixed": data})
        # The server runs in this process: its CPU is ours, the client's too.
        await service.measure_points(context, url, bots, "mixed", data, result,
                                     pid=os.getpid())
        fan = await fanout.measure(context, url, bots)
    finally:
        store.close()

    closed = [p for p in data["points"] if p["mode"] == "closed"]
    assert [p["concurrency"] for p in closed] == [1, 2]
    for p in data["points"]:
        assert p["errors"] == 0 and p["policy"] == "mixed"
        assert p["throughput_images_per_s"] > 0 and p["p50_ms"] > 0
        assert set(p["batch_size_distribution"]) >= {"<=1", "2"}
    assert data["points"][0]["requests"] == 3  # measured ones; the warm-up is not counted
    for p in data["points"]:  # CPU per image of the images its trunk ran (cache on here)
        if p["batches"]:
            assert p["images_served"] == pytest.approx(p["mean_batch"] * p["batches"])
            # One process: both clocks read it (/proc's in ticks of 10 ms).
            assert p["server_cpu_ms_per_image"] >= 0 and p["client_cpu_ms_per_image"] > 0
            assert p["machine_bound_images_per_s"] == pytest.approx(
                1000.0 * p["cores"] / (p["server_cpu_ms_per_image"]
                                       + p["client_cpu_ms_per_image"]))
            assert p["trunk_ms_per_batch_in_server"] > 0
    assert data["points"][-1]["mode"] == "open" and data["points"][-1]["requests"] == 3
    # Only the first sight of each image reaches the batcher; the first point pays for both.
    assert data["points"][0]["batches"] >= 1
    assert fan.n_bots == 3 and fan.single["n"] == 1 and fan.fanout["n"] == 1
    assert fan.ratio_p50 > 0


async def test_workload_spreads_requests_over_zipf_bots(aiohttp_server, trunk, jpegs, tmp_path):
    bots = register_bots(tmp_path / "store", 3, classes=4, seed=1)
    url, store = await _serve(aiohttp_server, trunk, tmp_path / "store")
    try:
        workload = Workload(jpegs, bots, zipf_s=1.0, seed=0)
        closed = await closed_loop(url, workload, concurrency=2, requests=4)
        opened = await open_loop(url, workload, rate_per_s=50.0, count=3, seed=0)
        histograms, gauges = await scrape_metrics(url)
    finally:
        store.close()
    assert closed["errors"] == 0 and closed["concurrency"] == 2
    assert opened["errors"] == 0 and opened["requests"] == 3
    assert histograms["multihead_batch_size"].count >= 1
    assert gauges["multihead_resident_heads"] >= 1


def test_workload_draws_bots_with_zipf_popularity_and_cycles_images():
    """Zipf s=1 over 3 bots: shares 6/11, 3/11, 2/11 (bot k drawn in proportion to 1/k)."""
    workload = Workload([b"i0", b"i1", b"i2"], ["a", "b", "c"], zipf_s=1.0, seed=0)
    draws = [workload.next() for _ in range(6000)]
    counts = collections.Counter(bot for bot, _ in draws)
    for bot, share in zip("abc", (6 / 11, 3 / 11, 2 / 11)):
        # 4.5 standard deviations of a binomial share: a statistical slack, no flake in practice.
        sigma = math.sqrt(share * (1 - share) / len(draws))
        assert abs(counts[bot] / len(draws) - share) < 4.5 * sigma, counts
    assert [image for _, image in draws[:4]] == [b"i0", b"i1", b"i2", b"i0"]
    again = Workload([b"i0"], ["a", "b", "c"], zipf_s=1.0, seed=0)
    assert [again.next()[0] for _ in range(50)] == [bot for bot, _ in draws[:50]]  # seeded
    with pytest.raises(ValueError):
        Workload([], ["a"])


async def test_scale_registers_levels_and_touches_every_bot(aiohttp_server, trunk, jpegs,
                                                             tmp_path):
    context = _context(tmp_path, jpegs)
    result = scale.register_levels(context, tmp_path / "scale")
    assert [lv["bots"] for lv in result.levels] == [3, 6]
    assert [lv["register"]["n"] for lv in result.levels] == [3, 3]
    assert result.registrations == 6 and result.registration_p50_ms > 0
    assert result.weight_bytes_per_bot == (FEATURE_DIM * 5 + 5) * 4

    url, store = await _serve(aiohttp_server, trunk, tmp_path / "scale")
    try:
        await scale.touch_levels(context, url, rss_bytes, result)
    finally:
        store.close()
    assert result.touched == 6
    assert [lv["touched"] for lv in result.levels] == [3, 6]
    assert result.levels[-1]["resident_heads"] == 6
    assert result.cold["n"] == 4 and result.warm["n"] == 4
    assert not math.isnan(result.rss_growth_per_bot_bytes)

    results = {"meta": {"sections": ["scale"], "date": "today", "machine": {}}, "errors": {},
               "scale": result.to_json()}
    written = write_reports(tmp_path / "out", results, evaluate_targets(results))
    assert "Bot scale" in written["md"].read_text()


async def test_fairness_loads_charge_each_tenant_and_the_quota_client_is_never_refused_twice(
        aiohttp_server, trunk, jpegs, tmp_path):
    """The fairness section's two loads on a real server with tenants (feature cache off: each
    image a trunk row): the flood's calls and the server's per-tenant counts, then the quota's
    one client honouring Retry-After against a tenant at 1 image/s."""
    from accounts.tenants import TenantLimits
    from store import HeadStore

    rng = np.random.default_rng(0)
    bots = {}
    with HeadStore(tmp_path / "store") as heads:
        for tenant in (fairness_load.NOISY, "quiet-1", fairness_load.LIMITED):
            limits = TenantLimits(rate=1.0, burst=2) if tenant == fairness_load.LIMITED else None
            heads.add_tenant(tenant, limits=limits)
            weights, biases, labels = random_head(rng, 5)
            bots[tenant] = f"{tenant}-bot"
            heads.register(bots[tenant], weights, biases, labels, tenant=tenant)
    url, store = await _serve(aiohttp_server, trunk, tmp_path / "store", feature_cache_size=0)
    clients = {fairness_load.NOISY: 2, "quiet-1": 1}
    try:
        # NOTE: a 2 s window: beside other jobs no call ended within 1 s (seen twice).
        flood = await fairness_load.flood(url, jpegs, bots, clients, 0.2, 2.0)
        quota = await fairness_load.quota_load(url, jpegs, bots[fairness_load.LIMITED],
                                               {"quiet-1": bots["quiet-1"]}, 2, 3.0,
                                               opening_images=3, first_refusal_s=60.0)
        async with client_session() as session:
            async with session.get(f"{url}/metrics") as response:
                metrics = await response.text()
    finally:
        store.close()

    assert {c.tenant for c in flood["calls"]} == set(clients)
    assert {c.status for c in flood["calls"] if c.end <= flood["window"][1]} == {200}
    summary = fairness_numbers.flood_summary(flood, clients)
    assert set(summary["tenants"]) == set(clients) and "served" in summary
    # Each tenant is charged its own images (the owner of the bot), and its refusals. The
    # flood's clients leave their last request unanswered (at most one each): the server may
    # still have served it.
    served = prometheus.by_labels(metrics, "multihead_tenant_images_total")
    answered = collections.Counter()
    for c in flood["calls"] + quota["calls"]:
        answered[c.tenant] += c.images if c.status == 200 else 0
    assert set(served) == set(answered)
    for tenant, n in clients.items():
        assert answered[tenant] <= served[tenant] <= answered[tenant] + n
    assert served[fairness_load.LIMITED] == answered[fairness_load.LIMITED] > 0

    calls = quota["calls"]
    assert {c.tenant for c in calls} == {fairness_load.LIMITED, "quiet-1"}
    sizes = [c.images for c in calls if c.tenant == fairness_load.LIMITED]
    assert sizes[0] == 3 and set(sizes[1:]) == {2}  # the opening request, then the others
    # Retry-After is at most 2 s (2 images at 1 image/s): its retry is sent within the 3 s.
    result = fairness_numbers.quota_summary(calls, quota["first_429"], 1.0, 2, 2, 3.0)
    assert result["refusals"] >= 1 and result["statuses"]["429 rate_limited"] >= 1
    assert result["refusals_improper"] == 0 and result["retries"] >= 1
    assert result["retries_refused"] == 0
    assert result["accepted_images"] % 2 == 0  # the opening request came before the 429
    refused = prometheus.by_labels(metrics, "multihead_tenant_refusals_total")
    assert refused == {f"rate_limited {fairness_load.LIMITED}": result["refusals"]}


def test_random_heads_are_seeded_and_shaped():
    w, bias, labels = random_head(np.random.default_rng(0), 7)
    assert w.shape == (FEATURE_DIM, 7) and w.dtype == np.float32 and bias.shape == (7,)
    assert len(labels) == 7 == len(set(labels))


@pytest.mark.parametrize("cancel", [True, False])
async def test_an_impatient_client_leaves_and_only_a_cancelling_server_counts_a_499(
        trunk, jpegs, tmp_path, cancel):
    """The cancellation section's impatient client (`post_images` with a timeout) against a
    real server whose trunk holds its row at a gate: the client gives up and its connection
    closes. With `cancel_on_disconnect` the server counts a 499 while the row is still in the
    trunk; without, the handler waits for the trunk and answers 200 to nobody."""
    from service.core.settings import Settings
    from service.transports.http.app import SERVICE, create_app
    from store import HeadStore
    from tests.support.fakes import GatedTrunk
    from tests.support.polling import until
    from tests.support.servers import AppServer

    (bot,) = register_bots(tmp_path / "store", 1, classes=5, seed=0)
    gated = GatedTrunk(trunk)
    store = HeadStore(tmp_path / "store")
    app = create_app(Settings(store=str(tmp_path / "store"), warmup=False, auth="none",
                              feature_cache_size=0, cancel_on_disconnect=cancel),
                     trunk=gated, store=store)
    server = AppServer(app)

    def counted() -> dict[str, int]:
        text = app[SERVICE].metrics.render()[0].decode()
        return cancellation.statuses("", text)

    try:
        await server.start_server()
        assert await app[SERVICE].wait_ready()
        url = str(server.make_url(f"/classify/{bot}"))
        async with client_session() as session:
            status, code, _ = await fairness_load.post_images(session, url, jpegs[:1],
                                                              timeout_s=0.5)
        assert cancellation.gave_up(fairness_load.Call("impatient-0", 0.0, 0.5, status, code))
        assert gated.entered.is_set()  # it gave up with its row in the trunk
        if cancel:
            await until(lambda: counted() == {"499": 1}, what=lambda: f"a 499: {counted()}")
        gated.gate.set()
        await until(lambda: sum(counted().values()) == 1, what=lambda: f"one: {counted()}")
    finally:
        gated.gate.set()
        await server.close()
        store.close()
    assert counted() == ({"499": 1} if cancel else {"200": 1})
    assert gated.batches == [1]  # a row already running is not withdrawn: it ran


def test_the_key_check_is_timed_through_the_serving_code_on_the_runs_store(tmp_path,
                                                                          monkeypatch):
    from bench.sections import service as section
    from service.core.errors import Unauthorized
    from store import HeadStore

    store = tmp_path / "store"
    with HeadStore(store) as heads:
        key, token = heads.add_key("default", "infer")
    monkeypatch.setattr(section, "AUTH_ROUNDS", 3)
    monkeypatch.setattr(section, "AUTH_CALLS", 50)
    seconds = section.key_check_seconds(store, token)
    assert math.isfinite(seconds) and seconds >= 0.0
    # The key really is checked (the calls with keys are not anonymous ones): a revoked key
    # is refused there, as the server refuses it.
    with HeadStore(store) as heads:
        heads.revoke_key(key.id)
    with pytest.raises(Unauthorized):
        section.key_check_seconds(store, token)
