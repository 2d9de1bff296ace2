"""`python -m bench [options]`: the benchmark without the `multihead` console script (same
flags as `multihead bench`)."""
from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from bench.cli import DESCRIPTION, add_arguments, command


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="multihead bench", description=DESCRIPTION)
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = "python -m bench " + shlex.join(argv)
    return command(args, parser.prog)


if __name__ == "__main__":
    sys.exit(main())
