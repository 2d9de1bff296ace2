"""Session-wide fixtures: ONE real Inception-V4 trunk per test session (and ONE real INT8
calibration of it, tests/support/int8.py).

The trunk checkpoint is written once per run (seeded random weights in the official slim
layout, the same file `multihead init-trunk` writes) and each graph of it is built once: the
pytest-xdist workers and `make test`'s second pytest run import it (`shared_dir`). Every test
that needs features shares the session's `Trunk`. Keep the number of images pushed through it small and batched:
on 2 CPU cores one image costs about a quarter of a second.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from pathlib import Path

import hypothesis
import pytest

from tests.backbone.helpers import graph_cache_of
from tests.support.int8 import (  # noqa: F401 - fixtures, used by name
    int8_calibrated,
    int8_images,
    int8_trunk,
)
from tests.support.postgres import pg_server  # noqa: F401 - a fixture, used by name

# Servers the tests start (`multihead serve` subprocesses, Ray replicas) run without API keys
# unless a test asks for them: tests/service/codecs/test_auth.py is where keys are tested, and the
# in-process tests' settings say auth="none" likewise (tests/support/servers.make_settings).
os.environ.setdefault("MULTIHEAD_AUTH", "none")
# tf.keras = tf_keras, as `multihead` and `backbone.tfimport` choose it, whichever test imports
# TensorFlow first (Keras 3's import alone is about 3 s of a worker).
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

# Hypothesis asserts no timings here: its default 200 ms deadline per example and its
# too-slow-generation health check fail on a busy CI machine (two workers, the Ray run and
# TensorFlow's threads on 2 cores) for reasons that are not the code's. Per-test settings
# (max_examples, ...) still apply on top of this profile.
hypothesis.settings.register_profile(
    "multihead", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("multihead")

SHARED_DIR_ENV = "MULTIHEAD_TEST_SHARED_DIR"  # `make test` sets it for both of its runs
INT8_FIXTURES = frozenset({"int8_calibrated", "int8_trunk", "int8_images"})


def _int8_files(root: Path) -> frozenset[str]:
    """The test files that name an INT8 fixture (their source read as text: a mention too)."""
    found = set()
    for path in (root / "tests").rglob("test_*.py"):
        words = set(re.findall(r"\w+", path.read_text(encoding="utf-8")))
        if words & INT8_FIXTURES:
            found.add(path.relative_to(root).as_posix())
    return frozenset(found)


# The slowest test files (seconds each on 2 cores, mostly building trunks or starting servers),
# run first: a worker that starts one late leaves the other idle at the end. The INT8 files
# are one unit of work (`pytest_xdist_make_scheduler`); the rest follow in collection order.
SLOW_FIRST = (
    "tests/cli/test_demo.py", "tests/hostile/test_hostile.py", "tests/backbone/test_int8.py",
    "tests/backbone/test_trunk.py",
    "tests/backbone/test_runners.py", "tests/cli/test_admin.py",
    "tests/accounts/test_tenants.py", "tests/backbone/test_compat.py",
    "tests/backbone/test_preprocess.py", "tests/service/transports/test_app.py",
    "tests/service/transports/test_interop.py", "tests/heads/test_slim_import.py",
    "tests/service/transports/test_openapi.py", "tests/service/codecs/test_auth.py",
    "tests/service/core/test_candidates.py",
    "tests/backbone/test_tfimport.py", "tests/store/test_writers.py",
)


def pytest_collection_modifyitems(config, items):
    """The SLOW_FIRST files first (every worker orders its collection alike)."""
    root = Path(config.rootpath)
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    order = {id(item): (rank.get(item.path.relative_to(root).as_posix(), len(rank)), i)
             for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])


def pytest_xdist_make_scheduler(config, log):
    """How `make test` spreads tests over its pytest-xdist workers (`--dist loadfile`): a test
    file runs whole in one worker (its module fixtures are built once), and the test files
    naming an INT8 fixture together in one (the session's INT8 calibration is made once).

    NOTE: xdist's own `--dist loadgroup` cannot do this with pytest 9 (the group it appends to
    `item._nodeid` is not in `item.nodeid` any more, so every test was scheduled alone and both
    workers built the same fixtures); a scheduler of our own reads only node ids."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    int8_files = _int8_files(Path(config.rootpath))

    class FilesAndInt8(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "int8" if path in int8_files else path

        def schedule(self) -> None:
            # NOTE: in the collection's order (slow files first), not xdist's default of the
            # units with the most tests first (which put the slowest files last).
            self.config.option.loadscopereorder = False
            super().schedule()

    return FilesAndInt8(config, log)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """Where the session checkpoint and the graphs built from it are kept, shared by every
    pytest-xdist worker of this run (their common base directory) and, under `make test`, by
    its two pytest runs too (the directory in MULTIHEAD_TEST_SHARED_DIR): the first process to
    need one makes it while holding a lock (`_exclusive`), the others then use or import it."""
    root = os.environ.get(SHARED_DIR_ENV)
    if root:
        path = Path(root)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "shared"
    else:
        path = tmp_path_factory.mktemp("shared")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive(shared_dir: Path, name: str):
    """Holds the lock `name` of the shared directory (other processes wait for it)."""
    with open(shared_dir / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def trunk_checkpoint(shared_dir) -> str:
    """Prefix of a seed-0 random checkpoint in the official layout, written by `init-trunk`.

    Like the official file it holds the trunk, the 1001-way Logits and the AuxLogits. Written
    once per run (`shared_dir`): the directory appears whole or not at all.
    """
    from cli.main import main

    directory = shared_dir / "trunk"
    # The demo trunk's file name: /readyz then reports "demo (seeded random weights)".
    out = directory / "demo_inception_v4.ckpt"
    with _exclusive(shared_dir, "trunk"):
        if not directory.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=".trunk-", dir=shared_dir))
            assert main(["init-trunk", str(tmp / out.name), "--seed", "0"]) == 0
            os.replace(tmp, directory)
    return str(out)


@pytest.fixture(scope="session")
def trunk(trunk_checkpoint, shared_dir):
    """The session's one real Trunk, built with the Logits layer for the slim-import tests."""
    from backbone import Trunk

    # NOTE: its graph is saved in the graph cache next to the checkpoint, as `serve` keeps it:
    # later trunks with the Logits layer (and the other workers' session trunks) import it
    # instead of building it again.
    with _exclusive(shared_dir, "logits-graph"):
        t = Trunk.from_checkpoint(trunk_checkpoint, with_logits=True,
                                  graph_cache_dir=graph_cache_of(trunk_checkpoint))
    yield t
    t.close()


@pytest.fixture(scope="session")
def serving_graph_cache(trunk_checkpoint, shared_dir) -> Path:
    """The graph `serve` builds from the session checkpoint (no Logits layer), saved where
    `serve` looks for it: every server and Ray replica started from the checkpoint then imports
    it (about 1 s) instead of building it (about 10-15 s on 2 cores). Built once per run."""
    cache = graph_cache_of(trunk_checkpoint)
    done = shared_dir / "serving-graph.done"
    with _exclusive(shared_dir, "serving-graph"):
        if not done.exists():
            from backbone import Trunk

            Trunk.from_checkpoint(trunk_checkpoint, warmup_batch_sizes=(),
                                  graph_cache_dir=cache).close()
            done.touch()
    return cache
