"""Another process's change reaches a running store (a server) within 1 s: a directory store
by its refresher polling `PRAGMA data_version` (every change_poll_s, 0.25 s), PostgreSQL by
LISTEN/NOTIFY waking its refresher, with a fallback poll of its change counter for a change
nobody announced."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from store import open_store
from tests.support.heads import (
    listening,
    pg_execute,
    random_head,
    save_checkpoint,
    store_digest,
    version_of,
    write_labels,
)
from tests.support.polling import wait_until

REPO = Path(__file__).resolve().parents[2]

# The contract is 1 s from commit to every other store knowing; on a loaded 2-core machine (other
# test suites running) we allow stated slack on top: 2 s for a notification, 4 s for a directory
# store, whose writer here is the CLI (each run imports TensorFlow again).
NOTIFIED_WITHIN_S = 1.0 + 2.0
POLLED_WITHIN_S = 1.0 + 4.0


# -- a directory store ------------------------------------------------------------------------


def _cli(root, *argv):
    return subprocess.run([sys.executable, "-m", "cli", *argv, "--store", str(root)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.subprocess
def test_reader_sees_another_process_change_within_one_second(tmp_path):
    """A running reader (a server) and the admin CLI in other processes share one store.
    (Directory store only: each CLI run imports TensorFlow. The PostgreSQL counterpart below
    has a writer process that does not.)"""
    root = str(tmp_path / "store")
    weights, biases, labels = random_head(3, seed=1)
    prefix = save_checkpoint(tmp_path / "user" / "head.ckpt",
                             {"weights": weights, "biases": biases})
    labels_file = write_labels(tmp_path / "labels.txt", labels)

    def version_is(expected):
        return lambda: version_of(reader, "acme") == expected

    with open_store(root) as reader:  # started on an empty store: nothing stored yet
        assert not reader.exists("acme") and store_digest(root) == {}
        proc = _cli(root, "register", "acme", "--weights-checkpoint", prefix, "--labels",
                    labels_file)
        assert proc.returncode == 0, proc.stderr
        elapsed = wait_until(version_is(1), 10)
        assert elapsed < POLLED_WITHIN_S, elapsed
        np.testing.assert_array_equal(reader.get("acme").weights, weights)

        with open_store(root) as writer:  # another connection, as the admin HTTP API would be
            writer.register("acme", *random_head(3, seed=2))
        elapsed = wait_until(version_is(2), 10)
        assert elapsed < POLLED_WITHIN_S, elapsed

        proc = _cli(root, "bots", "rollback", "acme")
        assert proc.returncode == 0, proc.stderr
        elapsed = wait_until(version_is(1), 10)
        assert elapsed < POLLED_WITHIN_S, elapsed
        np.testing.assert_array_equal(reader.get("acme").weights, weights)

        proc = _cli(root, "bots", "remove", "acme")
        assert proc.returncode == 0, proc.stderr
        elapsed = wait_until(version_is(None), 10)
        assert elapsed < POLLED_WITHIN_S, elapsed
        assert reader.cache_stats()["resident_heads"] == 0


# -- PostgreSQL -------------------------------------------------------------------------------


WRITER = textwrap.dedent("""
    import sys
    from store import open_store
    from tests.support.heads import random_head
    store = open_store(sys.argv[1])
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "register":
            print(store.register("acme", *random_head(3, seed=int(arg[0]))), flush=True)
        elif cmd == "rollback":
            print(store.rollback("acme"), flush=True)
        elif cmd == "remove":
            store.remove("acme")
            print("removed", flush=True)
""")


def test_another_process_change_is_seen_within_one_second(pg_url):
    """A writer process (an admin CLI on another machine) and a reader (a server) that learns
    of each change by LISTEN/NOTIFY only: the listener's fallback poll and the refresher's own
    polls are switched off, so each notification wakes the refresher."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, pg_url], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)

    def tell(command: str) -> str:
        writer.stdin.write(command + "\n")
        writer.stdin.flush()
        answer = writer.stdout.readline().strip()  # returns after the commit
        assert answer, writer.stderr.read()[-2000:]
        return answer

    try:
        with open_store(pg_url) as reader:
            reader._backend.poll_s = 3600.0  # NOTIFY or nothing
            reader.change_poll_s = 3600.0
            listening(reader)
            for command, expected in [("register 1", 1), ("register 2", 2), ("rollback", 1),
                                      ("remove", None)]:
                tell(command)
                elapsed = wait_until(lambda e=expected: version_of(reader, "acme") == e,
                                   NOTIFIED_WITHIN_S + 5)
                assert elapsed < NOTIFIED_WITHIN_S, (command, elapsed)
                if expected is not None:
                    np.testing.assert_array_equal(reader.get("acme").weights,
                                                  random_head(3, seed=expected)[0])
            assert reader.cache_stats()["resident_heads"] == 0
    finally:
        writer.stdin.close()
        writer.wait(30)


def test_a_change_without_notification_is_seen_by_the_fallback_poll(pg_url):
    with open_store(pg_url) as s:
        s.register("acme", *random_head(3, seed=1))
        s.register("acme", *random_head(3, seed=2))
    with open_store(pg_url) as reader:
        reader._backend.poll_s = 0.2
        listening(reader)
        assert reader.get("acme").version == 2
        # A writer that forgot to NOTIFY (an old version, a hand-made fix in psql).
        pg_execute(pg_url, "UPDATE multihead.bots SET active_version = 1; "
                           "UPDATE multihead.state SET change_seq = change_seq + 1")
        elapsed = wait_until(lambda: reader.get("acme").version == 1, 10)
        assert elapsed < 0.2 + 0.25 + 2.0, elapsed
