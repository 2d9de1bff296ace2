"""The directory backend (the default, for one machine): SQLite registry + head files.

Layout of a store directory (default `checkpoints/`):

    <root>/registry.sqlite           bot_id -> active version, versions, history, tenants,
                                     keys, audit (WAL)
    <root>/registry.lock             flock serialising writers across processes
    <root>/processes.sqlite          the serving processes' leases (`store.directory.leases`)
    <root>/heads/<bot_id>/v<N>/      one immutable head version (see `heads.files`)
    <root>/trunk/                    the trunk checkpoint (not ours)

A registration, holding the writer lock: writes the files into `heads/<bot_id>/.tmp-*`, fsyncs
them, renames the directory to `v<N>`, fsyncs the parent, and only then commits the registry
row. A crash before the commit leaves an unreferenced directory that no reader ever sees and
that the next registration of that bot sweeps away; version numbers are never reused.
Nothing is created on disk until the first write. Other processes' changes are seen through
`PRAGMA data_version`, polled.
"""
from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

from store.backend import SQLITE, Backend
from store.directory.accounts import DirectoryAccounts
from store.directory.blobs import DirectoryBlobs
from store.directory.bots import DirectoryBots
from store.directory.leases import DirectoryLeases
from store.directory.registry import Registry

REGISTRY_NAME = "registry.sqlite"
LOCK_NAME = "registry.lock"


class DirectoryBackend(Backend):
    """A store directory: `registry.sqlite` plus `heads/<bot_id>/v<N>/` version directories.

    Attributes:
        root, heads_dir: the store directory and its `heads/`.
        registry: the SQLite registry every part reads and writes through.
    """

    kind = SQLITE
    # NOTE: a locked or failing registry must not make every bot unknown.
    read_errors = (sqlite3.OperationalError,)

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.registry = Registry(self.root / REGISTRY_NAME, self.root / LOCK_NAME)
        self.blobs = DirectoryBlobs(self.root)
        self.heads_dir = self.blobs.heads_dir
        self.bots = DirectoryBots(self.registry, self.blobs)
        self.accounts = DirectoryAccounts(self.registry, self.bots, self.blobs)
        self.leases = DirectoryLeases(self.root)

    def describe(self) -> str:
        return str(self.root)

    def data_version(self) -> object:
        # `PRAGMA data_version`: changes whenever another connection committed.
        return self.registry.data_version()

    def on_change(self, callback: Callable[[], None]) -> None:
        pass  # nobody tells a directory store of a change: the data version is polled

    def close(self) -> None:
        self.leases.close()
        self.registry.close()
