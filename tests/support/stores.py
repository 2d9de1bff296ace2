"""Store fixtures, imported by the conftest of each test folder that uses them (tests/heads,
tests/accounts, tests/store, tests/cli). `store` is a directory store (SQLite). `location` runs a test once per backend,
`sqlite` (a directory path) and `postgresql` (a fresh database of the session's one throw-away
PostgreSQL server, `pg_server` of tests/support/postgres.py); `any_store` is a store open on it.
"""
from __future__ import annotations

import itertools
import os

import pytest

from store import HeadStore, open_store

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)]


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(store_dir):
    s = HeadStore(store_dir)
    yield s
    s.close()


_databases = itertools.count()


@pytest.fixture
def pg_url(pg_server):
    """A URL of a new, empty database (CREATE DATABASE from template0), dropped afterwards."""
    import psycopg

    pg_server.ensure_running()
    name = f"heads_{os.getpid()}_{next(_databases)}"
    with psycopg.connect(pg_server.url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    yield pg_server.url_for(name)
    pg_server.ensure_running()  # a test that stopped the server and failed before restarting
    with psycopg.connect(pg_server.url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture(params=BACKENDS)
def location(request, tmp_path) -> str:
    """A store location of each backend: a directory path, then a PostgreSQL URL."""
    if request.param == "sqlite":
        return str(tmp_path / "store")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def any_store(location):
    s = open_store(location)
    yield s
    s.close()
