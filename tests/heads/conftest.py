"""Fixtures of the heads tests: a directory store (tests/support/stores.py)."""
from tests.support.stores import store, store_dir  # noqa: F401 - fixtures, used by name
