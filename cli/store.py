"""`multihead store copy|backup|restore|check`: operations on a whole store (`store.ops`).

    store copy SRC DST [--resume]           every bot, version, blob, candidate, history row,
                                            tenant, limit, API key and audit record; DST empty
    store backup [--store S] FILE           one archive from one consistent snapshot, while S
                                            is served and written
    store restore FILE [--store DST] [--resume]   the archive checked, then loaded into DST
    store check [--store S] [--fix]         exit 0 if sound, 1 if not (orphans are listed, and
                                            removed with --fix)

A refusal (a destination that is not empty, a damaged or newer archive) is one line on stderr,
exit 2, as every command's. Progress goes to stderr on a terminal only; the summary to stdout.
"""
from __future__ import annotations

import argparse
import json
import sys

from cli.options import store_dir, store_option

STORE_HELP = "a store directory or a postgresql://user@host:port/db URL"


def _progress(verb: str):
    """A progress line on stderr if it is a terminal, else None."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        print(f"\r{verb} bots: {done}/{total}", end="\n" if done == total else "",
              file=sys.stderr, flush=True)

    return show


def add_commands(sub) -> None:
    """Add `store {copy,backup,restore,check}` to `multihead`."""
    store = store_option()
    parser = sub.add_parser(
        "store", help="copy a store, back it up, restore it, check it",
        description="Operations on a whole store (a directory with a SQLite registry, or "
                    "PostgreSQL): bots with all their versions, history and candidates, "
                    "tenants and their limits, API keys (their hashes: existing keys keep "
                    "working) and the audit log. The serving processes' leases are not data "
                    "and are not copied.")
    actions = parser.add_subparsers(dest="store_command", required=True, metavar="ACTION")

    p = actions.add_parser(
        "copy", help="copy a store into an empty one (directory <-> PostgreSQL)",
        description="Copy everything in store SRC into the empty store DST, from one "
                    "consistent snapshot of SRC taken while it may be served and written. "
                    "A few bots per transaction, a bot never split, heads before rows; until "
                    "the end DST is marked incomplete (`store check` fails on it, no API key works "
                    "on it yet). A killed copy is finished by running it again with "
                    "--resume.")
    p.add_argument("source", metavar="SRC", help=STORE_HELP)
    p.add_argument("destination", metavar="DST", help=f"{STORE_HELP}; must be empty")
    p.add_argument("--resume", action="store_true",
                   help="finish an interrupted copy of SRC into DST (bots copied already "
                        "and unchanged since are kept)")
    p.set_defaults(func=cmd_copy)

    p = actions.add_parser(
        "backup", parents=[store], help="back a store up into one archive file",
        description="Write every bot, version, tenant, key and audit record of the store to "
                    "one archive file (tar: table rows, head tensors and labels, a manifest "
                    "with the sha256 of each), from one consistent snapshot while the store "
                    "is served and written. The file is replaced only once complete.")
    p.add_argument("file", metavar="FILE", help="the archive to write")
    p.set_defaults(func=cmd_backup)

    p = actions.add_parser(
        "restore", parents=[store], help="restore a backup into an empty store",
        description="Check the archive (format, every checksum, counts; a damaged or newer "
                    "file is refused in one line, exit 2), then load it into the empty store "
                    "as `store copy` does (crash-safe; --resume finishes a killed restore).")
    p.add_argument("file", metavar="FILE", help="an archive written by `store backup`")
    p.add_argument("--resume", action="store_true",
                   help="finish an interrupted restore of FILE into the store")
    p.set_defaults(func=cmd_restore)

    p = actions.add_parser(
        "check", parents=[store], help="check a store's integrity (exit 0 sound, 1 not)",
        description="Check from one consistent snapshot that every version of every live "
                    "bot (active, candidate, rollback targets) has its blobs, matching their "
                    "checksums; that no owner, candidate or version row dangles; that no copy "
                    "into the store was interrupted. Orphan blobs (no row points to them: a "
                    "killed registration's) are listed and do not fail the check. Exit 0 if "
                    "sound, 1 if not: for cron jobs and readiness scripts.")
    p.add_argument("--fix", action="store_true",
                   help="remove the orphans (and nothing else)")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    p.set_defaults(func=cmd_check)


def cmd_copy(args: argparse.Namespace) -> int:
    from store.ops.copy import copy_store

    report = copy_store(args.source, args.destination, resume=args.resume,
                        progress=_progress("copying"))
    print(f"copied {report.summary()}")
    return 0


def cmd_backup(args: argparse.Namespace) -> int:
    from store.ops.archive import backup

    manifest = backup(store_dir(args), args.file, progress=_progress("backing up"))
    c = manifest["counts"]
    print(f"backed up {c['bots']} bots ({c['versions']} versions), {c['tenants']} tenants, "
          f"{c['api_keys']} API keys, {c['audit']} audit records from {manifest['source']} "
          f"to {args.file}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from store.ops.archive import restore

    report = restore(args.file, store_dir(args), resume=args.resume,
                     progress=_progress("restoring"))
    print(f"restored {report.summary()}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from store.ops.check import check_store

    report = check_store(store_dir(args), fix=args.fix)
    if args.json:
        print(json.dumps({"ok": report.ok, "bots": report.bots, "versions": report.versions,
                          "problems": report.problems, "orphans": report.orphans,
                          "removed": report.removed}, indent=2))
        return 0 if report.ok else 1
    for line in report.problems:
        print(f"problem: {line}")
    removed = set(report.removed)
    for line in report.orphans:
        print(f"orphan{' (removed)' if line in removed else ''}: {line}")
    verdict = "sound" if report.ok else f"NOT sound ({len(report.problems)} problems)"
    print(f"{report.bots} bots, {report.versions} versions checked: {verdict}; "
          f"{len(report.orphans)} orphans{f', {len(removed)} removed' if args.fix else ''}")
    return 0 if report.ok else 1
