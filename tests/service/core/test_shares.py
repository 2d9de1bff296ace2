"""The weighted per-tenant shares (`service.core.shares.Shares`) the sockets, the in-flight
bytes and the gRPC calls are divided by, and the byte budget over them
(`service.core.admission`): pure logic, no server."""
from __future__ import annotations

import pytest

from service.core.admission import ByteBudget, Reservation
from service.core.errors import InflightShareExceeded, Overloaded
from service.core.shares import Shares


class OverShare(Exception):
    pass


class Full(Exception):
    pass


def shares(capacity: int, weights: dict[str, float] | None = None, **kwargs) -> Shares:
    return Shares(capacity, lambda tenant: (weights or {}).get(tenant, 1.0),
                  over_share=lambda tenant, held, share: OverShare(tenant, held, share),
                  full=Full, **kwargs)


def test_a_tenant_alone_takes_everything_and_its_share_follows_the_weights():
    s = shares(100, {"big": 3.0})
    s.take("big", "b1", 100)
    assert s.share("big") == 100 and s.used == 100
    assert s.share("small") == 25 and s.share("big", newcomer="small") == 75
    with pytest.raises(Full):  # alone and full: the server is, not the tenant
        s.take("big", "b2", 1)
    assert s.held("big") == 100 and s.holders("big") == 1


def test_a_tenant_alone_is_over_its_share_when_the_user_says_so():
    s = shares(2, alone_over_share=True)
    s.take("a", 1, 1)
    s.take("a", 2, 1)
    with pytest.raises(OverShare):
        s.take("a", 3, 1)


def test_beyond_its_share_a_tenant_holding_something_is_refused_one_holding_nothing_is_not():
    s = shares(100)
    s.take("a", "a1", 40)
    s.take("b", "b1", 30)
    with pytest.raises(OverShare) as info:
        s.take("a", "a2", 20)  # 40 + 20 > 50
    assert info.value.args == ("a", 40, 50)
    assert s.held("a") == 40 and s.used == 70  # nothing taken
    s.take("c", "c1", 30)  # holds nothing: admitted whatever its share (33)
    assert s.used == 100


def test_a_newcomer_within_its_share_pushes_out_the_newest_pushable_of_the_most_over():
    s = shares(100)
    pushed = []
    s.take("a", "a1", 30, push=lambda: pushed.append("a1"))
    s.take("a", "a2", 30)  # not pushable
    s.take("a", "a3", 20, push=lambda: pushed.append("a3"))
    s.take("b", "b1", 20, push=lambda: pushed.append("b1"))
    # Full; c (share 33 among a, b, c) needs 25: a (80 of 33) is the most over; its newest
    # pushable holder goes first, then its next one, skipping the one that cannot be pushed.
    pushes = s.take("c", "c1", 25)
    for push in pushes:
        push()
    assert pushed == ["a3", "a1"] and s.held("a") == 30 and s.held("b") == 20
    assert s.used == 75 and s.held("c") == 25
    s.release("a", "a1")  # pushed out already: nothing to give back
    assert s.used == 75


def test_when_no_room_can_be_made_nothing_is_pushed_and_the_newcomer_finds_it_full():
    s = shares(100)
    s.take("a", "a1", 60)  # over its share, but not pushable
    s.take("b", "b1", 30, push=lambda: None)  # within its share (33 with c)
    with pytest.raises(Full):
        s.take("c", "c1", 20)
    assert s.used == 90 and s.holders("b") == 1


def test_a_holder_grows_and_gives_back_in_parts():
    s = shares(100)
    s.take("", None, 10)
    s.take("", None, 15)
    assert s.held("") == 25 and s.holders("") == 1
    assert s.release("", None, 10) == 10 and s.held("") == 15
    assert s.release("", None) == 15 and s.used == 0 and s.holders("") == 0


def test_the_byte_budget_refuses_a_tenant_beyond_its_share_and_pushes_out_a_body_unread():
    budget = ByteBudget(100, weight=lambda tenant: 1.0)
    reading, read = Reservation(budget, "a"), Reservation(budget, "a")
    read.take(40)  # its body is read: in memory until the answer, never pushed out
    reading.take(50)
    reading.allow_push()
    with Reservation(budget, "b") as b:
        b.take(10)
        with pytest.raises(InflightShareExceeded):
            Reservation(budget, "a").take(5)  # holds 90, its share is 50 now
        b.take(40)  # b within its share (50): a's unread body makes room
        assert isinstance(reading.pushed, InflightShareExceeded)
        assert "made room" in str(reading.pushed)
        assert budget.used_bytes == 90 and budget.held("a") == 40
        with pytest.raises(InflightShareExceeded):
            reading.check()  # its next chunk
        with pytest.raises(Overloaded) as info:
            Reservation(budget, "c").take(20)  # only a's read body is over: 503
        assert not isinstance(info.value, InflightShareExceeded)
    read.close()
    reading.close()
    assert budget.used_bytes == 0


def test_a_tenant_alone_filling_the_byte_budget_is_told_its_share_requests_without_one_busy():
    """What fills the budget is a keyed tenant's own: 429 inflight_share (a clear 4xx for a
    hostile tenant); requests without a tenant (operator, --auth none) find the server busy."""
    budget = ByteBudget(100, weight=lambda tenant: 1.0)
    with Reservation(budget, "a") as mine:
        mine.take(90)
        with pytest.raises(InflightShareExceeded):
            mine.take(20)
    with Reservation(budget, "") as anyone:
        anyone.take(90)
        with pytest.raises(Overloaded) as info:
            anyone.take(20)
        assert not isinstance(info.value, InflightShareExceeded)
