"""Section `isolation`: no tenant can hurt another (issue 34, item 9), measured.

One `multihead serve --auth keys` process (HTTP and gRPC; `serve`'s defaults but the short
connection limits, small caches and tiny storage limits of `bench.hostile.world.SERVER_OPTIONS`)
over a store with tenant A (`attacker`, a quota of `A_RATE` images/s) and tenant B (`victim`).
B runs ONE closed-loop client of one-image classifications, the run's JPEGs in turn (more
distinct ones than the feature cache holds: every request goes through the trunk), from the
server's start to its end. Measured: B alone for `plan.isolation_alone_s`, then each attack of
`bench.hostile.attacks.ATTACKS` from A for `plan.isolation_s` (the same attacks the
hostile-tenant suite, tests/hostile, runs for 3 s each), one after another; per phase B's
requests (latency of those sent in it), their statuses, A's answers and the server's RSS peak
(VmRSS sampled every 50 ms) against the bound its settings give (`rss_bound`: the RSS after a
full trunk batch, before B starts, plus the in-flight, decode and heads budgets).

Targets: per attack B's p50 <= 1.5 x and p99 <= 3 x its p50 / p99 alone (`isolation_<attack>_p50`,
`_p99`); none of B's requests answered other than 200 (`isolation_b_non_200`); none of A's
answers outside what the attack allows (any 5xx), nor a defence never reached, nor a violation
an attack saw (`isolation_a_unexpected`); the RSS peak within its bound (`isolation_rss`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.context import Context, say
from bench.markdown import fmt, mb, table
from bench.result import Result
from bench.sections.base import Results, Section, Target, note
from bench.stats import num, ratio, summarize

P50_LIMIT = 1.5  # B's p50 under an attack / alone
P99_LIMIT = 3.0  # B's p99 under an attack / alone
VICTIM_IMAGES = 16  # B's distinct images (the server's feature cache holds 4)


@dataclass
class IsolationResult(Result):
    image: str = ""
    runtime: str | None = None
    attack_s: float | None = None
    alone_s: float | None = None
    a_rate: float | None = None
    # B alone: {"requests", "statuses", latency stats (ms)}
    alone: dict = field(default_factory=dict)
    # attack name -> {"text", "answers": {label: n}, "failures": [str], "b": B's stats as
    # `alone`, "rss_peak", "seconds"}
    attacks: dict[str, dict] = field(default_factory=dict)
    rss_idle: int | None = None
    rss_bound: int | None = None
    left_out: dict[str, str] = field(default_factory=dict)  # attack -> why (no grpc extra)


def victim_stats(samples) -> dict:
    """B's requests of a phase: how many, their statuses ("200", "503 overloaded"), the
    latency of all of them (ms)."""
    statuses = Counter(str(s.status) if s.status == 200 else f"{s.status} {_code(s.code)}"
                       for s in samples)
    return {"requests": len(samples), "statuses": dict(sorted(statuses.items())),
            **{k: v for k, v in summarize([s.latency_s for s in samples]).items() if k != "n"}}


def _code(body: str) -> str:
    import json

    try:
        return json.loads(body).get("code") or ""
    except (ValueError, AttributeError):
        return body[:40]


def non_200(stats: dict) -> int:
    return sum(n for status, n in (stats.get("statuses") or {}).items() if status != "200")


def run(context: Context) -> IsolationResult:
    from bench.hostile.attacks import ATTACKS, grpc_missing
    from bench.hostile.world import (
        A_RATE,
        SERVER_OPTIONS,
        World,
        make_store,
        rss_bound,
        victim_beside,
    )
    from bench.load import free_port

    plan = context.plan
    store = context.tmp / "isolation-store"
    tokens = make_store(store, plan.seed)
    context.share_graph_cache(store)
    grpc_port = free_port()
    options = {**SERVER_OPTIONS, "grpc-port": grpc_port}
    result = IsolationResult(image=context.image_summary(), attack_s=plan.isolation_s,
                             alone_s=plan.isolation_alone_s, a_rate=A_RATE)
    if grpc_missing():
        result.left_out["grpc"] = grpc_missing()
    attacks = [a for a in ATTACKS if a.name not in result.left_out]
    server = context.start(context.server("isolation", store, **options))
    try:
        result.runtime = server.runtime()
        world = World(server.url, f"127.0.0.1:{grpc_port}", server.pid, tokens,
                      context.jpegs[:VICTIM_IMAGES], context.tmp / "isolation-scratch",
                      options)
        with victim_beside(world, warm_images=plan.max_batch_size) as (victim, idle):
            result.rss_idle, result.rss_bound = idle, rss_bound(idle, options)
            _run_attacks(result, world, victim, attacks, plan)
    finally:
        server.stop()
    return result


def _run_attacks(result: IsolationResult, world, victim, attacks, plan) -> None:
    """B alone, then beside each attack; into `result`."""
    from bench.hostile.world import run_phase

    run_phase(world, victim, "warm-up", 3.0)
    say(f"isolation: B alone for {plan.isolation_alone_s:.0f} s ...")
    result.alone = victim_stats(run_phase(world, victim, "alone",
                                          plan.isolation_alone_s).samples)
    for attack in attacks:
        say(f"isolation: attack '{attack.name}' for {plan.isolation_s:.0f} s ...")
        phase = run_phase(world, victim, attack.name, plan.isolation_s, attack)
        b = victim_stats(phase.samples)
        result.attacks[attack.name] = {
            "text": attack.text, "answers": dict(sorted(phase.outcome.answers.items())),
            "failures": attack.failures(phase.outcome)[:10], "b": b,
            "rss_peak": phase.rss_peak, "seconds": phase.seconds}
        say(f"isolation: {attack.name}: B p50 {num(b.get('p50_ms')):.0f} ms (alone "
            f"{num(result.alone.get('p50_ms')):.0f}), {non_200(b)} not 200")


# -- report -------------------------------------------------------------------------------------


def _answers(answers: dict) -> str:
    return ", ".join(f"{k} × {v}" for k, v in answers.items()) or "—"


def render(result: IsolationResult, results: Results) -> str:
    alone = result.alone or {}
    out = [f"## Isolation: tenant A's attacks beside tenant B's closed loop "
           f"({result.runtime or '?'}, {result.image})", "",
           f"B: one client, one image a request, {VICTIM_IMAGES} distinct images in turn (every "
           f"one through the trunk); alone {fmt(result.alone_s)} s ({alone.get('requests')} "
           f"requests), then beside each attack of A for {fmt(result.attack_s)} s. A has a "
           f"quota of {fmt(result.a_rate)} images/s. RSS: idle {mb(result.rss_idle)}, bound "
           f"{mb(result.rss_bound)} (idle after a full trunk batch + the in-flight budget + the "
           "decode threads' largest images + the heads' budget).", ""]
    rows = []
    for name, a in result.attacks.items():
        b = a.get("b") or {}
        rows.append([name, _answers(a.get("answers") or {}), b.get("requests"), non_200(b),
                     alone.get("p50_ms"), b.get("p50_ms"),
                     ratio(b.get("p50_ms"), alone.get("p50_ms")), alone.get("p99_ms"),
                     b.get("p99_ms"), ratio(b.get("p99_ms"), alone.get("p99_ms")),
                     mb(a.get("rss_peak"))])
    out += table(["attack", "A's answers", "B's requests", "B non-200", "B p50 alone ms",
                  "B p50 under ms", "ratio", "B p99 alone ms", "B p99 under ms", "ratio",
                  "RSS peak"], rows)
    failures = [f"- `{name}`: {'; '.join(a['failures'])}" for name, a in result.attacks.items()
                if a.get("failures")]
    refused = [f"- `{name}`: B got {_answers({k: v for k, v in a['b']['statuses'].items() if k != '200'})}"  # noqa: E501
               for name, a in result.attacks.items() if non_200(a.get("b") or {})]
    if failures or refused:
        out += ["", "What went wrong:", "", *failures, *refused]
    if result.left_out:
        out += ["", "Left out: " + "; ".join(f"`{k}` ({v})" for k, v in result.left_out.items())]
    out += [""]
    return "\n".join(out)


def targets(result: IsolationResult, results: Results) -> list[Target]:
    from bench.hostile.attacks import ATTACKS

    alone = result.alone or {}
    out = []
    for attack in ATTACKS:
        if attack.name in result.left_out:  # the grpc extra missing
            continue
        b = (result.attacks.get(attack.name) or {}).get("b") or {}
        for stat, limit in (("p50", P50_LIMIT), ("p99", P99_LIMIT)):
            under, base = b.get(f"{stat}_ms"), alone.get(f"{stat}_ms")
            out.append(Target.of(
                f"isolation_{attack.name}_{stat}", f"B's {stat} under A's {attack.name} <= "
                f"{limit} x alone", ("isolation",), ratio(under, base), limit, "<=", "x",
                note("{:.0f} ms vs {:.0f} ms alone", under, base)))
    measured = bool(result.attacks)
    b_bad = sum(non_200(a.get("b") or {}) for a in result.attacks.values()) + non_200(alone)
    a_bad = sum(len(a.get("failures") or []) for a in result.attacks.values())
    peak = max((num(a.get("rss_peak")) for a in result.attacks.values()), default=None)
    out += [
        Target.of("isolation_b_non_200", "B's requests answered other than 200, alone and "
                  "under every attack", ("isolation",), b_bad if measured else None, 0, "<=",
                  ""),
        Target.of("isolation_a_unexpected", "A's answers outside what each attack allows (any "
                  "5xx), defences never reached, leaks and probes told apart", ("isolation",),
                  a_bad if measured else None, 0, "<=", ""),
        Target.of("isolation_rss", "the server's RSS peak under the attacks <= its bound "
                  "(idle + its memory budgets)", ("isolation",), ratio(peak, result.rss_bound),
                  1.0, "<=", "x", note("{:.0f} MB of {:.0f} MB", num(peak) / 1e6,
                                       num(result.rss_bound) / 1e6)),
    ]
    return out


SECTION = Section("isolation", IsolationResult, run, render, targets)
