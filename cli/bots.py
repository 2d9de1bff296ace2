"""`multihead register|train|bots`: register, train and administer bots in a store (and their
candidates: `--candidate`, `bots promote`, `bots discard`).

Every handler validates its arguments and inputs before it opens the store, so a refusal
(raised as a `HeadsError`, `AccountsError` or `StoreError` and printed by `cli.main` as one
line, exit 2) leaves the store exactly as it was. TensorFlow is imported only by the handlers
that need it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from cli.options import (
    features_option,
    open_store,
    store_dir,
    store_option,
    trunk_kwargs,
    trunk_option,
    trunk_prefix,
)
from store.backend import redact_url

BOT_HELP = "bot id: 1-64 characters of A-Z a-z 0-9 . _ -, a letter or digit first"
TENANT_HELP = ("the tenant that owns a new bot (`multihead tenants add`; default: default); "
               "an id another tenant owns is refused")
CANDIDATE_HELP = ("store the new version as BOT's candidate instead of making it active: "
                  "'shadow' (scored on every request of BOT beside the live version, never "
                  "returned) or 'canary:P' (answers P %% of BOT's requests, 0 < P < 100, split "
                  "by routing key); replaces a candidate BOT has. Then `multihead bots promote "
                  "BOT` or `multihead bots discard BOT`")


def add_commands(sub) -> None:
    """Add `register`, `train` and `bots {list,show,remove,rollback}` to `multihead`."""
    store, trunk = store_option(), trunk_option()
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "register", parents=[store, trunk], formatter_class=fmt,
        help="register a bot's head from a checkpoint (a new version, made active)",
        description=(
            "Register a new version of bot BOT and make it active. The head is a fully\n"
            "connected layer on the shared trunk's 1536-d features: weights [1536, n],\n"
            "biases [n], and n labels (one per line in --labels, n >= 2).\n\n"
            "Sources:\n"
            "  --weights-checkpoint PREFIX    a TF checkpoint holding 'weights' and 'biases'\n"
            "                                 (other names: --weights-name, --biases-name)\n"
            "  --from-slim-checkpoint PREFIX  the InceptionV4/Logits/Logits layer of a slim\n"
            "                                 Inception-V4 checkpoint (official or fine-tuned,\n"
            "                                 any class count). Its trunk is compared with the\n"
            "                                 serving trunk (--trunk-checkpoint); if they differ\n"
            "                                 the import is refused unless --force, because the\n"
            "                                 bot would predict differently from that model.\n\n"
            "With --candidate, the new version is stored as BOT's candidate and the active\n"
            "version goes on answering: a shadow is scored on every request and compared with\n"
            "it, a canary answers its share of the requests (see the user guide, 'Candidates').\n\n"
            "A refused registration (bad shapes, NaN/Inf, label count, bad id, missing file,\n"
            "a bad --candidate, a candidate for an unknown bot) leaves the store unchanged."),
        epilog=("examples:\n  multihead register acme --weights-checkpoint acme/head.ckpt "
                "--labels acme/labels.txt\n"
                "  multihead register acme --weights-checkpoint acme/v2.ckpt "
                "--labels acme/labels.txt --candidate canary:10"),
    )
    p.add_argument("bot", metavar="BOT", help=BOT_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--weights-checkpoint", metavar="PREFIX",
                     help="TF checkpoint with the head's weights [1536, n] and biases [n]")
    src.add_argument("--from-slim-checkpoint", metavar="PREFIX",
                     help="slim Inception-V4 checkpoint whose Logits layer becomes the head")
    p.add_argument("--labels", metavar="FILE", required=True,
                   help="labels file, one label per line, n lines for n classes")
    p.add_argument("--weights-name", metavar="NAME", default=None,
                   help="tensor name of the weights in --weights-checkpoint (default: weights)")
    p.add_argument("--biases-name", metavar="NAME", default=None,
                   help="tensor name of the biases in --weights-checkpoint (default: biases)")
    p.add_argument("--tenant", metavar="NAME", default=None, help=TENANT_HELP)
    p.add_argument("--force", action="store_true",
                   help="with --from-slim-checkpoint: import even if its trunk differs from the "
                        "serving trunk (or without comparing, if there is no serving trunk)")
    p.add_argument("--candidate", metavar="MODE", default=None, help=CANDIDATE_HELP)
    p.set_defaults(func=cmd_register, _parser=p)

    p = sub.add_parser(
        "train", parents=[store, trunk, features_option()], formatter_class=fmt,
        help="train a bot's head on a folder of labelled images",
        description=(
            "Train a head for BOT from DIR/<label>/*.{jpg,jpeg,png} (one sub-directory per\n"
            "label, at least 2) and register it as a new active version. Images go through\n"
            "the serving trunk in batches (progress bar on stderr); a softmax regression with\n"
            "L2 is fitted on the features, early-stopped on a held-out split, and the\n"
            "held-out accuracy of each class is printed."),
        epilog="example:\n  multihead train acme --images photos/",
    )
    p.add_argument("bot", metavar="BOT", help=BOT_HELP)
    p.add_argument("--images", metavar="DIR", required=True,
                   help="folder with one sub-directory of images per label")
    p.add_argument("--epochs", type=int, default=500,
                   help="maximum epochs, one full-batch gradient step each (default: 500)")
    p.add_argument("--patience", type=int, default=50,
                   help="stop after this many epochs without held-out improvement (default: 50)")
    p.add_argument("--l2", type=float, default=1e-3, help="L2 weight decay (default: 0.001)")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="gradient step size (default: 1/L from the features' largest eigenvalue)")
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="fraction of each label held out for early stopping (default: 0.2)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="images per trunk run (default: 16)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the held-out split (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tenant", metavar="NAME", default=None, help=TENANT_HELP)
    p.add_argument("--candidate", metavar="MODE", default=None, help=CANDIDATE_HELP)
    p.set_defaults(func=cmd_train, _parser=p)

    bots = sub.add_parser(
        "bots", help="list, show, remove, roll back registered bots; promote or discard their "
                     "candidates",
        description="Inspect and administer the bots registered in a store.")
    bots_sub = bots.add_subparsers(dest="bots_command", required=True, metavar="ACTION")

    p = bots_sub.add_parser("list", parents=[store], help="list registered bots",
                            description="List every registered bot with its active version.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--tenant", metavar="NAME", default=None, help="only this tenant's bots")
    p.set_defaults(func=cmd_list)

    p = bots_sub.add_parser("show", parents=[store], help="show one bot",
                            description="Show a bot's active version, labels, versions on disk, "
                                        "candidate and history.")
    p.add_argument("bot", metavar="BOT", help="bot id")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_show)

    p = bots_sub.add_parser("remove", parents=[store], help="unregister a bot, delete its files",
                            description="Unregister BOT and delete every version of its head. "
                                        "Running servers stop serving it within a second.")
    p.add_argument("bot", metavar="BOT", help="bot id")
    p.set_defaults(func=cmd_remove)

    p = bots_sub.add_parser(
        "rollback", parents=[store], help="make an earlier version active",
        description="Make another version of BOT active: --to VERSION, or by default the "
                    "highest version below the active one. Running servers switch within a "
                    "second.")
    p.add_argument("bot", metavar="BOT", help="bot id")
    p.add_argument("--to", metavar="VERSION", type=int, default=None,
                   help="version to activate (default: the previous one)")
    p.set_defaults(func=cmd_rollback)

    p = bots_sub.add_parser(
        "promote", parents=[store], help="make a bot's candidate its active version",
        description="Make BOT's candidate (registered with --candidate) its active version. "
                    "The version active until now stays stored: `multihead bots rollback BOT` "
                    "goes back to it. Running servers switch within a second.")
    p.add_argument("bot", metavar="BOT", help="bot id")
    p.set_defaults(func=cmd_promote)

    p = bots_sub.add_parser(
        "discard", parents=[store], help="delete a bot's candidate",
        description="Delete BOT's candidate (registered with --candidate) and its version; "
                    "the active version goes on alone. Running servers stop scoring it within "
                    "a second.")
    p.add_argument("bot", metavar="BOT", help="bot id")
    p.set_defaults(func=cmd_discard)


def _tenant(args: argparse.Namespace) -> dict:
    """The `tenant=` (and `candidate=`) of a registration: --tenant if given (else the store's
    default), --candidate if given."""
    out = {"tenant": args.tenant} if args.tenant else {}
    if getattr(args, "candidate", None) is not None:
        out["candidate"] = args.candidate
    return out


def _candidate(args: argparse.Namespace) -> None:
    """--candidate checked before anything is read (InvalidCandidate: one line, exit 2)."""
    if args.candidate is not None:
        from accounts.candidates import CandidateMode

        args.candidate = CandidateMode.parse(args.candidate)


def _registered(args: argparse.Namespace, store, bot_id: str, version: int, n: int) -> str:
    where = redact_url(store_dir(args))
    if args.candidate is None:
        return f"registered bot '{bot_id}' version {version} ({n} classes) in {where}"
    active = store.info(bot_id).version
    return (f"registered bot '{bot_id}' version {version} ({n} classes) in {where} as its "
            f"candidate ({args.candidate}); version {active} stays active")

def _print_int8_agreement(args: argparse.Namespace, store, bot_id: str) -> None:
    """After a registration: the new version's agreement with the INT8 trunk of the serving
    checkpoint (the newest calibrated for it; nothing where there is none), printed and
    recorded beside it, so that `serve` does not score it again. Never fails the command:
    the version is registered already."""
    from backbone.checkpoint import cache_dir_of, resolve_prefix
    from backbone.errors import BackboneError
    from backbone.gate import MIN_HEAD_AGREEMENT, agreement, bound_percent, percent
    from backbone.quantize import Int8Artifact
    from service.core.bots import agreement_key

    try:
        prefix = resolve_prefix(trunk_prefix(args))
        found = Int8Artifact.available(cache_dir_of(prefix), prefix)
    except (BackboneError, OSError):  # no serving trunk here: no INT8 trunk either
        return
    if not found:
        return
    artifact, info = found[0], store.info(bot_id)
    if args.candidate is None:
        head, version, created, what = store.get(bot_id), info.version, info.created, "version"
    else:
        head, version, created = (store.candidate(bot_id).head, info.candidate.version,
                                  info.candidate.created)
        what = "candidate version"
    try:
        held_out = artifact.held_out()
    except (OSError, ValueError) as exc:
        print(f"warning: INT8 trunk agreement not measured: {exc}", file=sys.stderr)
        return
    value = agreement(held_out, head.weights, head.biases)
    artifact.record_agreements({agreement_key(bot_id, version, created): value})
    line = (f"INT8 trunk agreement: bot '{bot_id}' {what} {version} keeps its top-1 class on "
            f"{percent(value)} of the INT8 trunk's {held_out.images} held-out images (bound >= "
            f"{bound_percent(MIN_HEAD_AGREEMENT)})")
    if not value >= MIN_HEAD_AGREEMENT:
        line += ("; below it, `serve --precision auto` serves the float trunk from its next "
                 "start" + (" once it is promoted" if args.candidate is not None else ""))
    print(line)


# -- register ------------------------------------------------------------------------------------


def cmd_register(args: argparse.Namespace) -> int:
    from heads.files import read_labels
    from heads.head import validate_bot_id

    bot_id = validate_bot_id(args.bot)
    if args.from_slim_checkpoint and (args.weights_name or args.biases_name):
        args._parser.error("--weights-name/--biases-name go with --weights-checkpoint")
    if args.weights_checkpoint and args.force:
        args._parser.error("--force goes with --from-slim-checkpoint")
    _candidate(args)
    labels = read_labels(args.labels)
    if args.weights_checkpoint:
        with open_store(args) as store:
            version = store.register_checkpoint(
                bot_id, args.weights_checkpoint, labels,
                weights_name=args.weights_name or "weights",
                biases_name=args.biases_name or "biases", **_tenant(args))
            print(_registered(args, store, bot_id, version, len(labels)))
            _print_int8_agreement(args, store, bot_id)
    else:
        from backbone.checkpoint import checkpoint_exists

        serving = trunk_prefix(args)
        # NOTE: checkpoint_exists knows both layouts: a V2 prefix (.index) and the official
        # model-zoo V1 single file.
        if not checkpoint_exists(serving) and not Path(serving).is_dir():
            if not args.force:
                from heads.errors import HeadLoadError

                raise HeadLoadError(
                    f"no serving trunk checkpoint at '{serving}' to compare the slim "
                    "checkpoint's trunk with: pass --trunk-checkpoint, run `multihead "
                    "init-trunk`, or --force to import without the comparison")
            print(f"warning: no serving trunk at '{serving}'; importing without comparing trunks",
                  file=sys.stderr)
            serving = None
        with open_store(args) as store:
            version = store.register_from_slim(bot_id, args.from_slim_checkpoint, labels,
                                               serving_trunk_prefix=serving, force=args.force,
                                               **_tenant(args))
            print(_registered(args, store, bot_id, version, len(labels)))
            _print_int8_agreement(args, store, bot_id)
    return 0


# -- train ---------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace, *, trunk=None) -> int:
    """`multihead train`. `trunk` lets tests pass the session's trunk instead of building one."""
    from heads.head import validate_bot_id
    from heads.train import extract_features, scan_image_folder, train_head

    bot_id = validate_bot_id(args.bot)
    for name in ("epochs", "patience", "batch_size"):
        if getattr(args, name) < 1:
            args._parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.val_fraction < 1.0:
        args._parser.error("--val-fraction must be in [0, 1)")
    if not args.l2 >= 0 or (args.learning_rate is not None and not args.learning_rate > 0):
        args._parser.error("--l2 must be >= 0 and --learning-rate > 0")
    _candidate(args)
    folder = scan_image_folder(args.images)  # refusals before the trunk is built
    print(f"{len(folder.paths)} images, {len(folder.labels)} labels in {folder.root}",
          file=sys.stderr)
    own_trunk = trunk is None
    if own_trunk:
        from backbone import Trunk
        from backbone.checkpoint import cache_dir_of, resolve_prefix
        from service.core.bots import Int8Agreement

        # The trunk `serve` runs: its graph, compiled models and INT8 trunk next to it, the
        # INT8 trunk only where its gate passes for the registered bots.
        prefix = resolve_prefix(trunk_prefix(args))
        with open_store(args) as store:
            trunk = Trunk.from_checkpoint(prefix, graph_cache_dir=cache_dir_of(prefix),
                                          heads=Int8Agreement(store).judge,
                                          **trunk_kwargs(args))
    try:
        data = extract_features(folder, trunk, batch_size=args.batch_size,
                                progress=not args.no_progress)
    finally:
        if own_trunk:
            trunk.close()
    for path, reason in data.skipped:
        print(f"warning: skipped '{path}': {reason}", file=sys.stderr)
    result = train_head(data.features, data.label_idx, data.labels, l2=args.l2, seed=args.seed,
                        val_fraction=args.val_fraction, epochs=args.epochs,
                        patience=args.patience, learning_rate=args.learning_rate)
    _print_accuracy(result)
    with open_store(args) as store:
        version = store.register(bot_id, result.weights, result.biases, result.labels,
                                 source=f"train:{os.path.abspath(args.images)}",
                                 **_tenant(args))
        print(_registered(args, store, bot_id, version, len(result.labels)))
        _print_int8_agreement(args, store, bot_id)
    return 0


def _print_accuracy(result) -> None:
    labels = {label: shown_text(label) for label in result.labels}
    width = max(len("label"), *(len(label) for label in labels.values()))
    print(f"held-out accuracy per class ({result.n_val} held out, {result.n_train} trained on; "
          f"best epoch {result.best_epoch} of {result.epochs_run}):")
    print(f"  {'label':<{width}}  correct  accuracy")
    for label in result.labels:
        count = result.per_class_val_count[label]
        acc = result.per_class_val_accuracy[label]
        if count:
            print(f"  {labels[label]:<{width}}  {round(acc * count):>3}/{count:<3}  {acc:8.3f}")
        else:
            print(f"  {labels[label]:<{width}}    -/0    (nothing held out)")
    if math.isnan(result.val_accuracy):
        print("overall: nothing held out (too few images per label)")
    else:
        print(f"overall: {result.val_accuracy:.3f} held-out accuracy "
              f"(chance {1 / len(result.labels):.3f}), training accuracy "
              f"{result.train_accuracy:.3f}")


# -- bots ----------------------------------------------------------------------------------------

SHOWN_LABEL_CHARS = 80  # of one label in `bots show`, before "..." (a version stored before the
# label rules may hold a megabyte)


def shown_text(text: str, limit: int | None = None) -> str:
    """Text a tenant chose (a label, a source), safe on the operator's terminal: escaped
    (`heads.escape_text`: no control character reaches it, so no cursor move or ANSI escape
    sequence), and cut at `limit` characters."""
    from heads import escape_text

    if limit is not None and len(text) > limit:
        return escape_text(text[:limit]) + "..."
    return escape_text(text)



def cmd_list(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        bots = store.list(args.tenant)
    if args.json:
        print(json.dumps([b.to_dict() for b in bots], indent=2))
        return 0
    if not bots:
        print(f"no bots registered in {redact_url(store_dir(args))}")
        return 0
    rows = [("BOT", "TENANT", "VERSION", "CLASSES", "VERSIONS", "CANDIDATE", "CREATED",
             "SOURCE")]
    rows += [(b.bot_id, b.tenant, str(b.version), str(b.n_classes),
              ",".join(map(str, b.versions)),
              f"v{b.candidate.version} {b.candidate.mode}" if b.candidate else "-",
              b.created, shown_text(b.source)) for b in bots]
    widths = [max(len(r[i]) for r in rows) for i in range(7)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[7])
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from heads.head import validate_bot_id

    bot_id = validate_bot_id(args.bot)
    with open_store(args) as store:
        info = store.info(bot_id)
        history = store.history(bot_id)
    if args.json:
        print(json.dumps({**info.to_dict(), "history": history}, indent=2))
        return 0
    shown = ", ".join(shown_text(label, SHOWN_LABEL_CHARS) for label in info.labels[:20]) + (
        f", ... (+{info.n_classes - 20} more)" if info.n_classes > 20 else "")
    print(f"bot:       {info.bot_id}")
    print(f"version:   {info.version} (active)")
    print(f"versions:  {', '.join(map(str, info.versions))}")
    print(f"classes:   {info.n_classes}")
    print(f"labels:    {shown}")
    print(f"created:   {info.created}")
    print(f"source:    {shown_text(info.source)}")
    if info.candidate is None:
        print("candidate: none")
    else:
        c = info.candidate
        print(f"candidate: v{c.version} {c.mode} ({c.n_classes} classes, registered "
              f"{c.created}, source {shown_text(c.source)})")
    print("history:")
    for h in history:
        what = {"register": f"registered v{h['version']}",
                "rollback": f"v{h['previous']} -> v{h['version']}",
                "remove": f"removed (was v{h['previous']})",
                "candidate": f"v{h['version']} stored as the candidate",
                "promote": f"v{h['previous']} -> v{h['version']} (the candidate)",
                "discard": f"candidate v{h['version']} deleted"}.get(h["action"], h["action"])
        print(f"  {h['at']}  {h['action']:<9}  {what}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from heads.head import validate_bot_id

    bot_id = validate_bot_id(args.bot)
    with open_store(args) as store:
        versions = store.info(bot_id).versions
        store.remove(bot_id)
    print(f"removed bot '{bot_id}' (versions {', '.join(map(str, versions))})")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from heads.head import validate_bot_id

    bot_id = validate_bot_id(args.bot)
    with open_store(args) as store:
        before = store.info(bot_id).version
        after = store.rollback(bot_id, to=args.to)
    if after == before:
        print(f"bot '{bot_id}': version {after} is already active")
    else:
        print(f"bot '{bot_id}': active version {before} -> {after}")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    from heads.head import validate_bot_id

    bot_id = validate_bot_id(args.bot)
    with open_store(args) as store:
        before, after = store.promote(bot_id)
    print(f"bot '{bot_id}': active version {before} -> {after} (its candidate); "
          f"`multihead bots rollback {bot_id}` goes back to {before}")
    return 0


def cmd_discard(args: argparse.Namespace) -> int:
    from heads.head import validate_bot_id

    bot_id = validate_bot_id(args.bot)
    with open_store(args) as store:
        version = store.discard(bot_id)
        active = store.info(bot_id).version
    print(f"bot '{bot_id}': candidate version {version} deleted; version {active} stays active")
    return 0
