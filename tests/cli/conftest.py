"""Fixtures of the CLI tests: real servers on loopback around the session's trunk
(tests/support/servers.py) and a store location of each backend (tests/support/stores.py)."""
from tests.support.servers import (  # noqa: F401 - fixtures, used by name
    features_of,
    jpegs,
    make_client,
    shared_client,
    shared_server,
    store,
)
from tests.support.stores import location, pg_url  # noqa: F401 - fixtures, used by name
