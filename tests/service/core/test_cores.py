"""`Cores`, the gate that keeps image decoding off the cores while a CPU trunk runs: the trunk
alone, decodes together, the trunk preferred, a bounded wait for a decode that runs long."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from service.core.cores import Cores
from tests.support.fakes import FakeClock
from tests.support.polling import wait_until as until

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[3]

WAIT_S = 5.0


class Holder:
    """A thread that takes one of the gate's holds and keeps it until `leave` is set."""

    def __init__(self, hold) -> None:
        self.inside = threading.Event()
        self.leave = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(hold,), daemon=True)
        self.thread.start()

    def _run(self, hold) -> None:
        with hold():
            self.inside.set()
            assert self.leave.wait(WAIT_S), "the test never let the holder leave"

    def done(self) -> None:
        self.leave.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


def test_decodes_run_together_and_wait_for_the_running_trunk():
    clock = FakeClock()
    waits: list[float] = []
    cores = Cores(True, on_wait=waits.append, clock=clock)
    first, second = Holder(cores.decode), Holder(cores.decode)  # decodes share the cores
    assert first.inside.wait(WAIT_S) and second.inside.wait(WAIT_S)
    first.done(), second.done()
    trunk = Holder(cores.trunk)
    assert trunk.inside.wait(WAIT_S)
    late = Holder(cores.decode)
    until_waiting(cores, 1)
    assert not late.inside.is_set()
    clock.advance(0.25)
    trunk.done()
    assert late.inside.wait(WAIT_S)
    late.done()
    assert waits == [0.25]  # only the decode that waited is counted, with its wait


def test_the_trunk_waits_for_running_decodes_and_new_ones_wait_behind_it():
    cores = Cores(True)
    running = Holder(cores.decode)
    assert running.inside.wait(WAIT_S)
    trunk = Holder(cores.trunk)
    until(lambda: cores._trunk == 1)  # the trunk is waiting for the running decode
    newcomer = Holder(cores.decode)  # preferred: the trunk goes first
    until_waiting(cores, 1)
    assert not trunk.inside.is_set()
    running.done()
    assert trunk.inside.wait(WAIT_S)
    assert not newcomer.inside.is_set()
    trunk.done()
    assert newcomer.inside.wait(WAIT_S)
    newcomer.done()
    assert cores.trunk_waits_given_up == 0


def test_a_batch_taken_holds_the_cores_until_its_trunk_takes_the_hold_over():
    """Between a batch's take (the event loop) and its trunk's start (the batch thread) no
    decode starts: it would make the trunk wait for it."""
    cores = Cores(True)
    give_back = cores.reserve()
    assert cores.reserved
    newcomer = Holder(cores.decode)
    until_waiting(cores, 1)
    assert not newcomer.inside.is_set()
    trunk = Holder(cores.trunk)  # takes the hold over at once: no decode runs
    assert trunk.inside.wait(WAIT_S)
    assert not cores.reserved and not newcomer.inside.is_set()
    trunk.done()
    assert newcomer.inside.wait(WAIT_S)
    newcomer.done()
    give_back()  # the batch is done: nothing left to give back
    assert not cores.reserved and cores.decodes_waiting == 0


def test_a_batch_with_no_trunk_work_gives_its_hold_back():
    cores = Cores(True)
    give_back = cores.reserve()
    newcomer = Holder(cores.decode)
    until_waiting(cores, 1)
    give_back()  # all its features were cached: no trunk ran
    assert newcomer.inside.wait(WAIT_S)
    newcomer.done()
    assert not cores.reserved


def test_a_decode_already_running_is_not_stopped_by_a_reservation():
    cores = Cores(True)
    running = Holder(cores.decode)
    assert running.inside.wait(WAIT_S)
    give_back = cores.reserve()
    trunk = Holder(cores.trunk)
    until(lambda: cores._trunk == 1)
    assert not trunk.inside.is_set()  # it waits for the running decode, as before
    running.done()
    assert trunk.inside.wait(WAIT_S)
    trunk.done()
    give_back()
    assert cores.trunk_waits_given_up == 0


def test_the_trunk_runs_beside_a_decode_that_takes_longer_than_its_bound():
    cores = Cores(True, max_trunk_wait_s=0.05)
    huge = Holder(cores.decode)  # a 36-megapixel PNG, say
    assert huge.inside.wait(WAIT_S)
    trunk = Holder(cores.trunk)
    assert trunk.inside.wait(WAIT_S)
    assert cores.trunk_waits_given_up == 1 and cores.decoding == 1
    trunk.done(), huge.done()


def test_without_exclusive_nothing_waits():
    cores = Cores(False)
    trunk = Holder(cores.trunk)
    assert trunk.inside.wait(WAIT_S)
    decode = Holder(cores.decode)
    assert decode.inside.wait(WAIT_S)  # beside the running trunk
    other = Holder(cores.trunk)
    assert other.inside.wait(WAIT_S)
    give_back = cores.reserve()  # nothing to reserve
    assert not cores.reserved
    late = Holder(cores.decode)
    assert late.inside.wait(WAIT_S)
    for h in (trunk, decode, other, late):
        h.done()
    give_back()
    assert cores.decodes_waiting == 0


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_trunk_wait_s"):
        Cores(True, max_trunk_wait_s=-1)


def test_one_blas_thread_limits_numpys_blas_to_one_thread():
    """The heads' BLAS beside a CPU trunk, in a new interpreter (what a test before did to this
    one's threads, an OpenVINO trunk's pinning say, does not count): numpy's own number of
    threads, then 1, and the products still right."""
    code = ("import numpy as np\n"
            "from service.core.cores import blas_threads, one_blas_thread\n"
            "before = blas_threads()\n"
            "one_blas_thread()\n"
            "ok = bool((np.ones((16, 1536)) @ np.ones((1536, 10)) == 1536).all())\n"
            "print(before, blas_threads(), ok)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.split()
    # Before: a thread per core it may run on (2 here), the pool one_blas_thread shrinks.
    assert out == [str(len(os.sched_getaffinity(0))), "1", "True"]


def until_waiting(cores: Cores, n: int) -> None:
    until(lambda: cores.decodes_waiting == n)
