"""Options every command shares, defined once: `--store` and `--trunk-checkpoint`, and how
they resolve (flag, else environment, else default) for every command alike."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from service.core.settings import CHOICES, InvalidSettings, Settings

STORE_ENV = Settings.env_var("store")
TRUNK_ENV = Settings.env_var("trunk_checkpoint")
DEFAULT_STORE = Settings.__dataclass_fields__["store"].default


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
    for name in ("precision", "runtime"):
        parent.add_argument(
            f"--{name}", choices=CHOICES[name], default=None,
            help=f"trunk {name}, as for `serve` (default: ${Settings.env_var(name)}, else "
                 f"'{Settings.__dataclass_fields__[name].default}')")
    return parent


def trunk_kwargs(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> dict:
    """`precision` and `runtime` for `Trunk.from_checkpoint`: flag, else environment, else the
    serving default, so training sees the features serving will."""
    out = {}
    for name in ("precision", "runtime"):
        value = (getattr(args, name, None) or environ.get(Settings.env_var(name))
                 or Settings.__dataclass_fields__[name].default)
        if value not in CHOICES[name]:
            raise InvalidSettings(f"{Settings.env_var(name)}={value!r}: must be one of "
                                  f"{', '.join(CHOICES[name])}")
        out[name] = value
    return out


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
