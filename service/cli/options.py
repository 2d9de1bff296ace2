"""Options every command shares, defined once: `--store` and `--trunk-checkpoint`, and how
they resolve (flag, else environment, else default) for every command alike."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from service.settings import Settings

STORE_ENV = Settings.env_var("store")
TRUNK_ENV = Settings.env_var("trunk_checkpoint")
DEFAULT_STORE = Settings.__dataclass_fields__["store"].default


def store_option() -> argparse.ArgumentParser:
    """Parent parser with `--store DIR` (default: $MULTIHEAD_STORE, else 'checkpoints')."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--store", metavar="DIR", default=None,
        help=f"store directory holding trunk/ and the registered bots (default: ${STORE_ENV}, "
             f"else '{DEFAULT_STORE}')")
    return parent


def trunk_option() -> argparse.ArgumentParser:
    """Parent parser with `--trunk-checkpoint PREFIX` (default: the store's trunk)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--trunk-checkpoint", metavar="PREFIX", default=None,
        help=f"serving trunk checkpoint prefix (default: ${TRUNK_ENV}, else the store's: "
             "<store>/trunk/inception_v4.ckpt if present, else demo_inception_v4.ckpt)")
    return parent


def store_dir(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str:
    """The store of a command: --store, else $MULTIHEAD_STORE, else 'checkpoints'."""
    return getattr(args, "store", None) or environ.get(STORE_ENV) or DEFAULT_STORE


def trunk_prefix(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str:
    """The trunk of a command: --trunk-checkpoint, else $MULTIHEAD_TRUNK_CHECKPOINT, else the
    store's own trunk checkpoint."""
    given = getattr(args, "trunk_checkpoint", None) or environ.get(TRUNK_ENV)
    if given:
        return given
    from backbone.checkpoint import default_trunk_checkpoint

    return default_trunk_checkpoint(store_dir(args, environ))
