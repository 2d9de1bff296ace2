"""Two writers registering the same bot at once: two HeadStore instances on one store (as two
server processes would have; for PostgreSQL, two connections), each in its own thread, started
together by a barrier. Runs on both backends."""
from __future__ import annotations

import threading

import numpy as np

from heads import open_store
from tests.heads.helpers import stored_entries

ROUNDS = 3


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
