"""Store fixtures, imported by the conftest of each test folder that uses them (tests/heads,
tests/accounts, tests/store, tests/cli). `store` is a directory store (SQLite). `location` runs a test once per backend,
`sqlite` (a directory path) and `postgresql` (a fresh database of the session's one throw-away
PostgreSQL server, `pg_server` of tests/support/postgres.py); `any_store` is a store open on it.
`BackendReads` counts what a store asks its backend, and can block its registry reads.
"""
from __future__ import annotations

import itertools
import os
import threading

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


class BackendReads:
    """What a store asks its backend, by thread, with a gate in front of its registry reads.

    Every read of the bots and accounts parts, `data_version` and `blobs.load` are recorded as
    (thread id, "part.method"). While the gate is closed, a registry read (a part's rows, not
    the data version, not a blob) waits at it: `blocked` is set once one does. `close(after_s)`
    opens it again by itself after `after_s`, so that a test whose rule is broken fails on what
    it asserts instead of hanging.
    """

    REGISTRY_READS = {"bots": ("active_map", "candidates", "rows", "history"),
                      "accounts": ("tenants", "tenant_limits", "keys", "audit")}

    def __init__(self, store, monkeypatch) -> None:
        self.calls: list[tuple[int, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()
        self._timer: threading.Timer | None = None
        backend = store._backend
        for part, names in self.REGISTRY_READS.items():
            for name in names:
                self._wrap(monkeypatch, getattr(backend, part), name, f"{part}.{name}",
                           gated=True)
        self._wrap(monkeypatch, backend.blobs, "load", "blobs.load", gated=False)
        self._wrap(monkeypatch, backend, "data_version", "data_version", gated=False)

    def _wrap(self, monkeypatch, owner, name: str, label: str, *, gated: bool) -> None:
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            self.calls.append((threading.get_ident(), label))
            if gated and not self.gate.is_set():
                self.blocked.set()
                self.gate.wait()
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    def by(self, thread_id: int | None = None) -> list[str]:
        """The calls made on `thread_id` (default: the calling thread), in order."""
        thread_id = threading.get_ident() if thread_id is None else thread_id
        return [label for ident, label in self.calls if ident == thread_id]

    def close(self, after_s: float) -> None:
        self.blocked.clear()
        self.gate.clear()
        self._timer = threading.Timer(after_s, self.gate.set)
        self._timer.daemon = True
        self._timer.start()

    def open(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.gate.set()
