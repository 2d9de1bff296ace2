"""A directory store as the source or the destination of a copy (`store.ops.dump`).

Its snapshot (`DirectorySnapshot`): holding the registry's writer lock for a moment (writers
wait; readers and serving go on), one read transaction reads every data row, and each version
directory those rows name is hard-linked into `<root>/.ops-snapshot-<pid>-<random>/`; then the
lock is released. The heads are read from the links at leisure, so a version removed or pruned
meanwhile is still there for the copy, and nothing is copied twice on disk. The links go when
the snapshot is closed (a killed process leaves them: `check` lists them as orphans once that
process is gone, `check --fix` removes them).

As a destination (`DirectoryTarget`), a few bots are one registry write transaction: for each,
its version directories written and renamed into place (`DirectoryBlobs.write`), then its
rows; a crash before the commit leaves directories no row points to, swept when that bot is
written again (`--resume`).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from heads import files
from heads.head import Head
from store.directory.backend import LOCK_NAME, REGISTRY_NAME
from store.directory.blobs import HEADS_DIR, DirectoryBlobs
from store.directory.registry import Registry
from store.ops.dump import (
    BOT_TABLES,
    DATA_TABLES,
    GLOBAL_TABLES,
    MARKER,
    MARKER_BOTS,
    MARKER_STATEMENTS,
    BotRows,
    Snapshot,
    Target,
    columns,
    json_columns,
)

SNAPSHOT_PREFIX = ".ops-snapshot-"
_SNAPSHOT_RE = re.compile(re.escape(SNAPSHOT_PREFIX) + r"([0-9]+)-[0-9a-f]+")
_VERSION_DIR_RE = re.compile(r"v([1-9][0-9]*)")
_BUSY_TIMEOUT_S = 30.0


@contextmanager
def writer_lock(root: Path) -> Iterator[None]:
    """The store's writer lock (the flock every registration holds), for a moment."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _connect(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                           check_same_thread=False)


def _missing_table(exc: sqlite3.OperationalError) -> bool:
    return str(exc).startswith("no such table")


def read_rows(conn: sqlite3.Connection) -> dict[str, list[dict]]:
    """Every data table's rows (a table this registry lacks: none), JSON columns decoded."""
    out = {}
    for t in DATA_TABLES:
        names = columns(t.name)
        try:
            rows = conn.execute(f"SELECT {', '.join(names)} FROM {t.name} "
                                f"ORDER BY {', '.join(t.primary_key)}").fetchall()
        except sqlite3.OperationalError as exc:
            if not _missing_table(exc):
                raise
            rows = []
        decoded = json_columns(t.name)
        out[t.name] = [{n: (json.loads(v) if n in decoded else v) for n, v in zip(names, row)}
                       for row in rows]
    return out


def read_marker(conn: sqlite3.Connection) -> tuple[str | None, dict[str, str]]:
    """(the source of an interrupted copy into this registry or None, {bot: fingerprint})."""
    try:
        row = conn.execute(f"SELECT source FROM {MARKER}").fetchone()
        done = dict(conn.execute(f"SELECT bot_id, fingerprint FROM {MARKER_BOTS}").fetchall())
    except sqlite3.OperationalError as exc:
        if not _missing_table(exc):
            raise
        return None, {}
    return (row[0] if row is not None else "(unknown)"), done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scan_orphans(root: Path, registered: set[tuple[str, int]]) -> list[str]:
    """Paths (relative to `root`) no row points to: version directories of no registered
    version, a crashed writer's `.tmp-*`, snapshot links of a process that is gone."""
    out = []
    heads = root / HEADS_DIR
    if heads.is_dir():
        for bot_dir in sorted(heads.iterdir()):
            if not bot_dir.is_dir():
                out.append(f"{HEADS_DIR}/{bot_dir.name}")
                continue
            for entry in sorted(bot_dir.iterdir()):
                m = _VERSION_DIR_RE.fullmatch(entry.name)
                if m is None or (bot_dir.name, int(m.group(1))) not in registered:
                    out.append(f"{HEADS_DIR}/{bot_dir.name}/{entry.name}")
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            m = _SNAPSHOT_RE.fullmatch(entry.name)
            if m is not None and not _alive(int(m.group(1))):
                out.append(entry.name)
    return out


class DirectorySnapshot(Snapshot):
    """One consistent read of a directory store (see the module's docstring)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.identity = f"directory:{self.root.resolve()}"
        self.rows = {t.name: [] for t in DATA_TABLES}
        self._staging: Path | None = None
        self._orphans: list[str] = []
        db = self.root / REGISTRY_NAME
        if not db.exists():
            self._orphans = scan_orphans(self.root, set())
            return
        with writer_lock(self.root):
            conn = _connect(db)
            try:
                conn.execute("BEGIN")
                self.rows = read_rows(conn)
                self.incomplete = read_marker(conn)[0]
                registered = {(r["bot_id"], int(r["version"])) for r in self.rows["versions"]}
                self._orphans = scan_orphans(self.root, registered)
                self._staging = self._link(registered)
                conn.execute("COMMIT")
            finally:
                conn.close()

    def _link(self, registered: set[tuple[str, int]]) -> Path:
        staging = self.root / f"{SNAPSHOT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            for bot_id, version in registered:
                src = self.root / HEADS_DIR / bot_id / f"v{version}"
                if not src.is_dir():
                    continue  # the head reads as missing (check reports it)
                dst = staging / bot_id / f"v{version}"
                dst.mkdir(parents=True)
                for f in src.iterdir():
                    os.link(f, dst / f.name)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    def head(self, bot_id: str, version: int) -> Head:
        where = (self._staging if self._staging is not None else self.root / HEADS_DIR)
        return files.load_version_dir(where / bot_id / f"v{version}", bot_id, version)

    def orphans(self) -> list[str]:
        return list(self._orphans)

    def remove_orphans(self) -> list[str]:
        db = self.root / REGISTRY_NAME
        with writer_lock(self.root):
            registered: set[tuple[str, int]] = set()
            if db.exists():
                conn = _connect(db)
                try:
                    registered = {(b, int(v)) for b, v in
                                  conn.execute("SELECT bot_id, version FROM versions")}
                except sqlite3.OperationalError as exc:
                    if not _missing_table(exc):
                        raise
                finally:
                    conn.close()
            removed = scan_orphans(self.root, registered)
            for rel in removed:
                path = self.root / rel
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        return removed

    def close(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


def _insert(conn: sqlite3.Connection, name: str, rows: list[dict]) -> None:
    names = columns(name)
    encoded = json_columns(name)
    conn.executemany(
        f"INSERT INTO {name} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
        [tuple(json.dumps(r[n]) if n in encoded else r[n] for n in names) for r in rows])


def _no_step(name: str) -> None:
    pass


class DirectoryTarget(Target):
    """A directory store being written by a copy (nothing is created until `begin`)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._registry = Registry(self.root / REGISTRY_NAME, self.root / LOCK_NAME)
        self._blobs = DirectoryBlobs(self.root)

    def describe(self) -> str:
        return str(self.root)

    def progress(self) -> tuple[str | None, dict[str, str]] | None:
        heads = self.root / HEADS_DIR
        has_heads = heads.is_dir() and any(heads.iterdir())
        db = self.root / REGISTRY_NAME
        if not db.exists():
            return (None, {}) if has_heads else None
        conn = _connect(db)
        try:
            marker, done = read_marker(conn)
            if marker is not None:
                return marker, done
            rows = read_rows(conn)
        finally:
            conn.close()
        return (None, {}) if has_heads or any(rows.values()) else None

    def begin(self, source: str, started: str) -> None:
        with self._registry.write() as tx:
            for statement in MARKER_STATEMENTS:
                tx.conn.execute(statement.format(p=""))
            tx.conn.execute(f"DELETE FROM {MARKER}")
            tx.conn.execute(f"INSERT INTO {MARKER} VALUES (?, ?)", (source, started))

    @staticmethod
    def _delete(conn: sqlite3.Connection, bot_id: str) -> None:
        for name in (*BOT_TABLES, MARKER_BOTS):
            conn.execute(f"DELETE FROM {name} WHERE bot_id = ?", (bot_id,))

    def write_bots(self, batch: list[tuple[BotRows, list[Head]]]) -> None:
        # NOTE: no version directory is deleted before the commit: a bot copied before (a
        # resumed copy of a source that changed since) keeps its committed rows until then,
        # and they must find their directories if the commit never comes. A directory already
        # there is kept: written whole (renamed into place) from the same source, whose
        # version numbers are never reused. What is no longer used goes after the commit.
        with self._registry.write() as tx:
            for bot, heads in batch:
                self._delete(tx.conn, bot.bot_id)
                for row, head in zip(bot.versions, heads, strict=True):
                    version = int(row["version"])
                    if self._blobs.version_dir(bot.bot_id, version).is_dir():
                        continue
                    self._blobs.write(tx, bot.bot_id, version, head.weights, head.biases,
                                      head.labels, created=row["created"],
                                      source=row["source"], step=_no_step)
                _insert(tx.conn, "versions", bot.versions)
                _insert(tx.conn, "bots", [bot.bot])
                _insert(tx.conn, "owners", [bot.owner] if bot.owner else [])
                _insert(tx.conn, "candidates", [bot.candidate] if bot.candidate else [])
                tx.conn.execute(f"INSERT INTO {MARKER_BOTS} VALUES (?, ?)",
                                (bot.bot_id, bot.fingerprint()))
            tx.commit()
            for bot, _ in batch:  # committed: what an interrupted copy left of them
                self._blobs.sweep(bot.bot_id, {int(r["version"]) for r in bot.versions})

    def drop_bot(self, bot_id: str) -> None:
        with self._registry.write() as tx:
            self._delete(tx.conn, bot_id)
            tx.commit()
            self._blobs.drop(bot_id)

    def finish(self, rows: dict[str, list[dict]]) -> None:
        with self._registry.write() as tx:
            for name in GLOBAL_TABLES:
                tx.conn.execute(f"DELETE FROM {name}")
                _insert(tx.conn, name, rows.get(name, []))
            tx.conn.execute(f"DROP TABLE {MARKER_BOTS}")
            tx.conn.execute(f"DROP TABLE {MARKER}")

    def close(self) -> None:
        self._registry.close()
