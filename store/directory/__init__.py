"""The directory backend (the default, for one machine): a SQLite registry and immutable head
version directories under one store directory. Built like the PostgreSQL backend (`store.pg`):

    backend.py    DirectoryBackend: the parts composed, the data version, closing
    registry.py   the SQLite registry (WAL): its tables rendered from `store.schema`, its
                  read and write transactions
    bots.py       the bots part: registry rows, each write one transaction under the writer lock
    blobs.py      the blobs part: one immutable directory per version
    accounts.py   the accounts part: `accounts.rows` in the registry's transactions
    leases.py     the leases part: the serving processes' leases, in processes.sqlite

The on-disk format of one head version (checkpoint, labels, manifest) is `heads.files`, which
the PostgreSQL backend uses too when it reads a head out of a checkpoint.
"""
from store.directory.backend import DirectoryBackend

__all__ = ["DirectoryBackend"]
