"""`multihead serve`: run the HTTP service."""
from __future__ import annotations

import argparse
import os
import threading

from service.core import logs
from service.core.errors import ServiceError
from service.core.settings import Settings


def add_commands(sub) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the HTTP service (classify, bots, admin, health, metrics)",
        description=(
            "Build the shared Inception-V4 trunk once, warm it up, and serve every registered "
            "bot of the store over HTTP. Each option can also be set with the environment "
            "variable named in its help (flags win). Without --trunk-checkpoint the store's "
            "trunk is used: <store>/trunk/inception_v4.ckpt (the official checkpoint) if "
            "present, else <store>/trunk/demo_inception_v4.ckpt (written by `multihead demo`); "
            "with neither, serve refuses to start. With --ray the same service runs as "
            "--replicas processes on Ray Serve behind Ray's HTTP proxy (a postgresql:// "
            "--store lets replicas on several machines share the bots)."),
    )
    Settings.add_arguments(parser)
    parser.add_argument("--log-level", default="INFO",
                        help="logging level (default: INFO; the access lines are INFO)")
    parser.set_defaults(func=run_serve)


def require_trunk(settings: Settings) -> str:
    """The trunk checkpoint to serve; refuses (CheckpointError, one line) when there is none.

    NOTE: `serve` never creates a trunk: a random-weight trunk served by accident answers
    nonsense with full confidence. Only `multihead demo` (and so `make serve`) writes the demo
    trunk.
    """
    from backbone.checkpoint import checkpoint_exists, default_trunk_checkpoint
    from backbone.errors import CheckpointError

    if settings.trunk_checkpoint:
        if not checkpoint_exists(settings.trunk_checkpoint) and \
                not os.path.isdir(settings.trunk_checkpoint):
            raise CheckpointError(f"trunk checkpoint not found: '{settings.trunk_checkpoint}'")
        return settings.trunk_checkpoint
    prefix = default_trunk_checkpoint(settings.store)
    if not checkpoint_exists(prefix):
        raise CheckpointError(
            f"no trunk checkpoint in '{settings.store}/trunk': drop the official "
            f"inception_v4.ckpt there, pass --trunk-checkpoint, or create the demo trunk and "
            f"bots with `multihead demo --store {settings.store}`")
    return prefix


def check_precision_and_runtime(settings: Settings, prefix: str) -> None:
    """Refuses at start (one line) a precision or runtime this CPU cannot run (int8 also
    without an INT8 trunk for `prefix`), when the trunk will be on the CPU; on a GPU machine
    the bring-up decides (and /readyz reports it)."""
    from backbone.checkpoint import cache_dir_of, resolve_prefix
    from backbone.device import cpu_device_if_known
    from backbone.trunk import choose

    device = cpu_device_if_known(settings.device)
    if device is not None:
        prefix = resolve_prefix(prefix)  # a directory holding a checkpoint: the one in it
        choose(prefix, device=device, precision=settings.precision, runtime=settings.runtime,
               int8_dir=cache_dir_of(prefix))


def require_pinned_bots(settings: Settings) -> None:
    """Refuses at start (PreloadError, one line) a `--pin` naming a bot the store does not have:
    the service could never become ready."""
    if not settings.pinned_bots:
        return
    from service.core.lifecycle import check_pinned_bots
    from store import HeadStore
    from store.backend import redact_url

    with HeadStore(settings.store) as store:
        check_pinned_bots(store, settings.pinned_bots,
                          where=f"store '{redact_url(settings.store)}'")


def start_trunk(settings: Settings, prefix: str) -> tuple[str, ...]:
    """Gets the trunk going before the HTTP server is up, as `serve` plans it before the
    store's bots are known: where its load needs no TensorFlow (a compiled trunk in the cache,
    an INT8 trunk), loads and warms it at batch 1 (`backbone.trunk.prefetch`: the bring-up's
    load of an equal plan takes it; the bring-up plans again with the bots' INT8 agreement);
    else imports what the load needs (TensorFlow: 3-5 s). Returns the packages the load needs;
    () when the plan fails (the bring-up reports why)."""
    from backbone import Trunk
    from backbone.checkpoint import cache_dir_of
    from backbone.trunk import import_packages, prefetch

    try:
        plan = Trunk.plan(prefix, device=settings.device, precision=settings.precision,
                          runtime=settings.runtime, int8_dir=cache_dir_of(prefix),
                          graph_cache_dir=cache_dir_of(prefix) if settings.graph_cache else None)
        packages = plan.packages
        if plan.needs_tensorflow:
            import_packages(packages, plan.request.device)
        else:
            prefetch(plan, warmup_batch_sizes=(1,) if settings.warmup else ())
    except Exception:  # noqa: BLE001 - only a head start: the bring-up decides and reports
        return ()
    return packages


def run_serve(args: argparse.Namespace) -> int:
    settings = Settings.from_env_and_args(args)
    prefix = None
    if not (settings.ray and settings.deployment.ray_address):
        # NOTE: on a Ray cluster the replicas find the trunk on their own machines, and the
        # CPU they run on is theirs: their bring-up reports either failing.
        prefix = require_trunk(settings)
        check_precision_and_runtime(settings, prefix)
    require_pinned_bots(settings)
    logs.configure(settings.log_format, args.log_level)
    # Get the trunk going at once, beside the rest of start-up (the HTTP server's imports):
    # loaded where no TensorFlow is needed, else its packages imported (TensorFlow: about 3-5 s
    # on 2 cores). The bring-up takes the trunk, or waits for the imports through their lock.
    if not settings.ray and prefix is not None:  # under Ray the replicas load it
        threading.Thread(target=start_trunk, args=(settings, prefix), daemon=True,
                         name="multihead-start-trunk").start()
    if settings.ray:
        try:
            from service.transports.ray import serve as ray_serve
        except ImportError as exc:
            raise ServiceError(f"--ray needs Ray Serve ({exc.name} is missing): "
                               f"pip install 'multihead[ray]'") from None
        ray_serve.run(settings)
        return 0
    from service.transports.http.app import (
        run_app,  # aiohttp: imported only by the command that serves
    )

    listeners = []
    if settings.grpc_port is not None:
        from service.transports.grpc.server import GrpcServer  # grpc: imported only when it serves

        listeners.append(GrpcServer)
    run_app(settings, listeners)
    return 0
