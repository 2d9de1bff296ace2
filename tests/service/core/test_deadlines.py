"""A request's deadline (`service.core.deadlines`): what a client may ask for, and the one
deadline a request's task keeps (its scope, tightened by a body's parameter)."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from service.core import deadlines
from service.core.errors import InvalidDeadline, error_status, grpc_status


@pytest.mark.parametrize("value", ["", "abc", "0", "-1", "nan", "inf", "1e9", "3600000.5",
                                   True, None, [5], 0, -0.5, math.inf])
def test_a_malformed_deadline_is_400_invalid_deadline(value):
    with pytest.raises(InvalidDeadline) as refused:
        deadlines.parse_ms(value, "X-Multihead-Deadline-Ms")
    assert error_status(refused.value)[:2] == (400, "invalid_deadline")
    assert grpc_status(refused.value) == ("INVALID_ARGUMENT", "invalid_deadline")
    assert "X-Multihead-Deadline-Ms" in str(refused.value)


@pytest.mark.parametrize(("value", "ms"), [("250", 250.0), (" 0.5 ", 0.5), (3600000, 3600000.0),
                                           (12.5, 12.5), ("1e3", 1000.0)])
def test_a_deadline_is_milliseconds_up_to_an_hour(value, ms):
    assert deadlines.parse_ms(value, "x") == ms


def test_the_header_is_read_from_the_request_start():
    assert deadlines.from_headers({}) is None
    assert deadlines.from_headers({deadlines.HEADER: "1500"}, start=10.0) == 11.5
    with pytest.raises(InvalidDeadline):
        deadlines.from_headers({deadlines.HEADER: "soon"})


async def test_a_request_keeps_the_soonest_of_its_deadlines_in_its_task():
    far = time.monotonic() + 60
    assert deadlines.earliest(far) == far  # no request deadline
    with deadlines.scope(time.monotonic() + 5):
        assert deadlines.earliest(far) < far
        deadlines.tighten(30_000)  # later than the header's: kept as it was
        kept = deadlines.earliest(far)
        assert kept == pytest.approx(time.monotonic() + 5, abs=0.5)
        deadlines.tighten(100)
        assert deadlines.earliest(far) < kept

        async def seen() -> float:  # a task the request starts sees it
            return deadlines.earliest(far)

        assert await asyncio.create_task(seen()) == deadlines.earliest(far)
    assert deadlines.earliest(far) == far  # the scope ended
