"""Options every command shares, defined once: `--store`, `--trunk-checkpoint`, and the trunk's
`--precision` and `--runtime`. Each resolves as `serve` resolves it, by `Settings.resolve`
(flag, else environment, else default; checked like serve checks it), for every command alike."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from service.core.settings import Settings

STORE_ENV = Settings.env_var("store")
TRUNK_ENV = Settings.env_var("trunk_checkpoint")
DEFAULT_STORE = Settings.field_of("store").default
# The trunk's settings a command that extracts features shares with `serve`.
FEATURE_SETTINGS = ("precision", "runtime")


def store_option() -> argparse.ArgumentParser:
    """Parent parser with `--store DIR` (default: $MULTIHEAD_STORE, else 'checkpoints')."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--store", metavar="DIR|URL", default=None,
        help=f"the registered bots: a store directory (holding trunk/ and heads/) or a "
             f"postgresql://user@host:port/db URL (default: ${STORE_ENV}, else "
             f"'{DEFAULT_STORE}')")
    return parent


def trunk_option() -> argparse.ArgumentParser:
    """Parent parser with `--trunk-checkpoint PREFIX` (default: the store's trunk)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--trunk-checkpoint", metavar="PREFIX", default=None,
        help=f"serving trunk checkpoint prefix (default: ${TRUNK_ENV}, else the store's: "
             "<store>/trunk/inception_v4.ckpt if present, else demo_inception_v4.ckpt)")
    return parent


def features_option() -> argparse.ArgumentParser:
    """Parent parser with the serving trunk's `--precision` and `--runtime`: a command that
    runs images through the trunk extracts features the way `serve` will."""
    parent = argparse.ArgumentParser(add_help=False)
    for name in FEATURE_SETTINGS:
        f = Settings.field_of(name)
        parent.add_argument(
            f"--{name}", choices=f.metadata["choices"], default=None,
            help=f"trunk {name}, as for `serve` (default: ${Settings.env_var(name)}, else "
                 f"'{f.default}')")
    return parent


def trunk_kwargs(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> dict:
    """`precision` and `runtime` for `Trunk.from_checkpoint`, resolved as `serve` resolves
    them, so training sees the features serving will."""
    return {name: Settings.resolve(name, getattr(args, name, None), environ)
            for name in FEATURE_SETTINGS}


def store_dir(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str:
    """The store of a command: --store, else $MULTIHEAD_STORE, else 'checkpoints'."""
    return Settings.resolve("store", getattr(args, "store", None), environ)


def open_store(args: argparse.Namespace):
    """The command's store (`store_dir`), opened (a `HeadStore`; use it in a `with`)."""
    from store.front import HeadStore

    return HeadStore(store_dir(args))


def trunk_prefix(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str:
    """The trunk of a command: --trunk-checkpoint, else $MULTIHEAD_TRUNK_CHECKPOINT, else the
    store's own trunk checkpoint."""
    given = Settings.resolve("trunk_checkpoint", getattr(args, "trunk_checkpoint", None), environ)
    if given:
        return given
    from backbone.checkpoint import default_trunk_checkpoint

    return default_trunk_checkpoint(store_dir(args, environ))
