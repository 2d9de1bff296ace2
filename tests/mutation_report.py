"""Per-module mutation score of the last `mutmut run` (`make mutation` prints it).

Reads mutmut's `mutants/<module>.py.meta` files. A mutant counts as killed when a test failed
(or it timed out: the mutant hung the code under test); survivors and mutants that no test
reached count against the score. A module some of whose mutants were not run (an interrupted
run, or `mutmut run NAMES` for other modules) has no complete score: it is shown as
"incomplete" and fails the check, unless `--modules` leaves it out.
Exits 1 if any module reported is under `--min` percent or incomplete.

    python tests/mutation_report.py [--min 85] [--survivors] [--modules 'service/*' ...]
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

KILLED = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout",
          152: "timeout", 255: "timeout", 37: "killed"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", type=float, default=85.0, help="lowest passing score, percent")
    parser.add_argument("--survivors", action="store_true", help="list surviving mutants")
    parser.add_argument("--modules", nargs="+", default=["*"], metavar="GLOB",
                        help="report only modules whose path matches one of these globs "
                             "(e.g. 'service/*'; default: every module)")
    parser.add_argument("--root", default="mutants")
    args = parser.parse_args(argv)
    metas = [meta for meta in sorted(Path(args.root).rglob("*.py.meta"))
             if any(fnmatch.fnmatch(_module(meta, args.root), g) for g in args.modules)]
    if not metas:
        print(f"no mutation results under {args.root}/ for {' '.join(args.modules)}: run "
              "`make mutation`", file=sys.stderr)
        return 2
    print(f"{'module':32} {'mutants':>7} {'killed':>7} {'timeout':>7} {'survived':>8} "
          f"{'no test':>7} {'not run':>7} {'score':>10}")
    failing, survivors = [], []
    for meta in metas:
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        module = _module(meta, args.root)
        killed = sum(KILLED.get(c) == "killed" for c in codes.values())
        timeout = sum(KILLED.get(c) == "timeout" for c in codes.values())
        untested = sum(c in (5, 33) for c in codes.values())
        pending = sum(c is None for c in codes.values())  # an interrupted or partial run
        survived = len(codes) - killed - timeout - untested - pending
        ran = len(codes) - pending
        score = 100.0 * (killed + timeout) / ran if ran else 100.0
        shown = f"{score:6.1f}%" if not pending else "incomplete"
        print(f"{module:32} {len(codes):7d} {killed:7d} {timeout:7d} {survived:8d} "
              f"{untested:7d} {pending:7d} {shown:>10}")
        if pending or score < args.min:
            failing.append(module)
        survivors += sorted(k for k, c in codes.items() if c not in KILLED and c is not None)
    if args.survivors:
        print("\nnot killed (see `mutmut show NAME`):")
        print("\n".join(f"  {name}" for name in survivors))
    if failing:
        print(f"\nunder {args.min:g}% or incomplete: {', '.join(failing)}")
        return 1
    return 0


def _module(meta: Path, root: str) -> str:
    return str(meta.relative_to(root))[: -len(".meta")]


if __name__ == "__main__":
    sys.exit(main())
