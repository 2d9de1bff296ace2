"""What every trunk runner is: the interface `Trunk` holds, and the records a load reports.

A runner is one way of running the restored tf-slim Inception-V4 (TensorFlow's session, an
OpenVINO compiled model, ...). `Trunk` holds exactly one and adds what is common to all: the
input check, the closed state, the warm-up and the checkpoint's description. A new runtime or
precision (INT8) is a new `Runner` registered in `backbone.runners.RUNNERS`; `Trunk` does not
change.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass

import numpy as np

from backbone.device import Device


@dataclass(frozen=True)
class LoadRequest:
    """Everything a runner needs to load the trunk; resolved before any runner is chosen.

    Attributes:
      prefix: an existing checkpoint prefix.
      device: where the trunk runs.
      precision: resolved ("fp32", "bf16", "fp16").
      with_logits: also build the checkpoint's own Logits layer.
      intra_op_threads / inter_op_threads: thread pools (None lets the runtime choose).
      cache_dir: where built graphs and compiled models are kept between processes, or None.
      gpu_memory_limit_mb: optional cap on GPU memory.
    """

    prefix: str
    device: Device
    precision: str = "fp32"
    with_logits: bool = False
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    cache_dir: str | os.PathLike | None = None
    gpu_memory_limit_mb: int | None = None


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner runs on: runtime ("tf", "openvino"), resolved precision and device."""

    runtime: str
    precision: str
    device: Device


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
    graph_from_cache: bool = False  # the start skipped building the graph
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
