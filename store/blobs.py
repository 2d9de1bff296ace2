"""The blobs part of a store backend: the tensors and labels of each stored version.

A directory store keeps them as one immutable directory per version (`heads.files`: a TF
checkpoint, the labels, a manifest of sha256s); PostgreSQL as three sha256-checked rows per
version (`store.pg.blobs`). Either way a version's blobs are written inside the registry's write
transaction that adds its rows (`store.bots`), so that nobody ever sees a version without its
blobs, and a head whose stored bytes do not match their sha256 fails to load.

`Tx` is the backend's write transaction (a `store.directory.registry.Transaction`, a psycopg
connection inside `conn.transaction()`): only the bots part of the same backend calls the
writing methods, from inside its own transactions.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

import numpy as np

from heads.head import Head
from store.bots import Step

Tx = TypeVar("Tx")


class Blobs(ABC, Generic[Tx]):
    """Where the tensors and labels of a store's versions are kept. Thread-safe."""

    @abstractmethod
    def load(self, bot_id: str, version: int) -> Head:
        """Read one version and check every stored blob against its sha256.

        Raises:
            HeadLoadError: missing, unreadable or corrupt.
        """

    @abstractmethod
    def write(self, tx: Tx, bot_id: str, version: int, weights: np.ndarray,
              biases: np.ndarray, labels: tuple[str, ...], *, created: str, source: str,
              step: Step) -> str:
        """Store the blobs of a new version (already validated) in write transaction `tx`,
        calling `step(name)` between the steps; they count once `tx` commits. Returns the
        version's digest (`accounts.tenants.combine_digests`) for its audit record. What a
        failure leaves behind is gone by the time this raises."""

    @abstractmethod
    def digest(self, tx: Tx, bot_id: str, version: int) -> str | None:
        """The audit digest of a stored version (None if its blobs cannot be read)."""

    @abstractmethod
    def stored(self, bot_id: str, versions: list[int]) -> list[int]:
        """Those of `versions` (registered ones) whose blobs are stored, in order."""

    @abstractmethod
    def sweep(self, bot_id: str, registered: set[int]) -> list[int]:
        """Under the writer lock, before a new version of `bot_id` is written: delete what a
        crashed writer left (blobs of no registered version) and return the version numbers
        whose blobs remain, so that a new number goes above all of them."""

    @abstractmethod
    def drop(self, bot_id: str, version: int | None = None) -> None:
        """Once the transaction that deleted the rows of `version` (of every version of the
        bot if None) has committed, or the one that wrote it has failed: delete its blobs,
        unless they went with that transaction."""
