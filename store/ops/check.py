"""`check_store`: the integrity of a store, read from one consistent snapshot.

A problem (the store is not sound; `ok` is False):
  - a copy or restore into it was interrupted (its marker is there: finish it with --resume);
  - a live bot whose active version is not stored, a stored version of no live bot, an owners
    row of no live bot or of a tenant that does not exist, a candidate of no live bot or whose
    version is not stored;
  - a version of a live bot (active, candidate, or one to roll back to) whose blobs are
    missing, unreadable or do not match their sha256.
An orphan (listed; not a problem): blobs no row points to (a registration killed before its
commit leaves them; its bot's next registration sweeps them), a dead copy's snapshot links.
`fix=True` removes the orphans, and only them, under the writer lock.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from accounts.tenants import DEFAULT_TENANT
from heads.errors import HeadLoadError
from store.ops.copy import open_snapshot
from store.ops.dump import Snapshot


@dataclass
class CheckReport:
    """`problems` (one line each), `orphans` (what `fix` removes), `removed` (what it
    removed), and what was checked: `bots`, `versions`."""

    problems: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    bots: int = 0
    versions: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _row_problems(snapshot: Snapshot) -> list[str]:
    rows = snapshot.rows
    stored = {(r["bot_id"], int(r["version"])) for r in rows["versions"]}
    live = {r["bot_id"]: int(r["active_version"]) for r in rows["bots"]}
    tenants = {DEFAULT_TENANT} | {r["name"] for r in rows["tenants"]}
    out = []
    for bot_id, active in sorted(live.items()):
        if (bot_id, active) not in stored:
            out.append(f"bot '{bot_id}': its active version v{active} is not stored")
    for bot_id, version in sorted(stored):
        if bot_id not in live:
            out.append(f"version '{bot_id}' v{version} belongs to no live bot")
    for r in rows["owners"]:
        if r["bot_id"] not in live:
            out.append(f"owner row of '{r['bot_id']}' (tenant '{r['tenant']}'): no such live bot")
        elif r["tenant"] not in tenants:
            out.append(f"bot '{r['bot_id']}' belongs to tenant '{r['tenant']}', which does not "
                       "exist")
    for r in rows["candidates"]:
        if r["bot_id"] not in live:
            out.append(f"candidate of '{r['bot_id']}': no such live bot")
        elif (r["bot_id"], int(r["version"])) not in stored:
            out.append(f"candidate of '{r['bot_id']}': its version v{r['version']} is not stored")
    return out


def check_store(location: str | os.PathLike, *, fix: bool = False) -> CheckReport:
    """Check the store at `location` (see the module's docstring); with `fix`, remove its
    orphans."""
    report = CheckReport()
    with open_snapshot(location) as snapshot:
        if snapshot.incomplete is not None:
            report.problems.append(
                f"incomplete: a copy or restore from {snapshot.incomplete} into this store was "
                "interrupted; finish it with `multihead store copy|restore ... --resume`")
        report.problems += _row_problems(snapshot)
        live = {r["bot_id"] for r in snapshot.rows["bots"]}
        report.bots = len(live)
        for r in snapshot.rows["versions"]:
            if r["bot_id"] not in live:
                continue
            report.versions += 1
            try:
                snapshot.head(r["bot_id"], int(r["version"]))
            except HeadLoadError as exc:
                report.problems.append(str(exc))
        report.orphans = snapshot.orphans()
        if fix:
            report.removed = snapshot.remove_orphans()
    return report
