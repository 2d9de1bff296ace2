"""Section `replicas`: `multihead serve --ray` with a PostgreSQL store.

Measures, in one run, on a throw-away PostgreSQL server (`bench.pgserver`):
- the store: registration time and cold head load (first `get` in a fresh process's store),
  PostgreSQL against SQLite, for the same heads;
- 1 against 2 Ray Serve replicas: images/s and p50 at 16 clients (closed loop, Zipf bots);
- with 2 replicas: registration-to-served time, from `register` returning to every replica
  answering `GET /bots/{id}` (p50/p99 over 50 registrations);
- memory: RSS of each model replica, of the ingress, and of the whole Ray session.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.bots import register_bots
from bench.context import Context
from bench.result import Result
from bench.sections.base import Results, Section
from bench.stats import rss_bytes

REGISTRATIONS = 50
POLLERS = 4
NOTE = ("Ray Serve on this machine (2 cores): each replica runs its own trunk, so 2 replicas "
        "share the same 2 cores as 1 does; expect little gain here. The gain is for replicas "
        "on separate machines or GPUs.")


@dataclass
class ReplicasResult(Result):
    note: str = NOTE
    store: dict = field(default_factory=dict)  # see `compare_stores`
    propagation: dict = field(default_factory=dict)  # see `propagation`
    points: dict[str, dict] = field(default_factory=dict)  # replicas -> 16-client point
    speedup_2_vs_1: float | None = None


def _percentiles(values: Sequence[float]) -> dict:
    arr = np.asarray(values, dtype=float)
    return {"n": int(arr.size), "p50_s": float(np.percentile(arr, 50)),
            "p99_s": float(np.percentile(arr, 99)), "max_s": float(arr.max()),
            "mean_s": float(arr.mean())}


def compare_stores(pg_url: str, sqlite_dir: Path, count: int, classes: int, seed: int) -> dict:
    """Registration time and cold head load, PostgreSQL vs SQLite, for the same `count` heads."""
    from store import HeadStore

    rng = np.random.default_rng(seed)
    heads = [(rng.standard_normal((1536, classes)).astype(np.float32) * 0.01,
              np.zeros(classes, np.float32), [f"c{j}" for j in range(classes)])
             for _ in range(count)]
    out = {}
    for kind, location in (("sqlite", str(sqlite_dir)), ("postgresql", pg_url)):
        register_s, load_s = [], []
        with HeadStore(location) as store:
            for i, (w, b, labels) in enumerate(heads):
                t0 = time.perf_counter()
                store.register(f"cmp-{i}", w, b, labels)
                register_s.append(time.perf_counter() - t0)
        with HeadStore(location) as fresh:  # a new process's store: nothing resident
            fresh.exists("cmp-0")
            for i in range(count):
                t0 = time.perf_counter()
                fresh.get(f"cmp-{i}")
                load_s.append(time.perf_counter() - t0)
        out[kind] = {"register": _percentiles(register_s), "cold_load": _percentiles(load_s)}
    out["classes"] = classes
    return out


async def _answered_by_all(base: str, bot_id: str, replicas: set[str], timeout_s: float,
                           start: float) -> float:
    import aiohttp

    seen: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        async def poll():
            while set(seen) < replicas and time.monotonic() - start < timeout_s:
                async with session.get(f"{base}/bots/{bot_id}") as r:
                    await r.read()
                    if r.status == 200:
                        seen.setdefault(r.headers["X-Multihead-Replica"],
                                        time.monotonic() - start)
        await asyncio.gather(*(poll() for _ in range(POLLERS)))
    if set(seen) < replicas:
        raise RuntimeError(f"{bot_id}: replicas {sorted(replicas - set(seen))} did not answer "
                           f"within {timeout_s} s")
    return max(seen.values())


async def replica_ids(base: str, want: int, timeout_s: float = 60.0) -> dict[str, int]:
    """{replica: pid} of `want` distinct ready replicas, from /readyz."""
    import aiohttp

    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while len(seen) < want and time.monotonic() < deadline:
            async with session.get(f"{base}/readyz") as r:
                if r.status == 200:
                    body = await r.json()
                    seen[body["replica"]["replica"]] = body["replica"]["pid"]
    if len(seen) < want:
        raise RuntimeError(f"only {len(seen)} of {want} replicas answered /readyz")
    return seen


def propagation(base: str, pg_url: str, replicas: set[str], count: int, classes: int,
                seed: int) -> dict:
    """Registration-to-served: `register` returns, then every replica answers the bot."""
    from store import HeadStore

    rng = np.random.default_rng(seed)
    times = []
    with HeadStore(pg_url) as store:
        for i in range(count):
            w = rng.standard_normal((1536, classes)).astype(np.float32) * 0.01
            store.register(f"prop-{i}", w, np.zeros(classes, np.float32),
                           [f"c{j}" for j in range(classes)])
            start = time.monotonic()
            times.append(asyncio.run(_answered_by_all(base, f"prop-{i}", replicas, 30.0,
                                                      start)))
    return _percentiles(times)


def ray_session_rss() -> dict:
    """RSS of Ray's own processes on this machine by role, in bytes (from /proc)."""
    roles: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "gcs_server" in cmd:
            role = "gcs_server"
        elif "/raylet" in cmd:
            role = "raylet"
        elif "ServeController" in cmd or "ProxyActor" in cmd:
            role = "serve controller + proxy"
        elif "MultiheadIngress" in cmd:
            role = "ingress"
        elif "ray/dashboard" in cmd or "log_monitor" in cmd or "ray/autoscaler" in cmd:
            role = "ray monitors"
        else:
            continue
        roles[role] = roles.get(role, 0) + rss_bytes(entry.name)
    return roles


def run(context: Context) -> ReplicasResult:
    from bench.load import Workload, closed_loop
    from bench.pgserver import PgServer

    plan = context.plan
    result = ReplicasResult()
    pg = PgServer(durable=True)  # fsync on: compared with SQLite, which fsyncs
    try:
        url = pg.url
        result.store = compare_stores(url, context.tmp / "replicas-sqlite", REGISTRATIONS,
                                      plan.classes, plan.seed)
        bots = register_bots(url, plan.bots, plan.classes, plan.seed)
        requests = plan.closed_requests(16)
        for count in (1, 2):
            server = context.start(context.server(f"ray-{count}", url, ray=True,
                                                  replicas=count, **{"feature-cache-size": 0}))
            try:
                ids = asyncio.run(replica_ids(server.url, count))
                point = asyncio.run(closed_loop(server.url, Workload(
                    context.jpegs, bots, zipf_s=plan.zipf_s, seed=plan.seed), 16, requests))
                point["replicas"] = count
                point["ready_s"] = server.ready_s
                point["replica_rss_bytes"] = {rid: rss_bytes(pid) for rid, pid in ids.items()}
                point["ray_processes_rss_bytes"] = ray_session_rss()
                point["driver_rss_bytes"] = server.rss_bytes()
                result.points[str(count)] = point
                if count == 2:
                    result.propagation = propagation(server.url, url, set(ids),
                                                     REGISTRATIONS, plan.classes, plan.seed)
            finally:
                server.stop()
        one, two = result.points["1"], result.points["2"]
        result.speedup_2_vs_1 = (two["throughput_images_per_s"]
                                 / one["throughput_images_per_s"])
    finally:
        pg.cleanup()
    return result


def render(result: ReplicasResult, results: Results) -> str:
    out = ["", "## Replicas (Ray Serve, PostgreSQL store)", "", result.note, ""]
    points = result.points
    if points:
        out += ["| replicas | images/s at 16 clients | p50 ms | p99 ms | RSS per replica MB |",
                "|---|---|---|---|---|"]
        for count, p in sorted(points.items()):
            rss = ", ".join(f"{v / 2**20:.0f}" for v in p["replica_rss_bytes"].values())
            out.append(f"| {count} | {p['throughput_images_per_s']:.2f} | {p['p50_ms']:.0f} | "
                       f"{p['p99_ms']:.0f} | {rss} |")
        if result.speedup_2_vs_1 is not None:
            out += ["", f"2 replicas / 1 replica throughput: {result.speedup_2_vs_1:.2f}x"]
        two = points.get("2")
        if two:
            other = ", ".join(f"{k} {v / 2**20:.0f} MB"
                              for k, v in two["ray_processes_rss_bytes"].items())
            out += ["", f"Ray's own processes with 2 replicas: {other}; driver "
                        f"{two['driver_rss_bytes'] / 2**20:.0f} MB"]
    prop = result.propagation
    if prop:
        out += ["", f"Registration to served by every replica ({prop['n']} registrations): "
                    f"p50 {prop['p50_s'] * 1000:.0f} ms, p99 {prop['p99_s'] * 1000:.0f} ms, "
                    f"max {prop['max_s'] * 1000:.0f} ms"]
    store = result.store
    if store:
        out += ["", f"Store, {store['classes']}-class heads "
                    f"({store['sqlite']['register']['n']} each):", "",
                "| store | register p50 ms | register mean ms | cold load p50 ms | "
                "cold load mean ms |", "|---|---|---|---|---|"]
        for kind in ("sqlite", "postgresql"):
            s = store[kind]
            out.append(f"| {kind} | {s['register']['p50_s'] * 1000:.1f} | "
                       f"{s['register']['mean_s'] * 1000:.1f} | "
                       f"{s['cold_load']['p50_s'] * 1000:.1f} | "
                       f"{s['cold_load']['mean_s'] * 1000:.1f} |")
    return "\n".join(out + [""])


SECTION = Section("replicas", ReplicasResult, run, render)
