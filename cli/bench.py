"""`multihead bench`: the benchmark script. Its code is the `bench` package (a client of the
service, never imported by the server); this module only hooks it into the one CLI."""
from __future__ import annotations

import argparse

from bench.cli import DESCRIPTION, HELP, add_arguments, command


def add_commands(sub) -> None:
    parser = sub.add_parser("bench", help=HELP, description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """Runs the benchmark; an inconsistent flag is one line on stderr and exit code 2."""
    return command(args)
