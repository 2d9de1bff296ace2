"""Errors of a store that cannot be reached, and of a lost Ray replica, over the protocols."""
from __future__ import annotations

import pytest

from heads import HeadLoadError
from service.core.errors import HeadUnavailable, ReplicaLost, error_body, error_status, grpc_status
from service.core.lifecycle import READY
from service.core.service import Service
from service.core.settings import Settings
from store import StoreUnavailable


def test_an_unreachable_store_is_503_with_retry_after():
    exc = StoreUnavailable("PostgreSQL store unreachable")
    assert error_status(exc) == (503, "store_unavailable", {"Retry-After": "1"})
    assert error_body(exc)["code"] == "store_unavailable"
    assert grpc_status(exc)[0] == "UNAVAILABLE"


def test_a_lost_replica_is_503_with_retry_after():
    assert error_status(ReplicaLost("gone")) == (503, "replica_lost", {"Retry-After": "1"})


class _Processes:
    def join(self):
        pass

    def count(self):
        return 1


class _Store:
    pinned = frozenset()
    processes = _Processes()

    def __init__(self, exc):
        self.exc = exc

    def get(self, bot_id):
        raise self.exc

    def key_table(self):
        return {}

    def watch(self):
        pass

    def snapshot_age_s(self):
        return 0.0

    def mark_used(self, used):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("raised,expected", [
    (StoreUnavailable("db down"), StoreUnavailable),   # retry later: 503
    (HeadLoadError("corrupt file"), HeadUnavailable),  # the server's problem: 500
])
async def test_a_head_lookup_keeps_store_unavailable_apart_from_a_broken_head(raised, expected):
    service = Service(Settings(), trunk=object(), store=_Store(raised))
    service.readiness.status = READY  # a head is looked up for a request only once ready
    with pytest.raises(expected):
        await service.bots.heads(["acme"])
    await service.close()
