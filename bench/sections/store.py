"""Section `store`: the operations on a whole store (`multihead store ...`, `store.ops`) on
10,000 bots (quick: 1,000) of `plan.store_classes` classes: backup (time and archive size),
check, restore, and copy directory -> directory, directory -> PostgreSQL, PostgreSQL ->
directory, and a backup of the PostgreSQL store (a throw-away server, fsync on)."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.context import Context
from bench.markdown import table
from bench.result import Result
from bench.sections.base import Results, Section, Target


@dataclass
class StoreResult(Result):
    bots: int = 0
    classes: int = 0
    register_s: float | None = None
    store_bytes: int | None = None  # the source directory's heads/ and registry
    # {step, seconds, ms_per_bot, bytes (an archive's)} per operation
    steps: list[dict] = field(default_factory=list)
    note: str = ""


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(context: Context) -> StoreResult:
    from bench.bots import register_bots
    from bench.pgserver import PgServer
    from store.ops.archive import backup, restore
    from store.ops.check import check_store
    from store.ops.copy import copy_store

    plan = context.plan
    n, classes = plan.store_bots, plan.store_classes
    result = StoreResult(bots=n, classes=classes)
    work = context.tmp / "store-ops"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    source, archive = work / "source", work / "source.tar"
    t0 = time.perf_counter()
    register_bots(source, n, classes, plan.seed)
    result.register_s = time.perf_counter() - t0
    result.store_bytes = _size(source)

    def step(name: str, operation, archive_path: Path | None = None) -> None:
        start = time.perf_counter()
        operation()
        seconds = time.perf_counter() - start
        entry = {"step": name, "seconds": seconds, "ms_per_bot": seconds / n * 1000}
        if archive_path is not None:
            entry["bytes"] = _size(archive_path)
        result.steps.append(entry)

    step("backup of the directory store", lambda: backup(source, archive), archive)
    step("check of the directory store", lambda: check_store(source))
    step("restore into an empty directory", lambda: restore(archive, work / "restored"))
    shutil.rmtree(work / "restored")
    step("copy directory -> directory", lambda: copy_store(source, work / "copy"))
    shutil.rmtree(work / "copy")
    pg = PgServer(durable=True)  # fsync on, as a production server runs
    try:
        step("copy directory -> PostgreSQL", lambda: copy_store(source, pg.url))
        step("backup of the PostgreSQL store", lambda: backup(pg.url, work / "pg.tar"),
             work / "pg.tar")
        step("check of the PostgreSQL store", lambda: check_store(pg.url))
        step("copy PostgreSQL -> directory", lambda: copy_store(pg.url, work / "back"))
    finally:
        pg.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    result.note = (
        f"{n} bots of {classes} classes, one version each (a 100-class head is about 615 kB; "
        "times grow with the stored bytes). Each operation reads one consistent snapshot of "
        "its source; a copy and a restore write up to 64 bots per transaction (heads first), "
        "the tenants, keys, history and audit last.")
    return result


def render(res: StoreResult, results: Results) -> str:
    out = ["## Store operations (`multihead store copy|backup|restore|check`)", ""]
    if res.bots:
        out += [f"{res.bots} bots registered in {res.register_s or 0:.1f} s; the directory "
                f"store takes {(res.store_bytes or 0) / 1e6:.1f} MB.", ""]
    rows = [[s["step"], s["seconds"], s["ms_per_bot"],
             f"{s['bytes'] / 1e6:.1f} MB" if "bytes" in s else ""] for s in res.steps]
    out += table(["operation", "s", "ms per bot", "archive"], rows)
    if res.note:
        out += ["", res.note]
    out += [""]
    return "\n".join(out)


def targets(res: StoreResult, results: Results) -> list[Target]:
    return []  # reported, not targeted (issue 35: the bench reports time and size)


SECTION = Section("store", StoreResult, run, render, targets)
