"""Fixtures for the service tests: a real store, real heads, the session's real trunk, real
servers on loopback (all defined in tests/support/servers.py)."""
from tests.support.servers import (  # noqa: F401 - fixtures, used by name
    features_of,
    jpegs,
    make_client,
    shared_client,
    shared_server,
    store,
)
