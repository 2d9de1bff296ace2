"""`copy_store`: every bot (all its versions, blobs, history and candidate), the tenants and
their limits, the API keys (hashes, scopes, revocations, `last_used`) and the audit log of one
store, copied into another, empty, store of either kind.

The source is read from ONE consistent snapshot (`store.ops.dump.Snapshot`: SQLite one read
transaction under a moment of its writer lock, PostgreSQL REPEATABLE READ), while it is being
served and written. The destination (`Target`) is written so that a kill -9 at any point leaves
it detectably incomplete, never serving half a bot:

    1. the marker (`dump.MARKER`: the source's identity) is committed first;
    2. each bot's blobs, then its rows and its marker row, in one transaction (with the
       next few bots: up to `BATCH_BOTS`, `BATCH_BYTES`);
    3. the last transaction writes the tenants, keys, history and audit and drops the marker.

Until 3 commits no API key of the source works on the destination, and `check` says it is
incomplete. `resume=True` goes on with an interrupted copy of the same source: a new snapshot
is taken, the bots copied already whose rows did not change since are kept, the others (and
those gone from the source) are written again (dropped).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from accounts.tenants import utc_now
from store.backend import POSTGRESQL, parse_location
from store.errors import StoreError
from store.ops.dump import Snapshot, Target, counts

# Called with (bots done, bots in all) after each bot.
Progress = Callable[[int, int], None]

# NOTE: a test seam. With MULTIHEAD_TEST_STALL_AFTER=N, a copy, backup or restore stops for good
# after its N-th bot, having said so on stderr: the crash tests kill it there.
STALL_ENV = "MULTIHEAD_TEST_STALL_AFTER"


class StoreOpRefused(StoreError):
    """A copy, backup or restore refused before it changed anything (a destination that is not
    empty, an interrupted copy of another source, a damaged or newer archive)."""


# A transaction of a copy holds at most this many bots, and this many bytes of heads.
BATCH_BOTS = 64
BATCH_BYTES = 32 * 2**20


def stall_at() -> int | None:
    """The bot after which the test seam `STALL_ENV` stops (None: it is not set)."""
    after = os.environ.get(STALL_ENV)
    return None if after is None else int(after)


def stall(done: int) -> None:
    """The test seam `STALL_ENV`: after the `done`-th bot, stop for good."""
    if done == stall_at():
        print(f"stalled after {done} bots", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)


def open_snapshot(location: str | os.PathLike, *, must_exist: bool = False) -> Snapshot:
    """One consistent snapshot of the store at `location` (close it when done). With
    `must_exist`, a directory that does not exist is refused (a mistyped source), instead of
    read as an empty store."""
    kind, where = parse_location(location)
    if kind == POSTGRESQL:
        from store.pg.dump import PgSnapshot  # psycopg only for a PostgreSQL store

        return PgSnapshot(where)
    from store.directory.dump import DirectorySnapshot

    if must_exist and not os.path.isdir(where):
        raise StoreOpRefused(f"there is no store directory {where}")

    return DirectorySnapshot(where)


def open_target(location: str | os.PathLike) -> Target:
    kind, where = parse_location(location)
    if kind == POSTGRESQL:
        from store.pg.dump import PgTarget

        return PgTarget(where)
    from store.directory.dump import DirectoryTarget

    return DirectoryTarget(where)


@dataclass
class CopyReport:
    """What a copy (or a restore) wrote: `counts` ({table: rows}), `bots` and `versions`
    written now, `kept` (copied before an interruption and unchanged), `dropped` (copied
    before, gone from the source since)."""

    source: str
    destination: str
    counts: dict[str, int] = field(default_factory=dict)
    written: int = 0
    kept: int = 0
    dropped: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        c = self.counts
        resumed = (f" ({self.kept} kept from the interrupted copy, {self.dropped} dropped)"
                   if self.kept or self.dropped else "")
        return (f"{c.get('bots', 0)} bots ({c.get('versions', 0)} versions, "
                f"{c.get('candidates', 0)} candidates){resumed}, "
                f"{c.get('tenants', 0)} tenants, {c.get('api_keys', 0)} API keys, "
                f"{c.get('history', 0)} history and {c.get('audit', 0)} audit records "
                f"from {self.source} to {self.destination} in {self.seconds:.1f} s")


def load(snapshot: Snapshot, target: Target, *, resume: bool = False,
         progress: Progress | None = None) -> CopyReport:
    """Write `snapshot` into `target` (see the module's docstring).

    Raises:
        StoreOpRefused: the target is not empty and is not an interrupted copy of this source
            (or `resume` was not asked); the source is itself an interrupted copy.
        HeadLoadError: a head of the source is missing or corrupt (`check` it).
    """
    start = time.monotonic()
    where = target.describe()
    if snapshot.incomplete is not None:
        raise StoreOpRefused(f"the source is an interrupted copy of {snapshot.incomplete}: "
                             "finish that copy first (--resume)")
    state = target.progress()
    done: dict[str, str] = {}
    if state is not None:
        marker, done = state
        if marker is None:
            raise StoreOpRefused(f"the destination {where} is not empty: a copy or restore "
                                 "goes into an empty store (or --resume an interrupted one "
                                 "into it)")
        if marker != snapshot.identity:
            raise StoreOpRefused(f"the destination {where} holds an interrupted copy of "
                                 f"{marker}, not of {snapshot.identity}")
        if not resume:
            raise StoreOpRefused(f"the destination {where} holds an interrupted copy of "
                                 f"{marker}: finish it with --resume")
    else:
        target.begin(snapshot.identity, utc_now())
    report = CopyReport(snapshot.identity, where)
    bots = snapshot.bots()
    live = {b.bot_id for b in bots}
    for gone in sorted(set(done) - live):
        target.drop_bot(gone)
        report.dropped += 1
    batch: list = []
    batch_bytes = 0
    for i, bot in enumerate(bots, 1):
        if done.get(bot.bot_id) == bot.fingerprint():
            report.kept += 1
        else:
            heads = [snapshot.head(bot.bot_id, int(r["version"])) for r in bot.versions]
            batch.append((bot, heads))
            batch_bytes += sum(h.nbytes for h in heads)
            report.written += 1
        last = i == len(bots) or i == stall_at()
        if batch and (last or len(batch) >= BATCH_BOTS or batch_bytes >= BATCH_BYTES):
            target.write_bots(batch)
            batch, batch_bytes = [], 0
        if progress is not None and (not batch or last):
            progress(i, len(bots))
        stall(i)
    target.finish(snapshot.rows)
    report.counts = counts(snapshot.rows)
    report.seconds = time.monotonic() - start
    return report


def copy_store(source: str | os.PathLike, destination: str | os.PathLike, *,
               resume: bool = False, progress: Progress | None = None) -> CopyReport:
    """Copy the store at `source` into the (empty) store at `destination`; see `load`."""
    target = open_target(destination)
    try:
        with open_snapshot(source, must_exist=True) as snapshot:
            return load(snapshot, target, resume=resume, progress=progress)
    finally:
        target.close()
