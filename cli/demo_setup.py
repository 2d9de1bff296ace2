"""`multihead demo`: create what the demo needs under a store, reuse what is there.

First run (about two minutes on 2 cores): the seeded demo trunk (unless the official
checkpoint is in `<store>/trunk/`), the generated labelled images under `<store>/demo_images/`,
one bot per image kind trained on them with the `train` code path, on the trunk `serve` runs,
then an INT8 trunk calibrated on those images with `multihead quantize`'s code (where the trunk
runs on a runtime that declares the INT8 trunk, OpenVINO, and NNCF is installed), its gate
judged on the bots just trained: `serve` runs it by default where the gate passes. Later runs
only check: a demo bot is retrained when the trunk it was trained on is no longer the store's
trunk, and the INT8 trunk is calibrated again when none exists for the store's trunk.
"""
from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from heads.demo_images import KINDS, PER_CLASS, demo_image, write_demo_images

log = logging.getLogger(__name__)

HELD_OUT_PER_CLASS = 10  # separate images (another seed) to report accuracy on
HELD_OUT_SEED = 1


@dataclass(frozen=True)
class DemoBot:
    bot_id: str
    version: int
    trained: bool  # False: reused from an earlier run
    held_out_accuracy: float | None  # on HELD_OUT_PER_CLASS fresh images per class


def _source_tag(digest: str) -> str:
    return f"demo:trunk={digest[:16]}"


def held_out_accuracy(trunk, head, kind: str, per_class: int = HELD_OUT_PER_CLASS) -> float:
    """Accuracy of `head` on images of `kind` it was not trained on (another seed)."""
    from backbone import preprocess

    images, truth = [], []
    for label in KINDS[kind]:
        for index in range(per_class):
            buffer = io.BytesIO()
            demo_image(kind, label, index, seed=HELD_OUT_SEED).save(buffer, "PNG")
            images.append(preprocess(buffer.getvalue()))
            truth.append(label)
    features = np.concatenate([trunk.features(np.stack(images[i:i + 16]))
                               for i in range(0, len(images), 16)])
    predicted = [head.labels[i] for i in head.logits(features).argmax(axis=1)]
    return float(np.mean([p == t for p, t in zip(predicted, truth)]))


def int8_runtimes() -> str:
    """The runtimes that run an INT8 trunk, for people ("OpenVINO")."""
    from backbone.runners import registry

    return " or ".join(s.title for s in registry.SPECS.values()
                       if registry.INT8_TRUNK in s.artifacts)


def int8_wanted(trunk_kwargs: dict | None) -> str | None:
    """Why the demo does not calibrate an INT8 trunk (None: it does): the trunk would not run
    it (a runtime that does not declare the INT8 trunk, a GPU, a float precision asked for) or
    NNCF is not installed."""
    import importlib.util

    from backbone.device import cpu_device_if_known
    from backbone.precision import resolve_runtime
    from backbone.runners import registry

    kwargs = trunk_kwargs or {}
    if kwargs.get("precision", "auto") not in ("auto", "int8"):
        return f"precision {kwargs['precision']!r} asked for"
    device = cpu_device_if_known("auto")
    if device is None:
        return "the trunk may run on a GPU"
    runtime = registry.spec(resolve_runtime(kwargs.get("runtime", "auto"), device=device,
                                            available=registry.available()))
    if registry.INT8_TRUNK not in runtime.artifacts:
        return f"the trunk runs on {runtime.title}"
    if importlib.util.find_spec("nncf") is None:
        return "NNCF is not installed (pip install 'multihead[openvino]')"
    return None


def ensure_int8(store_dir: Path, prefix: str, *, per_class: int, kinds=tuple(KINDS)) -> bool:
    """Calibrates an INT8 trunk for `prefix` on the demo's images (written first if missing),
    its gate judged on the bots registered in the store, unless one exists; returns whether a
    passing one exists afterwards.

    NOTE: one below a bound is kept too, marked failing (as `multihead quantize --force` keeps
    it): `auto` never serves it, and the next `multihead demo` (every `make serve`) does not
    spend a minute calibrating the same images again.
    """
    from backbone.checkpoint import cache_dir_of
    from backbone.quantize import DEFAULT_SAMPLES, Int8Artifact
    from cli.quantize import calibrate, image_files

    found = Int8Artifact.find(cache_dir_of(prefix), prefix, passing=False)
    if found is None:
        folder = store_dir / "demo_images"
        for kind in kinds:
            write_demo_images(folder, kind, per_class)
        log.info("calibrating an INT8 trunk on the demo images (about a minute)")
        start = time.perf_counter()
        # NOTE: plain calibration only: accuracy control costs many minutes more on 2 cores
        # (`multihead quantize` runs it), and the demo's first run must stay about as long.
        calibrate(prefix, folder, image_files(folder), samples=DEFAULT_SAMPLES,
                  store=str(store_dir), force=True, accuracy_control=False)
        log.info("INT8 calibration took %.0fs", time.perf_counter() - start)
        found = Int8Artifact.find(cache_dir_of(prefix), prefix, passing=False)
    if found is None:
        return False
    report = found.report()
    if not report.passed:
        lowest = report.lowest[0] if report.lowest else None
        log.warning("the demo's INT8 trunk %s: kept but not served by default, the demo serves "
                    "the float trunk%s; `multihead quantize --images %s --store %s` tries NNCF's "
                    "accuracy control (minutes)", report.summary(),
                    f" (lowest cosine {lowest['image']} {lowest['cosine']:.6f}, features "
                    f"{lowest['norm_ratio']:.2f} x the median norm)" if lowest else "",
                    store_dir / "demo_images", store_dir)
    else:
        log.info("INT8 trunk %s: %s", found.xml_path.name, report.summary())
    return report.passed


def ensure_demo(store_dir: str | Path, *, per_class: int = PER_CLASS, trunk=None,
                kinds=tuple(KINDS), held_out_per_class: int = HELD_OUT_PER_CLASS,
                progress: bool = True, trunk_kwargs: dict | None = None,
                int8: bool = False) -> list[DemoBot]:
    """Creates the missing demo pieces in `store_dir`; returns the demo bots.

    Args:
      trunk: a built Trunk to use (tests); else one is built from the store's trunk, as `serve`
        would run it.
      int8: calibrate an INT8 trunk on the demo images once the bots are trained
        (`ensure_int8`), where the trunk would run it (`int8_wanted`), so that its gate judges
        their answers.
    """
    from backbone.checkpoint import (
        checkpoint_exists,
        default_trunk_checkpoint,
        trunk_digest,
        write_random_checkpoint,
    )
    from heads import UnknownBot
    from heads.train import extract_features, scan_image_folder, train_head
    from store import HeadStore

    store_dir = Path(store_dir)
    prefix = trunk.checkpoint_prefix if trunk is not None else default_trunk_checkpoint(store_dir)
    if not checkpoint_exists(prefix):
        log.info("writing the demo trunk (seeded random weights) to %s", prefix)
        write_random_checkpoint(prefix, seed=0)
    else:
        log.info("trunk: %s", prefix)
    tag = _source_tag(trunk_digest(prefix))
    bots: list[DemoBot] = []
    own_trunk = trunk is None
    with HeadStore(store_dir) as store:
        todo = []
        for kind in kinds:
            try:
                info = store.info(kind)
            except UnknownBot:
                todo.append(kind)
                continue
            if info.source == tag:
                bots.append(DemoBot(kind, info.version, False, None))
            else:
                log.info("demo bot %r was trained on another trunk: retraining", kind)
                todo.append(kind)
        try:
            for kind in todo:
                if trunk is None:
                    from backbone import Trunk
                    from backbone.checkpoint import cache_dir_of
                    from service.core.bots import Int8Agreement

                    # As `serve` chooses: an INT8 trunk only where its gate passes for the bots.
                    trunk = Trunk.from_checkpoint(prefix, graph_cache_dir=cache_dir_of(prefix),
                                                  heads=Int8Agreement(store).judge,
                                                  **(trunk_kwargs or {}))
                start = time.perf_counter()
                folder = write_demo_images(store_dir / "demo_images", kind, per_class)
                data = extract_features(scan_image_folder(folder), trunk, progress=progress)
                result = train_head(data.features, data.label_idx, data.labels, seed=0)
                version = store.register(kind, result.weights, result.biases, result.labels,
                                         source=tag)
                accuracy = held_out_accuracy(trunk, store.get(kind), kind, held_out_per_class)
                log.info("demo bot %r v%d: %d classes, held-out accuracy %.3f (%.0fs)", kind,
                         version, len(result.labels), accuracy, time.perf_counter() - start)
                bots.append(DemoBot(kind, version, True, accuracy))
        finally:
            if own_trunk and trunk is not None:
                trunk.close()
    if int8:  # NOTE: after the bots: its gate judges their answers
        why_not = int8_wanted(trunk_kwargs)
        if why_not is None:
            ensure_int8(store_dir, prefix, per_class=per_class, kinds=kinds)
        else:
            log.info("no INT8 trunk: %s", why_not)
    return bots
