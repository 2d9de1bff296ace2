"""`multihead quantize`: an INT8 trunk calibrated on the user's images, kept only if faithful.

The images are split once, by a seeded shuffle of their sorted paths: up to --samples of them
calibrate NNCF's post-training quantization (`backbone.quantize`); the rest, up to
HELD_OUT_MAX, are held out and run through the fp32 and the int8 trunk to measure the fidelity
before anything is written. Below a bound the command exits 2 and writes nothing, unless
--force.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from backbone.quantize import DEFAULT_SAMPLES, MIN_COSINE, MIN_TOP1_AGREEMENT
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
            f"the rest (at least {MIN_HELD_OUT}) are held out. On those the int8 features are\n"
            "compared with fp32: the min cosine must be >= "
            f"{MIN_COSINE} and every registered bot\n"
            f"of the store must keep its top-1 class on >= {MIN_TOP1_AGREEMENT:.0%} of them.\n"
            "Below either bound the command exits 2 and writes nothing, unless --force.\n"
            "The report names the held-out images of lowest cosine and their feature norm\n"
            "against the median image's (on the demo images, low-signal and unusually strong\n"
            "pictures lost the most).\n\n"
            "The artifact (OpenVINO IR + a JSON with the calibration set, its date and the\n"
            "report) goes to graph_cache/ next to the trunk checkpoint, keyed by the\n"
            "checkpoint, the calibration images and the OpenVINO/NNCF/TensorFlow versions; an\n"
            "artifact of the same key is reused. Needs the `openvino` extra."),
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


def _registered_heads(location: str) -> dict:
    from store import HeadStore

    with HeadStore(location) as store:
        return {info.bot_id: store.get(info.bot_id) for info in store.list()}


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
                     force=args.force)


def calibrate(prefix: str, folder: Path, files: list[Path], *, samples: int, store: str,
              force: bool = False) -> int:
    """Quantizes the trunk of checkpoint `prefix` on `files` (images under `folder`), reports
    the fidelity and writes the artifact to the checkpoint's cache directory if it passes (or
    `force`). Prints its report; returns the exit code (0 written or already there, 2 below a
    bound). `multihead demo` calls it on its own images."""
    from backbone import quantize as q
    from backbone.checkpoint import cache_dir_of
    from backbone.device import detect_device
    from backbone.precision import float_layers_precision

    calibration, held_out = split(files, samples)
    data = {path: path.read_bytes() for path in calibration + held_out}
    # The trunk's graph cache, where `serve` keeps it: graph_cache/ next to the checkpoint.
    directory = cache_dir_of(prefix)
    artifact = q.Int8Artifact(directory, prefix=prefix,
                              calibration=q.calibration_digest(data[p] for p in calibration))
    if artifact.complete():
        meta = artifact.metadata()
        report = q.FidelityReport(**{k: v for k, v in meta["fidelity"].items() if k != "passed"})
        print(f"already calibrated on these images ({meta['calibration']['date']}): "
              f"{artifact.xml_path}")
        print("\n".join(report.lines()))
        return 0 if report.passed or force else 2

    heads = _registered_heads(store)
    # The float layers run as an int8 trunk serves them: bf16 where the CPU has it.
    float_precision = float_layers_precision(detect_device("cpu"))
    print(f"trunk {prefix}: {len(calibration)} calibration and {len(held_out)} held-out images "
          f"from {folder}; {len(heads)} registered bot(s)", flush=True)
    held = _preprocessed(held_out, data)
    fp32_model = q.float_model(prefix, graph_cache_dir=directory)
    fp32 = q.features(q.compile_model(fp32_model, float_precision="fp32"), held)
    start = time.perf_counter()
    int8_model = q.quantize(fp32_model, _preprocessed(calibration, data),
                            samples=len(calibration))
    took = time.perf_counter() - start
    del fp32_model
    int8 = q.features(q.compile_model(int8_model, float_precision=float_precision), held)
    report = q.fidelity(fp32, int8, heads, names=[str(p.relative_to(folder)) for p in held_out])
    print(f"quantized in {took:.0f}s; fidelity (float layers in {float_precision}):")
    print("\n".join(report.lines()))
    if not report.passed and not force:
        print("multihead quantize: not written: below a bound (calibrate on more images like "
              "those you serve, or use --force)", file=sys.stderr)
        return 2
    description = f"{len(calibration)} images from {folder.resolve()}"
    artifact.save(int8_model, report=report, images=len(calibration), description=description,
                  float_precision=float_precision)
    print(f"wrote {artifact.xml_path}" + ("" if report.passed else " (forced, below a bound)"))
    return 0
