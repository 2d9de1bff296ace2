"""`multihead quantize`: an INT8 trunk calibrated on the user's images, kept where it gives the
float trunk's answers.

The images are split once, by a seeded shuffle of their sorted paths: up to --samples of them
calibrate NNCF's post-training quantization (`backbone.quantize`); the rest, up to
HELD_OUT_MAX, are held out and run through the fp32 and the int8 trunk, and the gate
(`backbone.gate`) judges the registered bots' answers on them before anything is written.
Where plain calibration misses it, NNCF's accuracy control keeps the fewest layers in float
that pass it (unless --no-accuracy-control). Below a bound the command exits 2 and writes
nothing, unless --force. The held-out features are kept with the INT8 trunk: a bot
registered later is judged from them at once.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from backbone.gate import MIN_HEAD_AGREEMENT, MIN_MEAN_COSINE, MIN_OVERALL_AGREEMENT, bound_percent
from backbone.quantize import DEFAULT_SAMPLES
from cli.options import store_dir, store_option, trunk_option, trunk_prefix
from heads.train import IMAGE_EXTENSIONS

# Held-out images for the fidelity report. At least MIN_HELD_OUT so a report means something
# (taken from the calibration share when the folder is small); at most HELD_OUT_MAX: with 100
# images the 99 % top-1 bound tolerates one disagreement (with fewer it tolerates none), and
# each held-out image costs one fp32 and one int8 forward, far less than calibrating on it.
MIN_HELD_OUT = 8
HELD_OUT_MAX = 100
SPLIT_SEED = 0


def add_commands(sub) -> None:
    """Add `quantize` to `multihead`."""
    p = sub.add_parser(
        "quantize", parents=[store_option(), trunk_option()],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="calibrate an INT8 trunk on your images (NNCF) and keep it if it is faithful",
        description=(
            "Quantize the trunk to INT8 with NNCF's post-training quantization of the same\n"
            "frozen tf-slim graph, calibrated on the images under --images (.jpg/.jpeg/.png,\n"
            "searched recursively, decoded and preprocessed as for serving).\n\n"
            f"A seeded shuffle splits them: up to --samples calibrate, up to {HELD_OUT_MAX} of\n"
            f"the rest (at least {MIN_HELD_OUT}) are held out. On those the INT8 trunk must give\n"
            "the float trunk's answers (the gate): every registered bot of the store keeps its\n"
            f"top-1 class on >= {bound_percent(MIN_HEAD_AGREEMENT)} of them, all bots' answers "
            f"together >= {bound_percent(MIN_OVERALL_AGREEMENT)},\n"
            f"and the features' mean cosine with fp32 is >= {MIN_MEAN_COSINE} (without a bot,\n"
            "it alone decides). Where plain calibration misses it, NNCF's accuracy control\n"
            "quantizes again, keeping the fewest layers in float that pass (minutes more;\n"
            "--no-accuracy-control skips it). Below a bound the command exits 2 and writes\n"
            "nothing, unless --force. The report names the held-out images of lowest cosine\n"
            "(reported, not gated) and their feature norm against the median image's (on the\n"
            "demo images, low-signal and unusually strong pictures lost the most).\n\n"
            "The artifact (OpenVINO IR, the held-out features, a JSON with the calibration set,\n"
            "its date and the report) goes to graph_cache/ next to the trunk checkpoint, keyed\n"
            "by the checkpoint, the calibration images and the OpenVINO/NNCF/TensorFlow\n"
            "versions; an artifact of the same key is reused. A bot registered later is\n"
            "judged from the held-out features at once (`register` and `train` print its\n"
            "agreement; `serve --precision auto` serves the float trunk from its next start\n"
            "if a bot is below the bound). Needs the `openvino` extra."),
        epilog="example:\n  multihead quantize --images checkpoints/demo_images",
    )
    p.add_argument("--images", metavar="DIR", required=True,
                   help="folder of .jpg/.jpeg/.png images like those you will serve "
                        "(searched recursively)")
    p.add_argument("--samples", metavar="N", type=int, default=DEFAULT_SAMPLES,
                   help=f"calibration images (default: {DEFAULT_SAMPLES})")
    p.add_argument("--force", action="store_true",
                   help="write the artifact even below a bound (it is then marked as failing "
                        "and only an explicit int8 precision uses it)")
    p.add_argument("--no-accuracy-control", action="store_true",
                   help="where plain calibration misses the gate, do not quantize again with "
                        "NNCF's accuracy control (which keeps the fewest layers in float that "
                        "pass it: minutes more)")
    p.set_defaults(func=run_quantize, _parser=p)


def image_files(directory: Path) -> list[Path]:
    """The images under `directory`, sorted by path (hidden entries skipped)."""
    return sorted(p for p in directory.rglob("*")
                  if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
                  and not any(part.startswith(".") for part in p.relative_to(directory).parts))


def split(files: list[Path], samples: int) -> tuple[list[Path], list[Path]]:
    """(calibration, held-out) by a seeded shuffle; see the module docstring for the counts."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(files))
    calibration = min(samples, len(files) - MIN_HELD_OUT)
    picked = [files[i] for i in order]
    return picked[:calibration], picked[calibration:calibration + HELD_OUT_MAX]


def _preprocessed(files: list[Path], data: dict[Path, bytes]) -> np.ndarray:
    from backbone import preprocess
    from backbone.errors import BackboneError

    out = []
    for path in files:
        try:
            out.append(preprocess(data[path]))
        except BackboneError as exc:
            raise type(exc)(f"{path}: {exc}") from None
    return np.stack(out)  # [N, 299, 299, 3]


def _registered_heads(location: str) -> list[tuple]:
    """(BotInfo, Head) of every bot registered in the store: its active version."""
    from store import HeadStore

    with HeadStore(location) as store:
        return [(info, store.get(info.bot_id)) for info in store.list()]


def _judged(held_out, heads: list[tuple]):
    """The gate of `held_out` for `heads`, and each head's agreement under its key."""
    from backbone.gate import agreement, judge
    from service.core.bots import agreement_key

    values = {info.bot_id: agreement(held_out, head.weights, head.biases)
              for info, head in heads}
    keys = {agreement_key(info.bot_id, head.version, info.created): values[info.bot_id]
            for info, head in heads if head.version == info.version}
    return judge(held_out, values), keys


def run_quantize(args: argparse.Namespace) -> int:
    from backbone.checkpoint import resolve_prefix

    if args.samples < 1:
        args._parser.error("--samples must be >= 1")
    folder = Path(args.images)
    if not folder.is_dir():
        args._parser.error(f"--images {folder}: not a directory")
    files = image_files(folder)
    if len(files) < MIN_HELD_OUT + 1:
        args._parser.error(f"--images {folder}: {len(files)} images, need at least "
                           f"{MIN_HELD_OUT + 1} ({MIN_HELD_OUT} are held out for the report)")
    prefix = resolve_prefix(trunk_prefix(args))
    return calibrate(prefix, folder, files, samples=args.samples, store=store_dir(args),
                     force=args.force, accuracy_control=not args.no_accuracy_control)


def calibrate(prefix: str, folder: Path, files: list[Path], *, samples: int, store: str,
              force: bool = False, accuracy_control: bool = True) -> int:
    """Quantizes the trunk of checkpoint `prefix` on `files` (images under `folder`), judges
    its gate for the store's registered bots, and where plain calibration misses it (and
    `accuracy_control`), quantizes again keeping the fewest layers in float; writes the
    artifact to the checkpoint's cache directory if the gate passes (or `force`). Prints its
    report; returns the exit code (0 written or already there, 2 below a bound).
    `multihead demo` calls it on its own images, once its bots are trained."""
    from backbone import quantize as q
    from backbone.checkpoint import cache_dir_of
    from backbone.device import detect_device
    from backbone.gate import HeldOut
    from backbone.precision import float_layers_precision

    calibration, held_out = split(files, samples)
    data = {path: path.read_bytes() for path in calibration + held_out}
    # The trunk's graph cache, where `serve` keeps it: graph_cache/ next to the checkpoint.
    directory = cache_dir_of(prefix)
    artifact = q.Int8Artifact(directory, prefix=prefix,
                              calibration=q.calibration_digest(data[p] for p in calibration))
    if artifact.complete():
        meta = artifact.metadata()
        report = artifact.report()
        # NOTE: one below the gate for its heads, made without accuracy control (the demo's,
        # or --no-accuracy-control), is made again with it when asked.
        if report.passed or not accuracy_control or not report.agreement \
                or meta.get("float_layers", 0) > 0:
            print(f"already calibrated on these images ({meta['calibration']['date']}): "
                  f"{artifact.xml_path}")
            print("\n".join(report.lines()))
            return 0 if report.passed or force else 2
        print(f"calibrated before on these images ({meta['calibration']['date']}) below the "
              f"gate, without accuracy control: quantizing again with it")

    heads = _registered_heads(store)
    # The float layers run as an int8 trunk serves them: bf16 where the CPU has it.
    float_precision = float_layers_precision(detect_device("cpu"))
    print(f"trunk {prefix}: {len(calibration)} calibration and {len(held_out)} held-out images "
          f"from {folder}; {len(heads)} registered bot(s)", flush=True)
    held = _preprocessed(held_out, data)
    names = tuple(str(p.relative_to(folder)) for p in held_out)
    calibration_images = _preprocessed(calibration, data)
    fp32_model = q.float_model(prefix, graph_cache_dir=directory)
    fp32 = q.features(q.compile_model(fp32_model, float_precision="fp32"), held)
    start = time.perf_counter()
    int8_model = q.quantize(fp32_model, calibration_images, samples=len(calibration))
    took = time.perf_counter() - start
    measured = HeldOut(names, fp32, q.features(
        q.compile_model(int8_model, float_precision=float_precision), held))
    report, agreements = _judged(measured, heads)
    print(f"quantized in {took:.0f}s; the gate (float layers in {float_precision}):")
    print("\n".join(report.lines()), flush=True)
    kept = 0
    if not report.passed and heads and accuracy_control:
        print("plain calibration misses the gate: NNCF's accuracy control keeps the fewest "
              "layers in float that bring it within (minutes)", flush=True)
        start = time.perf_counter()
        int8_model = q.quantize_with_accuracy_control(
            fp32_model, calibration_images, held, measured,
            {info.bot_id: (head.weights, head.biases) for info, head in heads},
            samples=len(calibration))
        took = time.perf_counter() - start
        kept = q.float_layers(int8_model)
        measured = HeldOut(names, fp32, q.features(
            q.compile_model(int8_model, float_precision=float_precision), held))
        report, agreements = _judged(measured, heads)
        print(f"accuracy control kept {kept} of {q.float_layers(fp32_model)} layers in float, "
              f"in {took:.0f}s; the gate:")
        print("\n".join(report.lines()))
    elif not report.passed and not heads:
        print("no registered head: accuracy control has no answers to judge by (register or "
              "train the bots first, then quantize)")
    del fp32_model
    if not report.passed and not force:
        print("multihead quantize: not written: below a bound (calibrate on more images like "
              "those you serve, or use --force)", file=sys.stderr)
        return 2
    description = f"{len(calibration)} images from {folder.resolve()}"
    artifact.save(int8_model, report=report, held_out=measured, images=len(calibration),
                  description=description, float_precision=float_precision, float_layers=kept)
    artifact.record_agreements(agreements)
    print(f"wrote {artifact.xml_path}" + ("" if report.passed else " (forced, below a bound)"))
    return 0
