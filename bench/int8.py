"""The run's INT8 trunk: calibrated once per run by `multihead quantize` itself (a child
process, as a user runs it) on images the benchmark generates, and placed where `multihead
serve` looks for it, so that the servers of the run pick it by default when it passes.

- Its gate judges heads trained as users train them (issue 31, item 4): one bot per kind of the
  demo's class-structured generated images (`heads.demo_images`: colours, scenes, light),
  trained by `multihead train` (a child process) on the run's trunk into a store of their own,
  on the demo's training images. The calibration and held-out images are the same kinds with a
  seed of their own (`IMAGE_SEED`), the labels in turn: never an image the bots trained on,
  nor the uploads the loads send. `plan.int8_samples` calibrate and `plan.int8_held_out` are
  held out for the fidelity report (`multihead quantize` splits them by its seeded shuffle).
- The service store's random bots (`plan.bots` random heads, near ties everywhere on a random
  trunk) are scored on the same held-out features, one matmul each, as an information row
  (`random_heads`): they are not what the gate is for, and `serve` judges them itself when
  it starts on that store.
- `--force`: an INT8 trunk below a fidelity bound is kept, marked failing, as `multihead demo`
  keeps one: the trunk section still times it (and `--check` reports the bound it misses),
  while `serve`'s `auto` does not pick it.
- The artifact is kept in `<output>/int8-cache/` too: the next run with the same checkpoint,
  images and library versions copies it back and `multihead quantize` reuses it
  ("already calibrated") instead of calibrating again.

The trunk and service sections call `ensure_int8`; whichever runs first calibrates. The
sections after them serve the same trunk `serve` picks with it in place.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.context import say
from heads.demo_images import KINDS, PER_CLASS, demo_image, write_demo_images

if TYPE_CHECKING:  # pragma: no cover
    from bench.context import Context

CACHE = "int8-cache"  # under the run's output directory
LOG = "int8-calibration.log"  # `multihead quantize`'s output, under the output directory
# Seed of the calibration and held-out images: not the demo's training (0) or held-out (1)
# images, which the gate's bots train on.
IMAGE_SEED = 50_000
TRAIN_SEED = 0  # the gate's bots train on the demo's own training images
GATE_STORE = "int8-gate-store"  # under the run's temp dir: the bots the gate judges


def why_not() -> str | None:
    """Why this environment cannot make an INT8 trunk (None: it can)."""
    from backbone.runners.registry import available

    if "openvino" not in available():
        return "OpenVINO is not installed (the openvino extra)"
    if importlib.util.find_spec("nncf") is None:
        return "NNCF is not installed (the openvino extra)"
    return None


def _files(directory: Path, key: str | None = None) -> list[Path]:
    from backbone.quantize import PREFIX

    pattern = f"{PREFIX}{key}.*" if key else f"{PREFIX}*"
    return sorted(p for p in directory.glob(pattern) if p.suffix in (".xml", ".bin", ".json"))


def write_images(directory: Path, count: int) -> list[Path]:
    """`count` generated labelled images under `directory/<kind>/<label>/`, the demo's kinds
    with the labels in turn (seeded: the same bytes every run), sorted by path."""
    labels = [(kind, label) for kind, names in KINDS.items() for label in names]
    paths = []
    for index in range(count):
        kind, label = labels[index % len(labels)]
        path = directory / kind / label / f"{index // len(labels):03d}.png"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            demo_image(kind, label, index // len(labels), IMAGE_SEED).save(path)
        paths.append(path)
    return sorted(paths)


def train_gate_bots(context: Context, log) -> Path:
    """The store of the bots the gate judges: one per demo kind, trained by `multihead train`
    on the run's trunk (its log appended to `log`); returns the store."""
    from bench.load import multihead_command

    store = context.tmp / GATE_STORE
    for kind in KINDS:
        folder = write_demo_images(context.tmp / "int8-train-images", kind, PER_CLASS,
                                   seed=TRAIN_SEED)
        command = multihead_command("train") + [
            "--store", str(store), "--trunk-checkpoint", context.prefix, "--images",
            str(folder), "--no-progress", "--seed", "0", kind]
        code = _run(command, log)
        if code != 0:
            raise RuntimeError(f"multihead train {kind} exited with {code} (log: {LOG})")
    return store


def _run(command: list[str], log) -> int:
    """Runs a `multihead` command, its output appended to `log`; returns its exit code."""
    from bench.load import child_env

    log.write(f"$ {' '.join(command)}\n".encode())
    log.flush()
    return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, env=child_env(), timeout=3600).returncode


def random_heads(held_out, store: Path) -> dict:
    """The top-1 agreement of the store's bots (the service store's random heads) on the INT8
    trunk's held-out features: {bots, lowest: [bot, share], mean, below_bound}."""
    from backbone.gate import MIN_HEAD_AGREEMENT, agreement
    from store import HeadStore

    values = {}
    with HeadStore(str(store)) as heads:
        for info in heads.list():
            head = heads.get(info.bot_id)
            values[info.bot_id] = agreement(held_out, head.weights, head.biases)
    if not values:
        return {"bots": 0}
    lowest = min(values, key=lambda k: (values[k], k))
    return {"bots": len(values), "lowest": [lowest, values[lowest]],
            "mean": float(np.mean(list(values.values()))),
            "below_bound": sum(1 for v in values.values() if not v >= MIN_HEAD_AGREEMENT)}


def ensure_int8(context: Context) -> dict:
    """The run's INT8 trunk, calibrated on the first call (see the module docstring); later
    calls return the same dict: {"skipped": why} where it cannot be made, {"error": ...} when
    the calibration failed, else the artifact's file name, key, whether it passed, whether it
    was reused from the output's cache, the seconds `multihead quantize` took, and the
    calibration and fidelity it recorded."""
    if context.int8 is None:
        reason = why_not()
        if reason is not None:
            context.int8 = {"skipped": reason}
        else:
            try:
                context.int8 = _calibrate(context)
            except Exception as exc:  # noqa: BLE001 - the float rows are still worth measuring
                context.record_error("int8-calibration", exc)
                context.int8 = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return context.int8


def _calibrate(context: Context) -> dict:
    from backbone.checkpoint import cache_dir_of
    from backbone.quantize import Int8Artifact
    from bench.load import multihead_command

    plan = context.plan
    prefix = context.prefix
    target = cache_dir_of(prefix)  # where `serve --trunk-checkpoint <prefix>` looks
    target.mkdir(parents=True, exist_ok=True)
    cache = context.out_dir / CACHE
    images = context.tmp / "int8-images"
    write_images(images, plan.int8_samples + plan.int8_held_out)
    say(f"INT8 trunk: {len(KINDS)} bots trained on generated images, then multihead quantize "
        f"on {plan.int8_samples} + {plan.int8_held_out} others (log: {context.out_dir / LOG}) "
        "...")
    start = time.perf_counter()
    with open(context.out_dir / LOG, "ab") as log:
        # NOTE: before an earlier run's INT8 trunk is copied back: `train` runs the trunk
        # `serve` would, and that one must be float here, as on a first run.
        store = train_gate_bots(context, log)
        trained = time.perf_counter() - start
        for path in _files(cache):  # an earlier run's artifact; used only if its key is ours
            shutil.copy2(path, target / path.name)
        cached = {artifact.key for artifact in Int8Artifact.available(target, prefix)}
        command = multihead_command("quantize") + [
            "--images", str(images), "--samples", str(plan.int8_samples),
            "--trunk-checkpoint", prefix, "--store", str(store), "--force",
            # NOTE: on the seeded random trunk the gate's bots flip on about 15 % of the
            # images whatever layers stay in float (docs/performance.md, "The INT8 gate on the
            # demo"); NNCF's accuracy control would spend 10 min to an hour finding that out.
            "--no-accuracy-control"]
        start = time.perf_counter()
        code = _run(command, log)
    took = time.perf_counter() - start
    found = Int8Artifact.available(target, prefix)  # newest first: the one just made or reused
    if code != 0 or not found:
        tail = (context.out_dir / LOG).read_text("utf-8", errors="replace").splitlines()[-5:]
        raise RuntimeError(f"multihead quantize exited with {code}: {' | '.join(tail)}")
    ours = found[0]
    # Only ours stays where `serve` looks (it would take the newest passing one), and only
    # ours is kept for the next run.
    for path in _files(target):
        if not path.name.startswith(ours.xml_path.stem + "."):
            path.unlink()
    for path in _files(cache):
        path.unlink()
    cache.mkdir(parents=True, exist_ok=True)
    for path in _files(target, ours.key):
        shutil.copy2(path, cache / path.name)
    meta = ours.metadata()
    random = random_heads(ours.held_out(), context.service_store()[0])
    say(f"INT8 trunk {ours.xml_path.name}: "
        f"{'reused' if ours.key in cached else 'calibrated'} in {took:.0f} s, gate "
        f"{'PASS' if ours.passed else 'below a bound'} ({ours.report().summary()})")
    return {"artifact": ours.xml_path.name, "key": ours.key, "passed": bool(ours.passed),
            "reused": ours.key in cached, "quantize_s": took, "train_s": trained,
            "samples": plan.int8_samples, "held_out": plan.int8_held_out,
            "calibration": meta["calibration"], "fidelity": meta["fidelity"],
            "float_precision": meta.get("float_precision"), "random_heads": random}
