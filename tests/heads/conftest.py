"""Fixtures of the heads tests. Pure-logic tests never touch the trunk; the trunk ones use the
session-wide `trunk` / `trunk_checkpoint` fixtures of tests/conftest.py."""
from __future__ import annotations

import pytest

from heads import HeadStore


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(store_dir):
    s = HeadStore(store_dir)
    yield s
    s.close()
