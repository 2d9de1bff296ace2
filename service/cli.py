"""The `multihead` console script: one parser, subcommands contributed by each package.

Each package owns its subcommands in its own `cli.py` (`add_subcommands(subparsers)`), and every
handler imports TensorFlow lazily so that `multihead --help` answers at once. A handler returns
the process exit code; domain errors are printed as one line on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Serve many image classifiers ('bots') that share one Inception-V4 trunk.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from backbone import cli as backbone_cli
    from heads import cli as heads_cli
    from service import demo, serve_cli

    serve_cli.add_subcommands(sub)
    demo.add_subcommands(sub)
    backbone_cli.add_subcommands(sub)
    heads_cli.add_subcommands(sub)
    try:
        from service import bench
    except ImportError:  # pragma: no cover - the benchmark module is optional while it is built
        bench = None
    if bench is not None and hasattr(bench, "add_subcommands"):
        bench.add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # TensorFlow's C++ start-up chatter (CUDA probing, oneDNN notice) is not for CLI users;
    # an explicit TF_CPP_MIN_LOG_LEVEL in the environment still wins.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # tf.keras = tf-keras (what tf-slim's layers use anyway) instead of Keras 3: nothing here
    # uses tf.keras, and it makes `import tensorflow` about 0.5 s faster (measured: 3.3 -> 2.8 s).
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except _user_errors() as exc:
        print(f"multihead {args.command}: error: {exc}", file=sys.stderr)
        return 2


class CliError(Exception):
    """A refusal to report as one line on stderr with exit code 2."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's to fix: printed as one line, never as a traceback."""
    from backbone.errors import BackboneError
    from heads.errors import HeadsError

    return (CliError, BackboneError, HeadsError, FileNotFoundError, ValueError)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
