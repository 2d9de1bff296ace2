"""`PgBackend`: a PostgreSQL store's parts composed over one pool of connections, its change
counter, and the LISTEN/NOTIFY thread that moves it (`store.pg.listener`)."""
from __future__ import annotations

import threading
from collections.abc import Callable

from store.backend import POSTGRESQL, Backend, redact_url
from store.errors import StoreUnavailable
from store.pg.accounts import PgAccounts
from store.pg.blobs import PgBlobs
from store.pg.bots import PgBots
from store.pg.database import Database
from store.pg.leases import PgLeases
from store.pg.listener import Changes, Listener
from store.pg.pool import Pool


class PgBackend(Backend):
    """A head store in a PostgreSQL database (see `store.pg`)."""

    kind = POSTGRESQL
    read_errors = (StoreUnavailable,)
    # Of the listener, read when it starts (the first `data_version()`).
    reconnect_min_s = 0.1
    reconnect_max_s = 2.0
    poll_s = 5.0

    def __init__(self, url: str) -> None:
        self._where = redact_url(url)
        self._pool = Pool(url, self._where)
        self._changes = Changes(self._pool, self._where)
        self._lock = threading.Lock()  # guards the two below
        self._closed = False
        self._listener: Listener | None = None
        db = Database(self._pool, self._changes)
        self.blobs = PgBlobs(db)
        self.bots = PgBots(db, self.blobs)
        self.accounts = PgAccounts(db, self.bots)
        self.leases = PgLeases(db)

    def describe(self) -> str:
        return self._where

    def data_version(self) -> object:
        with self._lock:
            if self._closed:
                raise RuntimeError("the head store is closed")
            if self._listener is None:
                self._listener = Listener(self._pool, self._changes, poll_s=self.poll_s,
                                          reconnect_min_s=self.reconnect_min_s,
                                          reconnect_max_s=self.reconnect_max_s)
                self._listener.start()
        return self._changes.version()

    def on_change(self, callback: Callable[[], None]) -> None:
        self._changes.subscribe(callback)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()
        self._pool.close()
