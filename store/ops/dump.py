"""The neutral form of a store's data, the same for both backends and for an archive.

    Snapshot   what a source gives: `rows` ({table: [row dicts]}, every data table, labels as
               a list), read from ONE consistent snapshot of the source, and `head(bot, v)`,
               the tensors and labels of a version of that snapshot (checked against their
               sha256 on the way)
    Target     what a destination does: take a copy's marker, write a few bots (each one's
               blobs, then its rows; all in one transaction), finish (the tenants, keys,
               history and audit in one transaction, the marker dropped)

The data tables are `store.schema.TABLES` but `state`, `blobs` (the heads travel as `Head`s)
and `serving_processes` (live process state). While a copy is under way the destination holds
the marker tables `MARKER` (the source's identity) and `MARKER_BOTS` (each bot copied, with
the fingerprint of its rows): a store with them is incomplete (`check` fails), and `--resume`
goes on from them.
"""
from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from heads.errors import HeadLoadError, InvalidHead
from heads.head import Head, validate_labels
from store.schema import BLOB_NAMES, JSON, SERIAL, TABLES, Table

DATA_TABLES: tuple[Table, ...] = tuple(
    t for t in TABLES if t.name not in ("state", "blobs", "serving_processes"))
# The rows of one bot: written together with its blobs, in one transaction.
BOT_TABLES = ("versions", "bots", "owners", "candidates")
# Everything else: written by the copy's last transaction.
GLOBAL_TABLES = tuple(t.name for t in DATA_TABLES if t.name not in BOT_TABLES)
# Tables whose id the database gives (kept as they are by a copy).
SERIAL_TABLES = tuple(t.name for t in DATA_TABLES if any(c.type == SERIAL for c in t.columns))

MARKER = "ops_copy"
MARKER_BOTS = "ops_copy_bots"
MARKER_STATEMENTS = (f"CREATE TABLE IF NOT EXISTS {{p}}{MARKER} (source TEXT NOT NULL, "
                     "started TEXT NOT NULL)",
                     f"CREATE TABLE IF NOT EXISTS {{p}}{MARKER_BOTS} (bot_id TEXT PRIMARY KEY, "
                     "fingerprint TEXT NOT NULL)")

_FLOAT = np.dtype("<f4")


class CopyRefused(Exception):
    """Base of the refusals of `store.ops` (a `StoreError` in `store.ops.copy`)."""


def table(name: str) -> Table:
    return next(t for t in DATA_TABLES if t.name == name)


def columns(name: str) -> list[str]:
    return [c.name for c in table(name).columns]


def json_columns(name: str) -> set[str]:
    return {c.name for c in table(name).columns if c.type == JSON}


@dataclass(frozen=True)
class BotRows:
    """The rows of one live bot: its versions (ascending), its bots row, owner and candidate
    rows (None if it has none)."""

    bot_id: str
    versions: list[dict]
    bot: dict
    owner: dict | None
    candidate: dict | None

    def fingerprint(self) -> str:
        """Changes whenever any of the bot's rows does (a resumed copy re-copies it then)."""
        text = json.dumps([self.versions, self.bot, self.owner, self.candidate],
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def group_bots(rows: dict[str, list[dict]]) -> list[BotRows]:
    """The live bots of `rows` (those with a bots row), ordered by id (byte order)."""
    by_bot: dict[str, list[dict]] = {}
    for v in rows["versions"]:
        by_bot.setdefault(v["bot_id"], []).append(v)
    owners = {r["bot_id"]: r for r in rows["owners"]}
    candidates = {r["bot_id"]: r for r in rows["candidates"]}
    out = []
    for bot in sorted(rows["bots"], key=lambda r: r["bot_id"].encode("utf-8")):
        b = bot["bot_id"]
        out.append(BotRows(b, sorted(by_bot.get(b, []), key=lambda r: r["version"]), bot,
                           owners.get(b), candidates.get(b)))
    return out


def counts(rows: dict[str, list[dict]]) -> dict[str, int]:
    """{table: row count} of every data table."""
    return {t.name: len(rows.get(t.name, [])) for t in DATA_TABLES}


class Snapshot(ABC):
    """One consistent read of a whole store (or of an archive). Close it when done.

    Attributes:
        identity: names the source for a resumed copy (its location, an archive's id).
        incomplete: the source a copy into this store was interrupted from (None: none was).
        rows: {table: [row dicts]} of every `DATA_TABLES` table (a table an older store lacks
            is empty).
    """

    identity: str
    incomplete: str | None = None
    rows: dict[str, list[dict]]

    @abstractmethod
    def head(self, bot_id: str, version: int) -> Head:
        """The head of a version in this snapshot. Raises HeadLoadError (missing, corrupt)."""

    def orphans(self) -> list[str]:
        """What the store holds that no row points to (blobs of no version, leftovers)."""
        return []

    def remove_orphans(self) -> list[str]:
        """Delete the orphans (those still orphans now, under the writer lock); returns them."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Release the snapshot."""

    def bots(self) -> list[BotRows]:
        return group_bots(self.rows)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Target(ABC):
    """The destination of a copy: each method one transaction of its own (a bot is never
    split between two)."""

    @abstractmethod
    def describe(self) -> str:
        """The location for messages (never a password)."""

    @abstractmethod
    def progress(self) -> tuple[str | None, dict[str, str]] | None:
        """None if the store is empty; (the marker's source, {bot id: fingerprint} copied) if
        a copy into it was interrupted; (None, {}) if it holds data and no marker."""

    @abstractmethod
    def begin(self, source: str, started: str) -> None:
        """Create the store's tables (if missing) and the marker naming `source`."""

    @abstractmethod
    def write_bots(self, batch: list[tuple[BotRows, list[Head]]]) -> None:
        """In one transaction, for each bot of `batch`: whatever the store holds of it goes;
        its blobs (its heads, one per version row), then its rows and its marker row are
        written. (A few bots per transaction: a commit, and its fsync, per bot would be most
        of a copy's time.)"""

    @abstractmethod
    def drop_bot(self, bot_id: str) -> None:
        """In one transaction: the bot's rows, blobs and marker row go."""

    @abstractmethod
    def finish(self, rows: dict[str, list[dict]]) -> None:
        """In one transaction: every `GLOBAL_TABLES` table replaced by `rows`'s (ids kept,
        the id counters moved past them), the marker tables dropped."""

    @abstractmethod
    def close(self) -> None:
        """Release connections."""


# -- a head as bytes (an archive's blobs) ---------------------------------------------------------

def encode_head(head: Head) -> dict[str, bytes]:
    """{blob name: bytes} of a head: float32 little-endian, C order; labels a UTF-8 JSON array
    (the form `store.pg.blobs` keeps)."""
    return {"weights": np.ascontiguousarray(head.weights, dtype=_FLOAT).tobytes(),
            "biases": np.ascontiguousarray(head.biases, dtype=_FLOAT).tobytes(),
            "labels": json.dumps(list(head.labels), ensure_ascii=False).encode("utf-8")}


def decode_head(bot_id: str, version: int, n_classes: int, blobs: dict[str, bytes]) -> Head:
    """The head of `encode_head`'s bytes. Raises HeadLoadError."""
    label = f"head '{bot_id}' v{version}"
    try:
        missing = [name for name in BLOB_NAMES if name not in blobs]
        if missing:
            raise InvalidHead(f"blob '{missing[0]}' is missing")
        w, b = blobs["weights"], blobs["biases"]
        if len(w) % (_FLOAT.itemsize * n_classes) or len(b) != _FLOAT.itemsize * n_classes:
            raise InvalidHead("tensor sizes do not match its class count")
        weights = np.frombuffer(w, dtype=_FLOAT).reshape(-1, n_classes)
        biases = np.frombuffer(b, dtype=_FLOAT)
        labels = validate_labels(json.loads(blobs["labels"].decode("utf-8")), stored=True)
        return Head(bot_id, version, labels, weights.astype(np.float32, copy=False),
                    biases.astype(np.float32, copy=False))
    except (InvalidHead, ValueError, TypeError) as exc:
        raise HeadLoadError(f"{label}: {exc}") from None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
