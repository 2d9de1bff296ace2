"""A store's backup: one archive file, written from one consistent snapshot while the store is
served and written, and read back as a snapshot that a restore loads like a copy.

The archive is a plain tar (float32 tensors do not compress):

    tables/<table>.json              the rows of each data table (`store.ops.dump`)
    blobs/<bot_id>/v<N>/weights      float32 [1536, n], little-endian, C order
    blobs/<bot_id>/v<N>/biases       float32 [n]
    blobs/<bot_id>/v<N>/labels       a UTF-8 JSON array
    manifest.json                    last: format, format_version, id, created, source,
                                     counts ({table: rows}), the sha256 of every table file
                                     and of every blob

It is written as `.<name>.tmp-<pid>` beside the file, fsynced, then renamed over it: a backup
killed at any point leaves the file as it was. `ArchiveSnapshot` checks everything (the
manifest's format and version, every member against its sha256, the counts) before a restore
writes anything, and refuses a damaged or newer file with a one-line reason. An archive of an
older format version reads the tables added since (`ADDED_IN`) as empty: format 1 (before
tenant_latency_limits) restores unchanged.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
import time
import uuid
from pathlib import Path

from accounts.tenants import utc_now
from heads import files
from heads.head import Head
from store.ops.copy import (
    CopyReport,
    Progress,
    StoreOpRefused,
    load,
    open_snapshot,
    open_target,
    stall,
)
from store.ops.dump import DATA_TABLES, Snapshot, counts, decode_head, encode_head, sha256
from store.schema import BLOB_NAMES

FORMAT = "multihead-store-backup"
FORMAT_VERSION = 2
# The tables each format version added: an archive of an older version has none of them (read
# back empty); a newer multihead's archive, with tables this one does not know, is refused.
ADDED_IN = {"tenant_latency_limits": 2}
MANIFEST = "manifest.json"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> str:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))
    return sha256(data)


def write_archive(snapshot: Snapshot, path: str | os.PathLike, *,
                  progress: Progress | None = None) -> dict:
    """Write `snapshot` to the archive `path` (replaced at the end, atomically). Returns the
    manifest."""
    path = Path(path)
    if snapshot.incomplete is not None:
        raise StoreOpRefused(f"the store is an interrupted copy of {snapshot.incomplete}: "
                             "finish that copy first (--resume)")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "id": uuid.uuid4().hex, "created": utc_now(), "source": snapshot.identity,
                "counts": counts(snapshot.rows), "tables": {}, "blobs": []}
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            for t in DATA_TABLES:
                data = json.dumps(snapshot.rows[t.name], ensure_ascii=False).encode("utf-8")
                manifest["tables"][t.name] = _add(tar, f"tables/{t.name}.json", data)
            bots = snapshot.bots()
            for i, bot in enumerate(bots, 1):
                for row in bot.versions:
                    version = int(row["version"])
                    encoded = encode_head(snapshot.head(bot.bot_id, version))
                    manifest["blobs"].append({
                        "bot_id": bot.bot_id, "version": version,
                        "sha256": {name: _add(tar, f"blobs/{bot.bot_id}/v{version}/{name}", data)
                                   for name, data in encoded.items()}})
                if progress is not None:
                    progress(i, len(bots))
                stall(i)
            _add(tar, MANIFEST, json.dumps(manifest, indent=1).encode("utf-8"))
        files.fsync_file(tmp)
        os.replace(tmp, path)
        files.fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return manifest


def backup(location: str | os.PathLike, path: str | os.PathLike, *,
           progress: Progress | None = None) -> dict:
    """Back the store at `location` up into the archive `path`; returns the manifest."""
    if not Path(path).parent.is_dir():
        raise StoreOpRefused(f"there is no directory {Path(path).parent} for the backup")
    with open_snapshot(location, must_exist=True) as snapshot:
        return write_archive(snapshot, path, progress=progress)


class ArchiveSnapshot(Snapshot):
    """An archive read back, every member checked first (see the module's docstring).

    Raises:
        StoreOpRefused: not a readable archive, no manifest, another format, a newer format
            version, a member missing or not matching its sha256, counts that do not match.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._tar = tarfile.open(self.path, "r:")
        except (OSError, tarfile.TarError, EOFError) as exc:
            raise StoreOpRefused(f"{self.path}: not a readable backup archive ({exc})") from None
        try:
            # By name, once: TarFile.getmember searches its whole list on every call.
            self._members = {m.name: m for m in self._tar.getmembers()}
        except (OSError, tarfile.TarError, EOFError) as exc:
            self._tar.close()
            raise StoreOpRefused(f"{self.path} is damaged: {exc}") from None
        try:
            self._verify()
        except BaseException:
            self._tar.close()
            raise

    def _read(self, name: str) -> bytes:
        try:
            member = self._tar.extractfile(self._members[name])
            if member is None:
                raise KeyError(name)
            return member.read()
        except KeyError:
            raise StoreOpRefused(f"{self.path} is damaged: {name} is missing") from None
        except (OSError, tarfile.TarError, EOFError) as exc:
            raise StoreOpRefused(f"{self.path} is damaged: {name} cannot be read "
                                 f"({exc})") from None

    def _checked(self, name: str, digest: str) -> bytes:
        data = self._read(name)
        if sha256(data) != digest:
            raise StoreOpRefused(f"{self.path} is damaged: {name} does not match its sha256")
        return data

    def _verify(self) -> None:
        try:
            manifest = json.loads(self._read(MANIFEST).decode("utf-8"))
            fmt, version = manifest["format"], int(manifest["format_version"])
        except (ValueError, KeyError, TypeError):
            raise StoreOpRefused(f"{self.path} is damaged: its manifest is unreadable") from None
        if fmt != FORMAT:
            raise StoreOpRefused(f"{self.path} is not a multihead store backup ({fmt!r})")
        if version > FORMAT_VERSION:
            raise StoreOpRefused(f"{self.path} was written by a newer multihead (backup format "
                                 f"{version}; this one reads up to {FORMAT_VERSION})")
        self.manifest = manifest
        self.identity = f"backup:{manifest.get('id')} of {manifest.get('source')}"
        self.rows = {}
        wanted_counts = dict(manifest.get("counts") or {})
        for t in DATA_TABLES:
            digest = manifest["tables"].get(t.name)
            if digest is None and version < ADDED_IN.get(t.name, 1):
                self.rows[t.name] = []  # written before the table existed
                wanted_counts.setdefault(t.name, 0)
                continue
            if digest is None:
                raise StoreOpRefused(f"{self.path} is damaged: table {t.name} is missing")
            self.rows[t.name] = json.loads(self._checked(f"tables/{t.name}.json", digest))
        if counts(self.rows) != wanted_counts:
            raise StoreOpRefused(f"{self.path} is damaged: its tables do not match the counts "
                                 "of its manifest")
        self._blobs = {(b["bot_id"], int(b["version"])): b["sha256"] for b in manifest["blobs"]}
        wanted = {(r["bot_id"], int(r["version"])) for r in self.rows["versions"]}
        if not wanted <= set(self._blobs):
            raise StoreOpRefused(f"{self.path} is damaged: blobs of "
                                 f"{len(wanted - set(self._blobs))} versions are missing")
        for (bot_id, version), digests in self._blobs.items():
            for name in BLOB_NAMES:
                self._checked(f"blobs/{bot_id}/v{version}/{name}", digests[name])
        self._n_classes = {(r["bot_id"], int(r["version"])): int(r["n_classes"])
                           for r in self.rows["versions"]}

    def head(self, bot_id: str, version: int) -> Head:
        digests = self._blobs[(bot_id, version)]
        return decode_head(bot_id, version, self._n_classes[(bot_id, version)], {
            name: self._checked(f"blobs/{bot_id}/v{version}/{name}", digests[name])
            for name in BLOB_NAMES})

    def close(self) -> None:
        self._tar.close()


def restore(path: str | os.PathLike, location: str | os.PathLike, *, resume: bool = False,
            progress: Progress | None = None) -> CopyReport:
    """Restore the archive `path` into the (empty) store at `location`: checked first, then
    loaded like a copy (`store.ops.copy.load`: crash-safe, `resume`)."""
    with ArchiveSnapshot(path) as snapshot:
        target = open_target(location)
        try:
            return load(snapshot, target, resume=resume, progress=progress)
        finally:
            target.close()
