"""Tenant limits for the tests: what a limit accepts, said once more independently of
`accounts.tenants.validate_limit`, and the values hypothesis tries on the validator, the CLI and
the REST codec."""
from __future__ import annotations

import math
import numbers

import numpy as np
from hypothesis import strategies as st

from accounts.tenants import LIMIT_NAMES, LIMITS


def accepted_limit(name: str, value: object) -> bool:
    """None, or a real number (not a bool) in (0, maximum], whole for a whole number limit."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    limit = LIMITS[name]
    in_range = 0 < value <= limit.maximum  # False for NaN
    return in_range and (not limit.integer or value == math.floor(value))


# Values around every bound, NaN and the infinities, huge ints, numpy scalars, fractions, and
# things that are no number (bools, text, bytes, containers, decimals).
EDGES = [0, 0.0, -0.0, 1, 1.0, 0.5, 1000, 1000.0, 1000.5, 1e6, 1e6 + 0.5, 10**6 + 1, -1,
         10**400, math.nan, math.inf, -math.inf, 5e-324]
LIMIT_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-3, max_value=2 * 10**6),
    st.floats(), st.floats(min_value=-1.0, max_value=2e6), st.sampled_from(EDGES),
    st.builds(np.float32, st.floats(width=32)), st.builds(np.int64, st.integers(-5, 10**7)),
    st.fractions(), st.decimals(allow_nan=True), st.text(max_size=12), st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.none(), max_size=1))
# The JSON-able ones (what a REST body can carry; NaN and Infinity as Python's json writes them).
JSON_LIMIT_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-3, max_value=2 * 10**6),
    st.floats(), st.floats(min_value=-1.0, max_value=2e6), st.sampled_from(EDGES),
    st.text(max_size=12), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.none(), max_size=1))


def in_range(name: str) -> st.SearchStrategy:
    """Values limit `name` accepts (None, and numbers in its range)."""
    limit = LIMITS[name]
    whole = st.integers(min_value=1, max_value=int(limit.maximum))
    if limit.integer:
        return st.one_of(st.none(), whole, whole.map(float))
    return st.one_of(st.none(), whole, st.floats(min_value=0, max_value=limit.maximum,
                                                 exclude_min=True))


# JSON objects of limits: often all good (applied), often one bad value or an unknown field.
LIMITS_OBJECTS = st.one_of(
    st.fixed_dictionaries({}, optional={n: in_range(n) for n in LIMIT_NAMES}),
    st.fixed_dictionaries({}, optional={n: st.one_of(in_range(n), JSON_LIMIT_VALUES)
                                        for n in LIMIT_NAMES}),
    st.dictionaries(st.one_of(st.sampled_from(LIMIT_NAMES), st.text(max_size=8)),
                    JSON_LIMIT_VALUES, max_size=4))
