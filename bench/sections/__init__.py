"""The sections of the benchmark, in the order a run takes them. Each is a `Section` (name,
run, render, targets; see `bench.sections.base`) in a module of its own; `SECTIONS` is the one
list the command line, the runner and the report read. Adding a section: write its module
with a `SECTION`, and list it here.

    trunk      raw trunk images/s at batch 1..16 by runtime x precision, the matmul ceiling
    service    a real server under closed and open loops, mixed vs per-bot batching, against
               the raw trunk of the runtime x precision it runs
    fanout     one image scored by 1 bot vs by 10 bots in one request
    grpc       REST vs KServe v2 ModelInfer vs TF Serving Predict on one server
    scale      10..10,000 registered heads: registration, RSS per head, cold vs warm bot
    coldstart  process start to /readyz 200, with and without a saved graph
    baselines  rebuild per request; K full models (one Trunk per bot)
    overload   N concurrent 10 MB uploads: RSS start/peak/after, refused vs answered
    fairness   one tenant's flood vs quiet tenants, fair vs fifo scheduler; a tenant's quota
    deadlines  at serve's defaults: a quiet tenant beside a flood; a bursty trace of tenants
               with 150 ms and 5 s deadlines, fifo vs fair vs deadline-aware
    cancellation  16 clients, 8 giving up after 2 x the median: with vs without cancellation
    isolation  a hostile tenant's attacks vs another tenant's closed loop: its p50/p99 alone
               and under each attack, every answer a clear one
    soak       minutes of mixed valid and hostile traffic: RSS must stay flat
    replicas   Ray Serve, 1 vs 2 replicas, PostgreSQL vs SQLite store
    store      copy, backup, restore and check of a store of 10,000 bots: time and size
"""
from __future__ import annotations

from bench.sections import (
    baselines,
    cancellation,
    coldstart,
    deadlines,
    fairness,
    fanout,
    grpc,
    isolation,
    overload,
    replicas,
    scale,
    service,
    soak,
    store,
    trunk,
)
from bench.sections.base import Section

SECTIONS: tuple[Section, ...] = (
    trunk.SECTION, service.SECTION, fanout.SECTION, grpc.SECTION, scale.SECTION,
    coldstart.SECTION, baselines.SECTION, overload.SECTION, fairness.SECTION, deadlines.SECTION,
    cancellation.SECTION, isolation.SECTION, soak.SECTION, replicas.SECTION, store.SECTION)
NAMES: tuple[str, ...] = tuple(s.name for s in SECTIONS)


def parse_names(text: str) -> tuple[str, ...]:
    """The section names of a comma-separated list, in the order given, without repeats;
    ValueError (one line, naming the choices) for an unknown or empty list."""
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise ValueError(f"unknown section(s) {', '.join(unknown) or '(none)'}; choose from "
                         f"{','.join(NAMES)}")
    return names
