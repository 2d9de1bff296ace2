"""`multihead serve`: run the HTTP service."""
from __future__ import annotations

import argparse
import importlib
import logging
import threading

from service.settings import Settings


def add_commands(sub) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the HTTP service (classify, bots, admin, health, metrics)",
        description=(
            "Build the shared Inception-V4 trunk once, warm it up, and serve every registered "
            "bot of the store over HTTP. Each option can also be set with the environment "
            "variable named in its help (flags win). Without --trunk-checkpoint the store's "
            "trunk is used: <store>/trunk/inception_v4.ckpt (the official checkpoint) if "
            "present, else <store>/trunk/demo_inception_v4.ckpt, created with seeded random "
            "weights when missing."),
    )
    Settings.add_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    parser.set_defaults(func=run_serve)


def ensure_demo_trunk(settings: Settings) -> None:
    """Creates the store's demo trunk checkpoint when no trunk is configured or present."""
    from backbone.checkpoint import (
        checkpoint_exists,
        default_trunk_checkpoint,
        write_random_checkpoint,
    )

    if settings.trunk_checkpoint:
        return
    prefix = default_trunk_checkpoint(settings.store)
    if not checkpoint_exists(prefix):
        logging.getLogger(__name__).info(
            "no trunk checkpoint in %s/trunk: writing seeded random weights to %s (drop the "
            "official inception_v4.ckpt there to use real weights)", settings.store, prefix)
        write_random_checkpoint(prefix, seed=0)


def run_serve(args: argparse.Namespace) -> int:
    # Start importing TensorFlow (about 3 s) at once, beside the rest of start-up; the trunk
    # build waits for it through the import lock.
    threading.Thread(target=importlib.import_module, args=("tensorflow",), daemon=True,
                     name="multihead-import-tf").start()
    from service.app import run_app  # aiohttp: imported only by the command that serves

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env_and_args(args)
    ensure_demo_trunk(settings)
    run_app(settings)
    return 0
