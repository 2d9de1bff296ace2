"""Session-wide fixtures: ONE real Inception-V4 trunk per test session.

The trunk checkpoint is written once (seeded random weights in the official slim layout, the
same file `multihead init-trunk` writes) and the graph is built once; every test that needs
features shares that `Trunk`. Keep the number of images pushed through it small and batched:
on 2 CPU cores one image costs about a quarter of a second.
"""
from __future__ import annotations

import pytest


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

    t = Trunk.from_checkpoint(trunk_checkpoint, with_logits=True)
    yield t
    t.close()
