"""`multihead demo`: create what the demo needs in a store (see `cli.demo_setup`)."""
from __future__ import annotations

import argparse
import logging
import time

from cli.demo_setup import PER_CLASS, ensure_demo, int8_runtimes
from cli.options import features_option, store_dir, store_option, trunk_kwargs
from heads.demo_images import KINDS
from service.core.setting_fields import InvalidSettings


def add_commands(sub) -> None:
    parser = sub.add_parser(
        "demo", parents=[store_option(), features_option()],
        help="create the demo trunk, images and bots in a store (only what is missing)",
        description=(
            "Create what the demo needs under the store: the seeded demo trunk (unless "
            "trunk/inception_v4.ckpt, the official checkpoint, is there), generated labelled "
            f"images ({', '.join(KINDS)}) under demo_images/, one bot per kind trained on them, "
            "then an INT8 trunk calibrated on them as `multihead quantize` does, its gate judged "
            f"on those bots' answers (where the trunk runs on {int8_runtimes()}; about two "
            "minutes, once; serve runs it by default where its gate passes, and one that fails "
            "is kept, marked failing, so that it is not calibrated again). "
            "Reuses everything already there; a demo bot is retrained when the store's "
            "trunk changed. `make serve` runs this before `multihead serve`."),
    )
    parser.add_argument("--per-class", type=int, default=PER_CLASS,
                        help=f"training images per class (default: {PER_CLASS})")
    parser.add_argument("--no-quantize", action="store_true",
                        help="do not calibrate an INT8 trunk on the demo images")
    parser.set_defaults(func=run_demo, _parser=parser)


def run_demo(args: argparse.Namespace) -> int:
    if args.per_class < 5:
        args._parser.error("--per-class must be >= 5")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if "://" in store_dir(args):
        raise InvalidSettings("the demo writes a trunk, images and bots into a store "
                              "directory: give --store a directory, not a URL")
    start = time.perf_counter()
    bots = ensure_demo(store_dir(args), per_class=args.per_class, trunk_kwargs=trunk_kwargs(args),
                       int8=not args.no_quantize)
    for bot in bots:
        state = (f"trained, held-out accuracy {bot.held_out_accuracy:.3f}" if bot.trained
                 else "already there")
        print(f"demo bot '{bot.bot_id}' v{bot.version}: {state}")
    print(f"demo ready in {time.perf_counter() - start:.1f}s")
    return 0
