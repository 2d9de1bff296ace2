"""The fuzz tests' fixtures: a real store, the session's real trunk, a real server."""
from tests.support.servers import make_client, store  # noqa: F401 - fixtures, used by name
