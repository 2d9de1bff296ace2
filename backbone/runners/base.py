"""What every trunk runner is: the interface `Trunk` holds, and the records a load reports.

A runner is one way of running the restored tf-slim Inception-V4 (TensorFlow's session, an
OpenVINO compiled model, ...). `Trunk` holds exactly one and adds what is common to all: the
input check, the closed state, the warm-up and the checkpoint's description. A new runtime is a
new `Runner` in a module of its own, registered there with what it declares
(`backbone.runners.registry.register`); a new precision is one more that a runner declares and
loads (INT8: the OpenVINO runner, from the `LoadRequest`'s `int8_artifact`); `Trunk` does not
change.
"""
from __future__ import annotations

import abc
import os
from dataclasses import asdict, dataclass

import numpy as np

from backbone.device import Device


@dataclass(frozen=True)
class LoadRequest:
    """Everything a runner needs to load the trunk; resolved before any runner is chosen.

    Attributes:
      prefix: an existing checkpoint prefix.
      device: where the trunk runs.
      precision: resolved ("fp32", "bf16", "fp16", "int8").
      with_logits: also build the checkpoint's own Logits layer.
      intra_op_threads / inter_op_threads: thread pools (None lets the runtime choose).
      cache_dir: where built graphs and compiled models are kept between processes, or None.
      gpu_memory_limit_mb: optional cap on GPU memory.
      int8_artifact: precision "int8": the INT8 trunk to run, a `backbone.quantize.Int8Artifact`
        calibrated for this checkpoint (not imported here: that module imports the runners).
      float_precision: precision "int8": the precision of the layers left in float ("fp32",
        "bf16"; see `backbone.precision.float_layers_precision`).
    """

    prefix: str
    device: Device
    precision: str = "fp32"
    with_logits: bool = False
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    cache_dir: str | os.PathLike | None = None
    gpu_memory_limit_mb: int | None = None
    int8_artifact: object | None = None
    float_precision: str = "fp32"


@dataclass(frozen=True)
class Calibration:
    """The calibration set of an INT8 trunk, as `multihead quantize` recorded it.

    Attributes:
      digest: sha256 of the calibration images (`backbone.quantize.calibration_digest`).
      images: how many images it calibrated on.
      description: where they came from ("64 images from /data/photos").
      date: when it was calibrated, ISO 8601 UTC ("2026-05-01T12:00:00Z").
      min_cosine: the fidelity measured on held-out images (min cosine of features vs fp32).
      passed: whether that fidelity was within the bounds (False: written with --force).
    """

    digest: str
    images: int
    description: str
    date: str
    min_cosine: float
    passed: bool

    @classmethod
    def from_metadata(cls, meta: dict) -> Calibration:
        """From an INT8 artifact's JSON (`backbone.quantize.Int8Artifact.metadata`)."""
        calibration, fidelity = meta["calibration"], meta["fidelity"]
        return cls(str(calibration["digest"]), int(calibration["images"]),
                   str(calibration["description"]), str(calibration["date"]),
                   float(fidelity["min_cosine"]), bool(fidelity["passed"]))

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner runs on: runtime ("tf", "openvino"), resolved precision and device; for
    an INT8 trunk also the precision of its float layers and its calibration set."""

    runtime: str
    precision: str
    device: Device
    float_precision: str | None = None
    calibration: Calibration | None = None


@dataclass(frozen=True)
class Layout:
    """The restored net, as built: what the checkpoint contract is checked against.

    Attributes:
      variables: [(name, shape)] restored, in creation order.
      end_points: end point name -> static shape.
      num_classes: class count of the checkpoint's Logits layer, 0 if built without it.
    """

    variables: list[tuple[str, list[int]]]
    end_points: dict[str, list[int | None]]
    num_classes: int

    def to_json(self) -> dict:
        return {"variables": self.variables, "end_points": self.end_points,
                "num_classes": self.num_classes}

    @classmethod
    def from_json(cls, meta: dict) -> Layout:
        return cls([(name, list(shape)) for name, shape in meta["variables"]],
                   meta["end_points"], int(meta["num_classes"]))


@dataclass(frozen=True)
class LoadReport:
    """How a load went: seconds per step and which caches it used."""

    build_s: float = 0.0
    restore_s: float = 0.0
    compile_s: float = 0.0  # OpenVINO: freeze + convert + compile, or import from the cache
    graph_from_cache: bool = False  # the start skipped building the graph (INT8: always)
    compiled_from_cache: bool = False  # OpenVINO: the compiled model was imported


class Runner(abc.ABC):
    """Runs the restored trunk: float32 images [N, 299, 299, 3] in, features [N, 1536] out.

    Implementations are thread-safe (`features` is called from many threads at once), take
    checked input (`Trunk` validates shapes) and need not guard against use after `close`.
    """

    info: RunnerInfo
    layout: Layout
    report: LoadReport

    @classmethod
    @abc.abstractmethod
    def load(cls, request: LoadRequest) -> Runner:
        """Builds or imports the trunk and restores its weights."""

    @abc.abstractmethod
    def features(self, images: np.ndarray) -> np.ndarray:
        """float32 [N, 1536], the `PreLogitsFlatten` end point."""

    @abc.abstractmethod
    def features_and_logits(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Features [N, 1536] and Logits [N, num_classes] in one run (loaded `with_logits`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees the session or compiled model (called once)."""
