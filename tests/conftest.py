"""Session-wide fixtures: ONE real Inception-V4 trunk per test session (and ONE real INT8
calibration of it, tests/support/int8.py).

The trunk checkpoint is written once (seeded random weights in the official slim layout, the
same file `multihead init-trunk` writes) and the graph is built once; every test that needs
features shares that `Trunk`. Keep the number of images pushed through it small and batched:
on 2 CPU cores one image costs about a quarter of a second.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.backbone.helpers import graph_cache_of
from tests.support.int8 import (  # noqa: F401 - fixtures, used by name
    int8_calibrated,
    int8_images,
    int8_trunk,
)
from tests.support.postgres import pg_server  # noqa: F401 - a fixture, used by name

INT8_FIXTURES = frozenset({"int8_calibrated", "int8_trunk", "int8_images"})


def pytest_collection_modifyitems(config, items):
    """Where each test runs under pytest-xdist (`make test`: `--dist loadgroup`): a test file
    runs whole in one worker (its module fixtures are built once), and every file that uses the
    session's INT8 calibration runs in the same worker, so it is made once, not per worker."""
    int8_files = {item.path for item in items
                  if INT8_FIXTURES & set(getattr(item, "fixturenames", ()))}
    for item in items:
        group = "int8" if item.path in int8_files else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def trunk_checkpoint(tmp_path_factory) -> str:
    """Prefix of a seed-0 random checkpoint in the official layout, written by `init-trunk`.

    Like the official file it holds the trunk, the 1001-way Logits and the AuxLogits.
    """
    from service.cli.main import main

    # The demo trunk's file name: /readyz then reports "demo (seeded random weights)".
    out = str(tmp_path_factory.mktemp("trunk") / "demo_inception_v4.ckpt")
    assert main(["init-trunk", out, "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="session")
def trunk(trunk_checkpoint):
    """The session's one real Trunk, built with the Logits layer for the slim-import tests."""
    from backbone import Trunk

    # NOTE: its graph is saved in the graph cache next to the checkpoint, as `serve` keeps it:
    # later trunks with the Logits layer import it instead of building it again.
    t = Trunk.from_checkpoint(trunk_checkpoint, with_logits=True,
                              graph_cache_dir=graph_cache_of(trunk_checkpoint))
    yield t
    t.close()


@pytest.fixture(scope="session")
def serving_graph_cache(trunk_checkpoint) -> Path:
    """The graph `serve` builds from the session checkpoint (no Logits layer), saved where
    `serve` looks for it: every server and Ray replica started from the checkpoint then imports
    it (about 1 s) instead of building it (about 10-15 s on 2 cores)."""
    from backbone import Trunk

    cache = graph_cache_of(trunk_checkpoint)
    Trunk.from_checkpoint(trunk_checkpoint, warmup_batch_sizes=(), graph_cache_dir=cache).close()
    return cache
