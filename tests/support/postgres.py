"""The session's one throw-away PostgreSQL server (`bench.pgserver.PgServer`: the benchmark
starts the same kind), shared by the store tests and the Ray tests."""
from __future__ import annotations

import pytest

from bench.pgserver import PgServer, PgServerError


@pytest.fixture(scope="session")
def pg_server():
    """One PostgreSQL 15 server for the whole session, started on first use. Missing server
    binaries FAIL the tests that need it (a skip would hide a missing feature). A test that
    stops or kills it starts it again (`ensure_running`)."""
    try:
        server = PgServer()
    except PgServerError as exc:
        problem = str(exc)
    else:
        problem = None
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    yield server
    server.cleanup()
