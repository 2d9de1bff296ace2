"""Where the bots are kept: one `HeadStore` over a backend (a directory with a SQLite registry,
the default; or PostgreSQL, shared by many machines), with the resident cache of heads and
the snapshot its lookups answer from.

    store = open_store("checkpoints")              # or "postgresql://user@host:5432/db"
    store.register("acme", weights, biases, ["cat", "dog"])    # -> version 1
    head = store.get("acme")

psycopg is imported only for a PostgreSQL store.
"""
from store.bots import BotInfo
from store.errors import InvalidStoreLocation, StoreError, StoreUnavailable, UnknownVersion
from store.front import HeadStore, open_store
from store.snapshot import StoreSnapshot

__all__ = ["BotInfo", "HeadStore", "InvalidStoreLocation", "StoreError", "StoreSnapshot",
           "StoreUnavailable", "UnknownVersion", "open_store"]
