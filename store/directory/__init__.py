"""The directory backend (the default, for one machine): a SQLite registry and immutable head
version directories under one store directory. Built like the PostgreSQL backend (`store.pg`):

    backend.py    DirectoryBackend: the files and rows of each read and write
    registry.py   the SQLite registry (WAL): its tables rendered from `store.schema`

The on-disk format of one head version (checkpoint, labels, manifest) is `heads.files`, which
the PostgreSQL backend uses too when it reads a head out of a checkpoint.
"""
from store.directory.backend import DirectoryBackend

__all__ = ["DirectoryBackend"]
