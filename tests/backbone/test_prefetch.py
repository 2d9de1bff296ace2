"""`Trunk.plan` / `Trunk.load` and the early load (`backbone.trunk.prefetch`): the load of an
equal plan takes the prefetched trunk (no second load), another plan's load closes it, a failed
early load is loaded again. On the pure-numpy fake runtime (tests.backbone.helpers)."""
from __future__ import annotations

import threading

import pytest

from backbone import Trunk
from backbone import trunk as trunk_module
from backbone.runners import registry
from backbone.trunk import prefetch
from tests.backbone.helpers import FAKE, FakeRunner


class CountingRunner(FakeRunner):
    """The fake runner, counting its loads; a load waits for `gate` when it is set."""

    loads: list = []
    gate: threading.Event | None = None
    fail = False

    @classmethod
    def load(cls, request):
        if cls.gate is not None:
            assert cls.gate.wait(30)
        if cls.fail:
            raise RuntimeError("the early load broke")
        runner = super().load(request)
        cls.loads.append(runner)
        return runner


@pytest.fixture
def counting(trunk_checkpoint):
    CountingRunner.loads, CountingRunner.gate, CountingRunner.fail = [], None, False
    with registry.registered(FAKE, CountingRunner):
        yield
    assert not trunk_module._prefetched  # nothing left behind


def plan(checkpoint, **kwargs):
    return Trunk.plan(checkpoint, device="cpu", runtime="fake", precision="auto", **kwargs)


def test_the_load_of_an_equal_plan_takes_the_prefetched_trunk(counting, trunk_checkpoint):
    CountingRunner.gate = threading.Event()
    first = plan(trunk_checkpoint)
    assert prefetch(first, warmup_batch_sizes=())
    assert not prefetch(plan(trunk_checkpoint))  # one per plan
    CountingRunner.gate.set()  # the load below waits for the early one
    trunk = Trunk.load(plan(trunk_checkpoint), warmup_batch_sizes=(1,))
    assert len(CountingRunner.loads) == 1 and trunk.runner is CountingRunner.loads[0]
    assert trunk.choice.runtime == "fake" and not trunk.runner.closed
    again = Trunk.load(plan(trunk_checkpoint), warmup_batch_sizes=())  # nothing prefetched now
    assert len(CountingRunner.loads) == 2 and again.runner is not trunk.runner


def test_the_load_of_another_plan_closes_the_prefetched_trunk(counting, trunk_checkpoint,
                                                              tmp_path):
    prefetch(plan(trunk_checkpoint), warmup_batch_sizes=())
    other = plan(trunk_checkpoint, graph_cache_dir=tmp_path)  # another load option
    assert other.key != plan(trunk_checkpoint).key
    trunk = Trunk.load(other, warmup_batch_sizes=())
    for _ in range(300):  # the early one is closed once its load is over
        if len(CountingRunner.loads) == 2 and CountingRunner.loads[0].closed:
            break
        threading.Event().wait(0.01)
    early = next(r for r in CountingRunner.loads if r is not trunk.runner)
    assert early.closed and not trunk.runner.closed


def test_a_prefetch_no_load_takes_is_closed_when_discarded(counting, trunk_checkpoint):
    prefetch(plan(trunk_checkpoint), warmup_batch_sizes=())
    trunk_module.discard_prefetched()
    for _ in range(300):
        if CountingRunner.loads and CountingRunner.loads[0].closed:
            break
        threading.Event().wait(0.01)
    assert CountingRunner.loads[0].closed


def test_a_failed_early_load_is_loaded_again(counting, trunk_checkpoint, caplog):
    CountingRunner.fail = True
    prefetch(plan(trunk_checkpoint), warmup_batch_sizes=())
    for _ in range(300):
        future = trunk_module._prefetched.get(plan(trunk_checkpoint).key)
        if future is None or future.done():
            break
        threading.Event().wait(0.01)
    CountingRunner.fail = False
    trunk = Trunk.load(plan(trunk_checkpoint), warmup_batch_sizes=())
    assert len(CountingRunner.loads) == 1 and trunk.runner is CountingRunner.loads[0]
    assert "early load failed" in caplog.text
