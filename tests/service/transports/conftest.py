"""The service tests' fixtures (a real store with five bots, a real aiohttp server over the
session's trunk), shared with the transport tests."""
from tests.support.servers import make_client, store  # noqa: F401 - fixtures, by name
