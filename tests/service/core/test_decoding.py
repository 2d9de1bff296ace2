"""`FairDecodePool`: decodes taken in the tenants' weighted fair order of decode cost.

Each test holds the pool's one thread on a first job, queues work, then releases it and reads
the order the work ran in: the order is decided by the counters alone (no clock, no timing)."""
from __future__ import annotations

import random
import threading

import pytest

from service.core.decoding import FairDecodePool, cost_of
from tests.backbone.helpers import encode, pattern, png_header

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0


class Held:
    """A pool of one thread held on a first job (of tenant `first`) until `release()`; `ran`
    is the order of the names of the jobs run after it."""

    def __init__(self, weight=lambda tenant: 1.0, scheduler: str = "fair", *,
                 first: str = "first", first_cost: float = 1.0) -> None:
        self.pool = FairDecodePool(1, weight=weight, scheduler=scheduler,
                                   thread_name_prefix="test-decode")
        self.gate = threading.Event()
        self.started = threading.Event()
        self.ran: list[str] = []
        self.first = self.pool.schedule(first, first_cost, self._hold)
        assert self.started.wait(WAIT_S)

    def _hold(self) -> None:
        self.started.set()
        assert self.gate.wait(WAIT_S)

    def job(self, tenant: str, cost: float, name: str):
        return self.pool.schedule(tenant, cost, self.ran.append, name)

    def release(self) -> list[str]:
        self.gate.set()
        self.pool.shutdown(wait=True)
        return self.ran


def test_a_tenants_cheap_decode_is_taken_before_another_tenants_queued_costly_ones():
    held = Held(first="acme", first_cost=234.0)  # acme's first huge decode runs
    for i in range(5):
        held.job("acme", 234.0, f"acme-{i}")
    held.job("globex", 1.0, "globex-0")
    assert held.release() == ["globex-0"] + [f"acme-{i}" for i in range(5)]


def test_fifo_takes_the_arrival_order():
    held = Held(scheduler="fifo")
    for i in range(3):
        held.job("acme", 234.0, f"acme-{i}")
    held.job("globex", 1.0, "globex-0")
    assert held.release() == ["acme-0", "acme-1", "acme-2", "globex-0"]


def test_a_tenant_that_was_served_more_waits_for_the_others():
    held = Held()
    for i in range(2):
        held.job("acme", 1.0, f"acme-{i}")
    held.job("globex", 3.0, "globex-0")
    held.job("globex", 3.0, "globex-1")
    held.job("acme", 1.0, "acme-2")
    # globex's counter passes acme's after one decode of cost 3: acme's three (cost 1) then
    # go first, each within the cost already served to globex.
    assert held.release() == ["acme-0", "globex-0", "acme-1", "acme-2", "globex-1"]


def test_a_cancelled_decode_never_runs_and_is_not_counted():
    held = Held()
    gone = held.job("acme", 50.0, "acme-0")
    held.job("acme", 1.0, "acme-1")
    assert gone.cancel()
    assert held.release() == ["acme-1"]
    assert held.pool.counter("acme") == 1.0 + 1.0  # lifted to the first job's, then acme-1
    assert gone.cancelled()


def test_a_failing_job_fails_its_future_only():
    pool = FairDecodePool(1)
    bad = pool.schedule("acme", 1.0, int, "not a number")
    good = pool.schedule("acme", 1.0, int, "7")
    with pytest.raises(ValueError):
        bad.result(WAIT_S)
    assert good.result(WAIT_S) == 7
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(int, "1")


def test_shutdown_runs_what_was_queued_unless_cancelled():
    held = Held()
    kept = held.job("acme", 1.0, "acme-0")
    held.pool.shutdown(wait=False, cancel_futures=True)
    held.gate.set()
    held.pool.shutdown(wait=True)
    assert kept.cancelled() and held.ran == []


def test_threads_are_named_and_at_most_that_many_run():
    pool = FairDecodePool(2, thread_name_prefix="multihead-decode")
    gate = threading.Event()
    running = []
    lock = threading.Lock()

    def job() -> str:
        with lock:
            running.append(threading.current_thread().name)
        assert gate.wait(WAIT_S)
        return threading.current_thread().name

    futures = [pool.submit(job) for _ in range(3)]
    while len(running) < 2:
        threading.Event().wait(0.001)
    assert len(running) == 2 and not futures[2].running()
    gate.set()
    assert {f.result(WAIT_S) for f in futures} <= {"multihead-decode_0", "multihead-decode_1"}
    pool.shutdown()


@pytest.mark.parametrize("seed", range(20))
def test_backlogged_tenants_get_weighted_decode_cost_within_one_decode(seed):
    """While two tenants both have decodes queued, their weighted decode cost served (cost /
    weight) differs by at most the largest weighted cost of one decode."""
    rng = random.Random(seed)
    weights = {"acme": rng.choice([1.0, 2.0, 4.0]), "globex": rng.choice([1.0, 3.0])}
    held = Held(weight=weights.__getitem__)
    costs = {}
    for tenant in ("acme", "globex"):
        for i in range(rng.randint(5, 30)):
            name = f"{tenant}-{i}"
            costs[name] = rng.choice([1.0, 1.0, 4.0, 39.0, 234.0])
    names = [n for n in costs]
    rng.shuffle(names)
    for tenant in ("acme", "globex"):  # each tenant's own FIFO order is its numbering
        for name in sorted((n for n in names if n.startswith(tenant)),
                           key=lambda n: int(n.split("-")[1])):
            held.job(tenant, costs[name], name)
    order = held.release()
    assert sorted(order) == sorted(costs)
    served = {"acme": 0.0, "globex": 0.0}
    left = {t: sum(n.startswith(t) for n in costs) for t in served}
    bound = max(c / weights[n.split("-")[0]] for n, c in costs.items())
    for name in order:
        tenant = name.split("-")[0]
        served[tenant] += costs[name] / weights[tenant]
        left[tenant] -= 1
        if all(left.values()):
            assert abs(served["acme"] - served["globex"]) <= bound
        assert [n for n in order if n.startswith(tenant)] == sorted(
            (n for n in order if n.startswith(tenant)), key=lambda n: int(n.split("-")[1]))


def test_cost_of_reads_the_header_and_charges_one_for_what_the_decode_refuses_at_once():
    assert cost_of(encode(pattern(1, size=(1280, 960))), 40_000_000) == 4.0
    assert cost_of(png_header(6000, 6000, 16, 0), 40_000_000) == pytest.approx(234.375)
    assert cost_of(png_header(6000, 6000, 16, 0), 1000) == 1.0  # over the pixel limit
    assert cost_of(b"not an image", 1000) == 1.0


def test_bytes_cost_when_there_are_more_of_them_than_of_pixels():
    """Padding or garbage costs its size in reference images (640 x 480 x 3 bytes): a 10 MB
    body costs 11.4, decodable or not; a JPEG's few bytes leave its decode cost."""
    padded = encode(pattern(1, size=(64, 48))) + b"\0" * (10 * 1024 * 1024)
    assert cost_of(padded, 40_000_000) == pytest.approx(len(padded) / (640 * 480 * 3))
    assert cost_of(b"\xff\xd8" + b"\0" * (10 * 1024 * 1024), 1000) == pytest.approx(
        (10 * 1024 * 1024 + 2) / (640 * 480 * 3))
    assert cost_of(encode(pattern(1, size=(1280, 960))), 40_000_000) == 4.0
