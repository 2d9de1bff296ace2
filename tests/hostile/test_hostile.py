"""The hostile-tenant suite (issue 34, item 9): each attack of `bench.hostile.attacks.ATTACKS`
runs from tenant A against a real `multihead serve --auth keys` process on loopback while
tenant B runs a closed loop of one-image classifications (`bench.hostile.world.Victim`, a
process of its own).

Per attack: B gets only 200s and is served during it; A gets only the answers the attack allows
(clear 4xx refusals, never a 5xx) and reaches the defence it aims at (a `required` label); the
attack saw no violation of its own (a leak, a probe told apart, B's socket refused); the server
is still up and its RSS (/proc/<pid>/status) stayed within the bound its settings give
(`bench.hostile.world.rss_bound`). No timing is asserted: B's latency under each attack is the
bench section `isolation`'s (`multihead bench --sections isolation --check`).

One server for the module, attacks one after another, about 3 s each.
"""
from __future__ import annotations

import pytest

from bench.hostile.attacks import ATTACKS, grpc_missing
from bench.hostile.world import (
    SERVER_OPTIONS,
    World,
    make_store,
    rss_bound,
    run_phase,
    victim_beside,
)
from bench.load import ServerProcess, free_port, make_jpegs
from bench.stats import rss_bytes

pytestmark = [pytest.mark.timeout(300), pytest.mark.subprocess]  # a `multihead serve` process
ATTACK_S = 3.0
ALONE_S = 2.0
VICTIM_IMAGES = 8  # B's distinct images: more than the server's feature cache holds


@pytest.fixture(scope="module")
def served(trunk_checkpoint, serving_graph_cache, tmp_path_factory):
    """(world, victim, baseline phase, RSS bound): the server, B's loop running, B alone."""
    tmp = tmp_path_factory.mktemp("hostile")
    tokens = make_store(tmp / "store")
    grpc_port = free_port()
    # The saved graph, TF fp32 on every CPU (the subject is isolation, not the runtime), no
    # warm-up run: the server is ready in seconds.
    options = {**SERVER_OPTIONS, "grpc-port": grpc_port, "runtime": "tf", "precision": "fp32",
               "warmup": False}
    server = ServerProcess("hostile", str(tmp / "store"), trunk_checkpoint, str(tmp / "logs"),
                           options)
    server.start(timeout_s=120)
    try:
        world = World(server.url, f"127.0.0.1:{grpc_port}", server.pid, tokens,
                      make_jpegs(VICTIM_IMAGES, (320, 240)), tmp / "scratch", options)
        with victim_beside(world, settle_s=0.3) as (victim, idle):
            alone = run_phase(world, victim, "alone", ALONE_S)
            yield world, victim, alone, rss_bound(idle, options)
    finally:
        server.stop()


def test_b_alone_is_served(served):
    _, _, alone, _ = served
    assert alone.samples and {s.status for s in alone.samples} == {200}, alone.samples[:3]


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_an_attack_from_a_leaves_b_served_and_is_refused_clearly(served, attack):
    world, victim, _, bound = served
    if attack.name == "grpc" and grpc_missing():
        pytest.skip(grpc_missing())
    phase = run_phase(world, victim, attack.name, ATTACK_S, attack)
    assert attack.failures(phase.outcome) == [], dict(phase.outcome.answers)
    refused = [(s.status, s.code) for s in phase.samples if s.status != 200]
    assert phase.samples and refused == [], refused[:5]
    assert rss_bytes(world.pid) > 0, "the server is gone"
    assert phase.rss_peak <= bound, f"RSS peak {phase.rss_peak:,} over {bound:,}"
