"""The run's INT8 trunk: calibrated once per run by `multihead quantize` itself (a child
process, as a user runs it) on images the benchmark generates, and placed where `multihead
serve` looks for it, so that the servers of the run pick it by default when it passes.

- The calibration images are the run's own kind of upload (`bench.load.make_jpeg`) with seeds
  of their own: never the images the trunk section compares or the loads send.
  `plan.int8_samples` calibrate and `plan.int8_held_out` are held out for the fidelity report
  (`multihead quantize` splits them by its seeded shuffle).
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

from bench.context import say

if TYPE_CHECKING:  # pragma: no cover
    from bench.context import Context

CACHE = "int8-cache"  # under the run's output directory
LOG = "int8-calibration.log"  # `multihead quantize`'s output, under the output directory
IMAGE_SEED = 50_000  # seeds of the calibration images: far from the uploads' 0..images-1


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
    """`count` generated 640x480 JPEGs under `directory` (seeded: the same bytes every run)."""
    from bench.load import make_jpeg

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = directory / f"image-{index:03d}.jpg"
        path.write_bytes(make_jpeg(IMAGE_SEED + index))
        paths.append(path)
    return paths


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
    from bench.load import child_env, multihead_command

    plan = context.plan
    prefix = context.prefix
    store, _ = context.service_store()  # its bots: the heads whose top-1 agreement is checked
    target = cache_dir_of(prefix)  # where `serve --trunk-checkpoint <prefix>` looks
    target.mkdir(parents=True, exist_ok=True)
    cache = context.out_dir / CACHE
    for path in _files(cache):  # an earlier run's artifact; used only if its key is ours
        shutil.copy2(path, target / path.name)
    cached = {artifact.key for artifact in Int8Artifact.available(target, prefix)}
    images = write_images(context.tmp / "int8-images", plan.int8_samples + plan.int8_held_out)
    command = multihead_command("quantize") + [
        "--images", str(images[0].parent), "--samples", str(plan.int8_samples),
        "--trunk-checkpoint", prefix, "--store", str(store), "--force",
        # NOTE: the run's bots are random heads on a random trunk (near ties everywhere): the
        # gate fails them whatever layers stay in float, and NNCF's accuracy control would
        # spend 10 min to an hour finding that out (docs/performance.md).
        "--no-accuracy-control"]
    say(f"INT8 trunk: multihead quantize on {plan.int8_samples} + {plan.int8_held_out} "
        f"generated images (log: {context.out_dir / LOG}) ...")
    start = time.perf_counter()
    with open(context.out_dir / LOG, "ab") as log:
        log.write(f"$ {' '.join(command)}\n".encode())
        log.flush()
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=child_env(), timeout=3600).returncode
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
    say(f"INT8 trunk {ours.xml_path.name}: "
        f"{'reused' if ours.key in cached else 'calibrated'} in {took:.0f} s, fidelity "
        f"{'PASS' if ours.passed else 'below a bound'} (min cosine "
        f"{meta['fidelity']['min_cosine']:.6f})")
    return {"artifact": ours.xml_path.name, "key": ours.key, "passed": bool(ours.passed),
            "reused": ours.key in cached, "quantize_s": took,
            "samples": plan.int8_samples, "held_out": plan.int8_held_out,
            "calibration": meta["calibration"], "fidelity": meta["fidelity"],
            "float_precision": meta.get("float_precision")}
