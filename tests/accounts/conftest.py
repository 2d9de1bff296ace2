"""Fixtures of the accounts tests: a directory store, and a store of each backend (tests/support/stores.py)."""
from tests.support.stores import (  # noqa: F401 - fixtures, used by name
    any_store,
    location,
    pg_url,
    store,
    store_dir,
)
