"""The suite's Hypothesis profile (tests/conftest.py): no timing is asserted, so an example
slowed by a busy machine is no failure (Hypothesis' own default fails it after 200 ms)."""
from __future__ import annotations

import time

import hypothesis
from hypothesis import given
from hypothesis import strategies as st


@hypothesis.settings(max_examples=2, database=None)
@given(st.integers())
def test_a_slow_example_is_no_failure(n):
    time.sleep(0.25)  # over Hypothesis' default deadline of 200 ms
    assert isinstance(n, int)
