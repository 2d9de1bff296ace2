"""The service tests' fixtures (a real store, the session's real trunk, a real server)."""
from tests.service.conftest import make_client, store  # noqa: F401 - fixtures, used by name
