"""The command line of the benchmark: `add_arguments(parser)` declares every flag of
`multihead bench`, `run(args)` runs it. The `multihead` console script mounts these as its
`bench` subcommand; `python -m bench` (bench/__main__.py) uses them standalone.

Importing this is cheap (no TensorFlow, no aiohttp, no matplotlib): `multihead --help` does.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from bench import runner
from bench.plan import Plan
from bench.report import (
    evaluate_targets,
    format_target_line,
    render_markdown,
    targets_failed,
    write_reports,
)
from bench.sections import NAMES, parse_names

HELP = "benchmark the shared trunk against the naive designs (writes json, md, png)"
DESCRIPTION = (
    "Measure the shared-trunk design against the naive ones (rebuild per request, one full "
    "model per bot) on this machine, in one run: raw trunk, the service over HTTP with many "
    "bots, fan-out, bot scale, cold start. Writes bench.json, bench.md and bench.png. "
    f"Sections: {', '.join(NAMES)}.")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got '{text}'")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds every flag of `multihead bench` to `parser`."""
    parser.add_argument("--sections", default=",".join(NAMES), metavar="NAME,NAME,...",
                        help=f"comma-separated sections to run (default: all = "
                             f"{','.join(NAMES)})")
    parser.add_argument("--output", default="bench-out", metavar="DIR",
                        help="where bench.json, bench.md, bench.png and server logs go "
                             "(default: bench-out)")
    parser.add_argument("--quick", action="store_true",
                        help="reduced counts (concurrency 1 and 16, up to 1,000 bots, fewer "
                             "repetitions): a few minutes on 2 cores")
    parser.add_argument("--check", action="store_true",
                        help="print every target with its measured value and PASS/FAIL; exit 1 "
                             "when a target of a selected section is missed")
    parser.add_argument("--trunk-checkpoint", metavar="PREFIX",
                        help="trunk checkpoint to use (default: a seeded random one in the "
                             "official layout, written to a temp dir)")
    parser.add_argument("--bots", type=int, default=None, metavar="B",
                        help="bots of the service section (default: 100)")
    parser.add_argument("--classes", type=int, default=None, metavar="N",
                        help="classes per head (default: 100)")
    parser.add_argument("--zipf-s", type=float, default=None, metavar="S",
                        help="Zipf exponent of bot popularity (default: 1.0)")
    parser.add_argument("--concurrency", type=_int_list, default=None, metavar="C,C,...",
                        help="closed-loop client counts (default: 1,4,16,32; quick: 1,16)")
    parser.add_argument("--poisson-rate", type=float, default=None, metavar="PER_S",
                        help="open-loop arrival rate (default: 70%% of the 16-client "
                             "throughput of the mixed policy)")
    parser.add_argument("--scale-levels", type=_int_list, default=None, metavar="N,N,...",
                        help="registered bot counts (default: 10,100,1000,10000; quick: up to "
                             "1000)")
    parser.add_argument("--scale-touch-max", type=int, default=None, metavar="N",
                        help="most bots loaded through the server for the RSS measure "
                             "(default: 2000)")
    parser.add_argument("--full-models", type=int, default=None, metavar="K",
                        help="full models of the one-model-per-bot baseline (default: 4)")
    parser.add_argument("--max-wait-ms", type=float, default=None, metavar="MS",
                        help="the servers' --max-wait-ms (default: the server default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and load (0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _plan_from_args(args: argparse.Namespace) -> Plan:
    overrides = {"sections": parse_names(args.sections), "seed": args.seed,
                 "progress": not args.no_progress}
    for name, attr in (("bots", "bots"), ("classes", "classes"), ("zipf_s", "zipf_s"),
                       ("concurrency", "concurrency"), ("poisson_rate", "poisson_rate"),
                       ("scale_levels", "scale_levels"), ("scale_touch_max", "scale_touch_max"),
                       ("full_models", "full_models"), ("max_wait_ms", "max_wait_ms")):
        value = getattr(args, attr, None)
        if value is not None:
            overrides[name] = value
    if overrides.get("classes", 2) < 2:
        raise ValueError("--classes must be >= 2")
    if overrides.get("bots", 10) < 10:
        raise ValueError("--bots must be >= 10 (the fan-out scores 10 bots)")
    return Plan.quick_plan(**overrides) if args.quick else Plan(**overrides)


def command(args: argparse.Namespace, prog: str = "multihead bench") -> int:
    """`run(args)` as a command: an inconsistent flag (ValueError) is one line on stderr and
    exit code 2, Ctrl-C exit code 130."""
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark with the flags of `add_arguments`; returns 1 when `--check` finds a
    missed target, else 0. Raises ValueError on inconsistent flags (the caller reports it).

    SIGTERM unwinds like Ctrl-C, so that the server processes it started get stopped.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    plan = _plan_from_args(args)

    def _terminate(signum, frame):
        raise SystemExit(128 + signum)  # unwinds, so the server processes get stopped

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return _run_and_report(args, plan)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run_and_report(args: argparse.Namespace, plan: Plan) -> int:
    command = getattr(args, "command_line", None)
    if command is None:
        invoked = Path(sys.argv[0]).name == "multihead" and sys.argv[1:2] == ["bench"]
        command = "multihead " + shlex.join(sys.argv[1:]) if invoked else "multihead bench"
    results = runner.run(plan, args.output, trunk_checkpoint_prefix=args.trunk_checkpoint,
                         command=command)
    targets = evaluate_targets(results, set(plan.sections))
    written = write_reports(args.output, results, targets)
    print(render_markdown(results, targets))
    if args.check:
        print("Targets:")
        for target in targets:
            print("  " + format_target_line(target))
    print("wrote " + ", ".join(str(p) for p in written.values()))
    if args.check and targets_failed(targets):
        return 1
    return 0
