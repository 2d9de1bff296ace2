"""`multihead init-trunk`: write a seeded random trunk checkpoint in the official layout."""
from __future__ import annotations

import argparse
import time


def add_commands(sub) -> None:
    parser = sub.add_parser(
        "init-trunk",
        help="write a seeded random Inception-V4 checkpoint in the official slim layout",
        description=(
            "Write a TF checkpoint with seeded random weights for every Inception-V4 trunk "
            "variable plus the 1001-way Logits and the AuxLogits layers, named and shaped "
            "exactly like the official slim checkpoint inception_v4_2016_09_09. It stands in "
            "for the official weights, which cannot be downloaded here; the loading code is the "
            "same. Conv weights are He-normal and batch norm is the identity, so features are "
            "finite and differ between images."),
    )
    parser.add_argument("out_prefix", metavar="OUT_PREFIX",
                        help="checkpoint prefix to write, e.g. "
                             "checkpoints/trunk/demo_inception_v4.ckpt")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--num-classes", type=int, default=1001,
                        help="class count of the Logits layer (default: 1001, as the official one)")
    parser.set_defaults(func=run_init_trunk, _parser=parser)


def run_init_trunk(args: argparse.Namespace) -> int:
    from backbone.checkpoint import write_random_checkpoint

    if args.num_classes < 2:
        args._parser.error("--num-classes must be >= 2")
    start = time.perf_counter()
    prefix = write_random_checkpoint(args.out_prefix, seed=args.seed, num_classes=args.num_classes)
    print(f"wrote {prefix} (seed {args.seed}, {args.num_classes} classes) "
          f"in {time.perf_counter() - start:.1f}s")
    return 0
