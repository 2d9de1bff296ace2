"""The INT8 trunk: post-training quantization with NNCF of the same frozen tf-slim graph.

tf-slim stays the one definition of the net: `float_model` restores the checkpoint with the TF
runner, freezes it (`TfRunner.freeze`) and converts it with OpenVINO's TF frontend;
`quantize` hands that fp32 `ov.Model` to `nncf.quantize` (OpenVINO backend, no PyTorch) with
images preprocessed exactly as for serving; where that misses the gate for the registered heads
(`backbone.gate`), `quantize_with_accuracy_control` keeps the fewest layers in float that
bring it within. `Int8Artifact` keeps a quantized model next to the trunk's graph cache, with
its gate and the held-out images' features under both trunks (a head registered later is
judged from them at once).

Imported lazily: `import backbone` imports neither this module, OpenVINO nor NNCF.

Quantization choices:
  - preset PERFORMANCE (symmetric weights and activations), not MIXED (asymmetric
    activations): every conv of Inception-V4 is followed by a ReLU, so its activations are
    non-negative and a symmetric (unsigned) scale loses nothing, and the input is already
    symmetric ([-1, 1]); symmetric activations are the faster kernels on the CPU plugin.
  - fast_bias_correction (NNCF's default): corrects each layer's bias shift from the
    statistics of the fp32 model in one pass; the full BiasCorrection re-runs sub-graphs per
    layer and costs several times longer for no measurable gain on a CNN of this kind.
  - calibration one image at a time ([1, 299, 299, 3]): NNCF counts `subset_size` in dataset
    items and recommends batch 1 for its statistics; the model keeps a dynamic batch.
  - model_type None (no transformer-specific patterns), target device CPU.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from backbone import telemetry
from backbone.gate import (
    LOWEST_SHOWN,
    MIN_HEAD_AGREEMENT,
    MIN_MEAN_COSINE,
    MIN_OVERALL_AGREEMENT,
    SCALE,
    FidelityReport,
    HeldOut,
    agreement,
    fidelity,
    judge,
    score,
)
from backbone.spec import IMAGE_SIZE

log = logging.getLogger(__name__)

DEFAULT_SAMPLES = 64  # calibration images: the issue measured min cosine 0.9996 with 64
PREFIX = "inception_v4-int8-"
# Accuracy control (`quantize_with_accuracy_control`) ranks the quantized layers by how much
# reverting each to float brings the features back on this many held-out images (those the
# INT8 trunk moves most): each layer costs one compile and this many forwards.
RANKING_IMAGES = 16
# ... and reverts at most this many groups of layers before it gives up. Measured on the demo
# (seeded random trunk, 3 trained bots, 2 shared cores of an AMD EPYC): ranking the 109
# groups of its 164 quantized layers took 6.3 minutes, then each step a compile and the 100
# held-out images, and after a step that made things worse the remaining groups were ranked
# again; five layers reverted one at a time in the next 11 minutes left all bots' agreement at
# 85-86 % (99.5 % needed, 84.7 % before). An INT8 trunk that needs more layers in float than
# this is not worth running in 8 bits.
MAX_FLOAT_GROUPS = 8
LIBRARIES = ("openvino", "nncf", "tensorflow")


# -- the fp32 model and quantization --------------------------------------------------------

def float_model(prefix: str, *, graph_cache_dir: str | os.PathLike | None = None):
    """The fp32 `openvino.Model` of the trunk of a checkpoint (features output only).

    The checkpoint is restored by the TF runner exactly as for serving, frozen and converted
    by OpenVINO's TF frontend; the TF session is closed before returning. The model carries
    the restored net's `Layout` in its runtime info (`runners.openvino.layout_of`), which
    quantization and the IR keep, so an INT8 trunk loads without TensorFlow.
    """
    from backbone.checkpoint import resolve_prefix
    from backbone.device import detect_device
    from backbone.runners import openvino as ov_runner
    from backbone.runners.base import LoadRequest
    from backbone.runners.tf import TfRunner

    # NOTE: the runner, not `Trunk`: `backbone.trunk` looks up the artifacts made here.
    runner = TfRunner.load(LoadRequest(resolve_prefix(prefix), detect_device("cpu"), "fp32",
                                       cache_dir=graph_cache_dir))
    try:
        frozen = runner.freeze()
        layout = runner.layout
    finally:
        runner.close()  # OpenVINO holds its own copy of the constants

    model = ov_runner.convert_graph(frozen)
    ov_runner.set_layout(model, layout)
    return model


def _single_images(calibration: Iterable[np.ndarray], samples: int) -> list[np.ndarray]:
    """Up to `samples` images [1, 299, 299, 3] from images [299, 299, 3] or batches of them."""
    out: list[np.ndarray] = []
    for item in calibration:
        item = np.asarray(item, np.float32)
        batch = item[None] if item.ndim == 3 else item
        if batch.ndim != 4 or batch.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
            raise ValueError(f"calibration items must be float32 [{IMAGE_SIZE}, {IMAGE_SIZE}, 3] "
                             f"or [N, {IMAGE_SIZE}, {IMAGE_SIZE}, 3], got {list(item.shape)}")
        for image in batch:
            if len(out) == samples:
                return out
            out.append(np.ascontiguousarray(image[None]))
    return out


def quantize(ov_model, calibration: Iterable[np.ndarray], *, samples: int = DEFAULT_SAMPLES):
    """INT8 post-training quantization of an fp32 trunk with `nncf.quantize` (see the module
    docstring for the options and why).

    Args:
      ov_model: the fp32 `openvino.Model` (`float_model`); not modified.
      calibration: preprocessed images, float32 [299, 299, 3] in [-1, 1], or batches of them.
      samples: how many images to calibrate on (fewer if `calibration` runs out first).

    Returns:
      The quantized `openvino.Model` (same input and outputs, dynamic batch).
    """
    telemetry.off()  # before NNCF is imported
    import nncf

    if samples < 1:
        raise ValueError("samples must be >= 1")
    images = _single_images(calibration, samples)
    if not images:
        raise ValueError("no calibration image")
    start = time.perf_counter()
    quantized = nncf.quantize(
        ov_model.clone(), nncf.Dataset(images), preset=nncf.QuantizationPreset.PERFORMANCE,
        target_device=nncf.TargetDevice.CPU, subset_size=len(images),
        fast_bias_correction=True)
    log.info("quantized the trunk on %d images in %.1fs", len(images),
             time.perf_counter() - start)
    return quantized


def quantize_with_accuracy_control(ov_model, calibration: Iterable[np.ndarray],
                                   held_out_images: np.ndarray, reference: HeldOut,
                                   heads: Mapping[str, tuple[np.ndarray, np.ndarray]], *,
                                   samples: int = DEFAULT_SAMPLES):
    """INT8 quantization that keeps the fewest layers in float needed for the gate to pass
    (`nncf.quantize_with_accuracy_control`): NNCF quantizes as `quantize` does, then reverts
    layers to float one group at a time, those whose revert brings the features back the most
    first (ranked on `RANKING_IMAGES` held-out images), until the metric is within `max_drop`
    of the float model's or `MAX_FLOAT_GROUPS` groups are in float (the gate then still
    fails: the caller judges the result again). The metric is `backbone.gate.score` of the
    heads' top-1 agreement and the mean cosine with the float trunk's features
    (`reference.fp32`) on the held-out images, so `max_drop` = `backbone.gate.SCALE` is the
    gate itself.

    Costs a plain quantization, then for each quantized layer a compile and `RANKING_IMAGES`
    forwards, then a compile and the held-out images' forwards per group reverted, and a new
    ranking after a revert that made things worse: from about 10 minutes to about an hour on
    2 cores (`MAX_FLOAT_GROUPS`).

    Args:
      ov_model: the fp32 `openvino.Model` (`float_model`); not modified.
      calibration: preprocessed images, as for `quantize`.
      held_out_images: float32 [N, 299, 299, 3], the images of `reference`, same order.
      reference: the held-out images' names and float features (its `int8` is not read).
      heads: name -> (weights [1536, n], biases [n]): the registered heads.
      samples: how many images to calibrate on.

    Returns:
      The quantized `openvino.Model`; `float_layers` counts the layers it kept in float.
    """
    telemetry.off()  # before NNCF is imported
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    images = _single_images(calibration, samples)
    if not images:
        raise ValueError("no calibration image")
    if len(held_out_images) != reference.images:
        raise ValueError(f"{len(held_out_images)} held-out images for {reference.images} "
                         f"reference features")
    items = [(i, np.ascontiguousarray(np.asarray(image, np.float32)[None]))
             for i, image in enumerate(held_out_images)]

    def validate(compiled, data) -> tuple[float, list[list[np.ndarray]]]:
        # NOTE: NNCF calls this with the held-out items or the first of them only (to learn
        # what it returns); each item carries its index into `reference`.
        request = compiled.create_infer_request()
        indices, rows = [], []
        for index, image in data:
            indices.append(index)
            rows.append(np.asarray(request.infer({0: image})[0], np.float32)[0])
        measured = HeldOut(tuple(reference.names[i] for i in indices),
                           reference.fp32[indices], np.stack(rows))
        report = judge(measured, {name: agreement(measured, w, b)
                                  for name, (w, b) in heads.items()})
        # The features as the model's outputs per item: NNCF ranks layers by them.
        return score(report), [[row[None]] for row in rows]

    start = time.perf_counter()
    quantized = nncf.quantize_with_accuracy_control(
        ov_model.clone(), nncf.Dataset(images), nncf.Dataset(items, lambda item: item[1]),
        validate, max_drop=SCALE, drop_type=nncf.DropType.ABSOLUTE,
        preset=nncf.QuantizationPreset.PERFORMANCE, target_device=nncf.TargetDevice.CPU,
        subset_size=len(images), fast_bias_correction=True,
        advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(
            ranking_subset_size=RANKING_IMAGES, max_num_iterations=MAX_FLOAT_GROUPS))
    log.info("quantized the trunk with accuracy control on %d images in %.1fs (%d layers "
             "kept in float)", len(images), time.perf_counter() - start,
             float_layers(quantized))
    return quantized


# Layers with weights: an INT8 trunk runs them in 8 bits where their weights are.
WEIGHTED_LAYERS = ("Convolution", "GroupConvolution", "MatMul")
# What lies between 8-bit weights and their layer in a quantized model: NNCF stores them as
# an int8 Constant, converted and scaled (or a FakeQuantize before compression).
_WEIGHT_PATH = ("Convert", "Multiply", "Subtract", "Reshape", "Transpose")


def float_layers(ov_model) -> int:
    """How many of a model's layers with weights (`WEIGHTED_LAYERS`) keep them in float: all
    of them in the fp32 model, none in a plain quantization, those accuracy control
    reverted."""
    return sum(1 for op in ov_model.get_ordered_ops()
               if op.get_type_name() in WEIGHTED_LAYERS
               and not _eight_bit(op.input(1).get_source_output().get_node()))


def _eight_bit(node) -> bool:
    kind = node.get_type_name()
    if kind == "FakeQuantize":
        return True
    if kind == "Constant":
        return node.get_output_element_type(0).get_type_name() in ("i8", "u8")
    if kind in _WEIGHT_PATH:
        return _eight_bit(node.input(0).get_source_output().get_node())
    return False


def compile_model(ov_model, *, float_precision: str = "fp32", threads: int | None = None):
    """Compiles an (int8 or fp32) `openvino.Model` for the CPU with the trunk's LATENCY hint.

    `float_precision` ("fp32" | "bf16") is the precision of the layers NNCF left in float.
    """
    from backbone.runners import openvino as ov_runner

    config = ov_runner.compile_config(float_precision, threads)
    return _ov().Core().compile_model(ov_model, ov_runner.DEVICE, config)


def features(compiled, images: np.ndarray, *, batch_size: int = 8) -> np.ndarray:
    """Features [N, 1536] of preprocessed images [N, 299, 299, 3] with a compiled model."""
    request = compiled.create_infer_request()
    images = np.asarray(images, np.float32)
    return np.concatenate([
        np.asarray(request.infer({0: np.ascontiguousarray(images[i:i + batch_size])})[0],
                   dtype=np.float32)
        for i in range(0, len(images), batch_size)])


def _ov():
    telemetry.off()  # before `openvino` imports its converter
    import openvino

    return openvino


# -- the artifact --------------------------------------------------------------------------------

def calibration_digest(blobs: Iterable[bytes | np.ndarray]) -> str:
    """A digest of a calibration set: of each image file's bytes (or each array's dtype, shape
    and bytes), independent of order and file names."""
    parts = []
    for blob in blobs:
        if isinstance(blob, np.ndarray):
            blob = f"{blob.dtype}{blob.shape}".encode() + np.ascontiguousarray(blob).tobytes()
        parts.append(hashlib.sha256(blob).digest())
    return hashlib.sha256(b"".join(sorted(parts))).hexdigest()


def library_versions() -> dict[str, str]:
    """The versions an artifact depends on (read without importing the libraries)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "none"
    return out


def source_digest() -> str:
    """A digest of the code an artifact is made by: the network, the freezing, the
    preprocessing and this module (its quantization options)."""
    from backbone import inception_v4, preprocess
    from backbone.runners import openvino as ov_runner
    from backbone.runners import tf as tf_runner

    digest = hashlib.sha256()
    for module in (inception_v4, tf_runner, ov_runner, preprocess):
        digest.update(Path(inspect.getsourcefile(module)).read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def _environment() -> dict:
    return {"versions": library_versions(), "source": source_digest()}


class Int8Artifact:
    """A quantized trunk: `<dir>/inception_v4-int8-<key>.xml`, `.bin` (OpenVINO IR), `.npz`
    (the held-out images' features under both trunks: `backbone.gate.HeldOut`) and `.json`.

    Keyed by the checkpoint's fingerprint (`runners.openvino.checkpoint_fingerprint`), the
    calibration set's digest (`calibration_digest`), the OpenVINO, NNCF and TensorFlow versions
    and the source digest, so a change to any of them never reuses an artifact. The JSON holds
    the calibration set's description and date, the gate's report (`fidelity`), the layers
    kept in float and the versions; it is written last and commits the artifact (an artifact
    without it does not exist). Beside it, `-agreement.json` remembers the agreement of heads
    judged later (`record_agreements`), so a restart does not load them again.
    """

    def __init__(self, directory: str | os.PathLike, *, prefix: str, calibration: str):
        from backbone.runners.openvino import checkpoint_fingerprint

        self._place(directory, checkpoint_fingerprint(prefix), calibration, _environment())

    def _place(self, directory, checkpoint: str, calibration: str, environment: dict) -> None:
        self.checkpoint, self.calibration, self.environment = checkpoint, calibration, environment
        key = hashlib.sha256(json.dumps([checkpoint, calibration, environment],
                                        sort_keys=True).encode())
        self.key = key.hexdigest()[:16]
        self.xml_path = Path(directory) / f"{PREFIX}{self.key}.xml"
        self.bin_path = self.xml_path.with_suffix(".bin")
        self.meta_path = self.xml_path.with_suffix(".json")
        self.features_path = self.xml_path.with_suffix(".npz")
        self.agreements_path = self.xml_path.with_name(f"{PREFIX}{self.key}-agreement.json")
        self.passed: bool | None = None  # known once found (`available`, `find`) or saved

    def with_calibration(self, calibration: str) -> Int8Artifact:
        """The artifact of the same checkpoint and environment for another calibration set."""
        other = object.__new__(type(self))
        other._place(self.xml_path.parent, self.checkpoint, calibration, self.environment)
        return other

    @classmethod
    def find(cls, directory: str | os.PathLike, prefix: str, *,
             passing: bool = True) -> Int8Artifact | None:
        """The newest complete artifact for this checkpoint and these libraries and sources,
        made from any calibration set; with `passing`, only one whose fidelity passed (an
        artifact written with --force below a bound is not)."""
        found = cls.available(directory, prefix)
        if passing:
            found = [artifact for artifact in found if artifact.passed]
        return found[0] if found else None

    @classmethod
    def available(cls, directory: str | os.PathLike, prefix: str) -> list[Int8Artifact]:
        """Every complete artifact for this checkpoint and these libraries and sources, newest
        first (by calibration date); `passed` says whether its fidelity passed."""
        found = []
        if not Path(directory).is_dir():
            return found
        ours = cls(directory, prefix=prefix, calibration="")  # reads the checkpoint once
        # NOTE: the key's 16 hex digits, so that an `-agreement.json` is not taken for one.
        for meta_path in Path(directory).glob(f"{PREFIX}{'[0-9a-f]' * 16}.json"):
            try:
                meta = json.loads(meta_path.read_text())
                artifact = ours.with_calibration(meta["calibration"]["digest"])
                passed, date = bool(meta["fidelity"]["passed"]), str(meta["calibration"]["date"])
            except Exception as exc:  # noqa: BLE001 - foreign or corrupt: not ours
                log.warning("ignoring unreadable int8 artifact %s: %s", meta_path, exc)
                continue
            # A file of another checkpoint or environment names another key: not ours.
            if artifact.meta_path == meta_path and artifact.complete():
                artifact.passed = passed
                found.append((date, artifact))
        return [artifact for _, artifact in sorted(found, key=lambda pair: pair[0], reverse=True)]

    def complete(self) -> bool:
        return all(path.exists() for path in (self.xml_path, self.bin_path,
                                              self.features_path, self.meta_path))

    def metadata(self) -> dict:
        """The JSON: calibration (digest, images, description, date), fidelity (the gate's
        report, measured with the float layers in `float_precision`), float_layers (kept in
        float by accuracy control), versions, source digest."""
        return json.loads(self.meta_path.read_text())

    def report(self) -> FidelityReport:
        """The gate as judged when it was calibrated, for the heads registered then."""
        return FidelityReport.from_dict(self.metadata()["fidelity"])

    def held_out(self) -> HeldOut:
        """The held-out images' names and features under the float and the INT8 trunk."""
        return HeldOut.from_bytes(self.features_path.read_bytes())

    def agreements(self) -> dict[str, float]:
        """The agreements recorded by `record_agreements` (empty if none or unreadable)."""
        try:
            data = json.loads(self.agreements_path.read_text())
            return {str(k): float(v) for k, v in data.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", self.agreements_path, exc)
            return {}

    def record_agreements(self, values: Mapping[str, float]) -> None:
        """Adds heads' agreements (keyed by the caller: a head's identity that changes with its
        weights) to those recorded. Best effort: a read-only directory is logged, and two
        writers at once may lose one's values (they are computed again)."""
        merged = {**self.agreements(), **{str(k): float(v) for k, v in values.items()}}
        tmp = self.agreements_path.with_name(f".{self.agreements_path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(merged, sort_keys=True))
            os.replace(tmp, self.agreements_path)
        except OSError as exc:
            log.warning("could not record head agreements in %s: %s", self.agreements_path, exc)
            tmp.unlink(missing_ok=True)

    def load(self):
        """The quantized `openvino.Model`."""
        return _ov().Core().read_model(str(self.xml_path), str(self.bin_path))

    def save(self, model, *, report: FidelityReport, held_out: HeldOut, images: int,
             description: str, float_precision: str = "fp32", float_layers: int = 0) -> dict:
        """Writes the model and the held-out features, then the metadata (the commit); returns
        the metadata. `float_layers`: how many layers accuracy control kept in float.

        NOTE: every file is written under a temporary name and moved into place with
        os.replace; the JSON goes last, so a crash at any point leaves either the previous
        state or a complete artifact (orphan IR files are overwritten by the next save).
        """
        directory = self.xml_path.parent
        directory.mkdir(parents=True, exist_ok=True)
        tmp_xml = directory / f".{self.xml_path.stem}.{os.getpid()}.tmp.xml"
        tmp_bin, tmp_meta = tmp_xml.with_suffix(".bin"), tmp_xml.with_suffix(".json")
        tmp_features = tmp_xml.with_suffix(".npz")
        meta = {"key": self.key, "checkpoint": self.checkpoint,
                "calibration": {"digest": self.calibration, "images": images,
                                "description": description,
                                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                "fidelity": report.to_dict(), "float_precision": float_precision,
                "float_layers": float_layers, **self.environment}
        try:
            # NOTE: no fp16 compression: the saved model is the one whose fidelity was measured.
            _ov().save_model(model, str(tmp_xml), compress_to_fp16=False)
            tmp_features.write_bytes(held_out.to_bytes())
            tmp_meta.write_text(json.dumps(meta, indent=1))
            self.meta_path.unlink(missing_ok=True)  # uncommit a previous artifact of this key
            # Heads judged against the previous artifact of this key are judged again.
            self.agreements_path.unlink(missing_ok=True)
            os.replace(tmp_bin, self.bin_path)
            os.replace(tmp_xml, self.xml_path)
            os.replace(tmp_features, self.features_path)
            os.replace(tmp_meta, self.meta_path)
        finally:
            for tmp in (tmp_xml, tmp_bin, tmp_features, tmp_meta):
                tmp.unlink(missing_ok=True)
        self.passed = report.passed
        return meta


__all__ = ["MIN_HEAD_AGREEMENT", "MIN_OVERALL_AGREEMENT",
           "MIN_MEAN_COSINE", "LOWEST_SHOWN", "DEFAULT_SAMPLES", "RANKING_IMAGES",
           "MAX_FLOAT_GROUPS",
           "FidelityReport", "HeldOut", "agreement", "fidelity", "judge", "float_model",
           "quantize", "quantize_with_accuracy_control", "float_layers", "compile_model",
           "features", "calibration_digest", "library_versions", "source_digest",
           "Int8Artifact"]
