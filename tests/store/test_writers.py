"""A registration is one transaction, on both backends: a failure or a killed process between
its steps leaves nothing visible and no number reused; two writers at once get distinct versions
(two HeadStore instances on one store, as two server processes would have; for PostgreSQL, two
connections); readers in other threads never see half a head."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from store import front as store_front
from store import open_store
from tests.support.heads import features, is_pg, pg_execute, random_head, stored_entries

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 3


# -- failures and crashes between the steps ---------------------------------------------------


def _assert_consistent(location, active, versions, registered=None):
    with open_store(location) as s:
        info = s.info("acme")
        assert (info.version, info.versions) == (active, versions)
        np.testing.assert_array_equal(s.get("acme").weights,
                                      random_head(3, seed=active)[0])
        assert [h["version"] for h in s.history("acme") if h["action"] == "register"] == (
            registered or versions)
        # The next registration sweeps the leftovers and takes a version number above every
        # committed one.
        new = s.register("acme", *random_head(3, seed=50))
        assert new > max(versions)
        assert s.get("acme").version == new
        assert sorted(stored_entries(location, "acme")) == sorted(
            f"v{v}" for v in versions + [new])


STEPS = {"sqlite": ["written", "renamed", "rows_added"], "postgresql": ["written", "rows_added"]}


BACKEND_STEPS = [pytest.param(backend, step, id=f"{backend}-{step}",
                              marks=[pytest.mark.postgresql] if backend == "postgresql" else [])
                 for backend, steps in STEPS.items() for step in steps]


@pytest.fixture
def location_of(request, tmp_path):
    """`location_of(backend)`: a store location of the named backend."""
    def make(backend):
        return str(tmp_path / "store") if backend == "sqlite" else request.getfixturevalue(
            "pg_url")
    return make


@pytest.mark.parametrize("backend, step", BACKEND_STEPS)
def test_failure_between_steps_rolls_back(location_of, monkeypatch, backend, step):
    root = location_of(backend)
    with open_store(root) as s:
        s.register("acme", *random_head(3, seed=1))

        def fail(at):
            if at == step:
                raise OSError(f"disk full at {at}")

        monkeypatch.setattr(store_front, "_fault_hook", fail)
        with pytest.raises(OSError, match="disk full"):
            s.register("acme", *random_head(3, seed=2))
        monkeypatch.setattr(store_front, "_fault_hook", None)
        assert s.get("acme").version == 1
        assert stored_entries(root, "acme") == ["v1"]
    _assert_consistent(root, active=1, versions=[1])


CRASH = textwrap.dedent("""
    import os, sys
    import numpy as np
    from store import front as store_front
    from store import open_store
    from tests.support.heads import random_head
    location, step = sys.argv[1], sys.argv[2]
    store_front._fault_hook = lambda at: os._exit(17) if at == step else None
    open_store(location).register("acme", *random_head(3, seed=2))
    os._exit(0)
""")


@pytest.mark.subprocess
@pytest.mark.parametrize("backend, step", [
    pytest.param("sqlite", "renamed", id="sqlite-renamed"),
    pytest.param("sqlite", "rows_added", id="sqlite-rows_added"),
    pytest.param("postgresql", "written", id="postgresql-written", marks=pytest.mark.postgresql),
    pytest.param("postgresql", "rows_added", id="postgresql-rows_added",
                 marks=pytest.mark.postgresql),
])
def test_process_killed_mid_registration_leaves_a_consistent_registry(location_of, backend,
                                                                       step):
    """os._exit before the commit: no cleanup code runs, like a kill -9."""
    root = location_of(backend)
    with open_store(root) as s:
        s.register("acme", *random_head(3, seed=1))
        s.register("acme", *random_head(3, seed=2))
        s.rollback("acme", to=1)
        s.remove("acme")  # v1 and v2 existed once: their numbers must never come back
        s.register("acme", *random_head(3, seed=3))
    proc = subprocess.run([sys.executable, "-c", CRASH, root, step], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-2000:]
    if is_pg(root):
        # The server rolled the dead session's transaction back: no row, blob or history of
        # v4, and the writer lock (the state row) is free again.
        assert stored_entries(root, "acme") == ["v3"]
        assert pg_execute(root, "SELECT count(*) FROM multihead.history WHERE version = 4") \
            == [(0,)]
    else:
        # The crash left the renamed v4 directory behind, but no registry row points to it.
        assert (Path(root) / "heads" / "acme" / "v4" / "manifest.json").exists()
    _assert_consistent(root, active=3, versions=[3], registered=[1, 2, 3])


# -- concurrent writers and readers -----------------------------------------------------------


def head_of(writer: int, k: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """A head whose weights and labels name who wrote it (writer, round)."""
    weights = np.full((1536, 2), writer * 100 + k, np.float32)
    return weights, np.array([writer, k], np.float32), [f"w{writer}-r{k}-a", f"w{writer}-r{k}-b"]


def test_two_stores_registering_the_same_bot_at_once_get_distinct_versions(location):
    root = location
    stores = [open_store(root), open_store(root)]
    barrier = threading.Barrier(2)
    got: dict[int, list[int]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            barrier.wait(10)
            for k in range(ROUNDS):
                got[i].append(stores[i].register("acme", *head_of(i, k)))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)

    # Distinct versions, each writer's in increasing order, no number lost or reused.
    every = sorted(got[0] + got[1])
    assert every == list(range(1, 2 * ROUNDS + 1))
    assert got[0] == sorted(got[0]) and got[1] == sorted(got[1])
    writer_of = {v: (i, k) for i in (0, 1) for k, v in enumerate(got[i])}

    # Both stores see every version; nothing but the versions is left in the store.
    for store in stores:
        info = store.info("acme")
        assert info.versions == every and info.version in (got[0][-1], got[1][-1])
    assert sorted(stored_entries(root, "acme")) == sorted(f"v{v}" for v in every)

    # Nothing half-written: every version holds exactly what its writer registered.
    reader = stores[0]
    for v in every:
        reader.rollback("acme", v)
        with open_store(root) as fresh:  # a fresh reader: no cache, read from storage
            head = fresh.get("acme")
        weights, biases, labels = head_of(*writer_of[v])
        assert head.version == v and list(head.labels) == labels
        np.testing.assert_array_equal(head.weights, weights)
        np.testing.assert_array_equal(head.biases, biases)
    for store in stores:
        store.close()


def test_threads_read_while_another_registers(any_store):
    store = any_store
    store.register("acme", *random_head(3, seed=0))
    errors, seen = [], set()
    stop = threading.Event()
    seen_one = threading.Condition()
    f = features(2)

    def reader():
        try:
            while not stop.is_set():
                head = store.get("acme")
                # Weights and version always belong together: seed == version - 1.
                expected = random_head(3, seed=head.version - 1)[0]
                np.testing.assert_array_equal(head.weights, expected)
                head.top_k(f, 2)
                with seen_one:
                    seen.add(head.version)
                    seen_one.notify_all()
        except Exception as exc:  # pragma: no cover - reported below
            with seen_one:
                errors.append(exc)
                seen_one.notify_all()

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for seed in range(1, 6):
            store.register("acme", *random_head(3, seed=seed))
            # Until a reader served the new version (instead of a sleep): every one is read.
            with seen_one:
                assert seen_one.wait_for(lambda v=seed + 1: v in seen or errors, 30), seen
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert store.get("acme").version == 6 and seen >= {2, 3, 4, 5, 6}
