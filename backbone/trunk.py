"""The shared trunk: one Inception-V4 per process, pixels in, features out.

`Trunk` is a façade over exactly one runner (`backbone.runners`: TensorFlow, OpenVINO). It
detects the device once, resolves the precision and runtime by the rules of
`backbone.precision`, loads the runner the runtime names, warms it up once, and adds what is
common to every runtime: the input check, the closed state and the checkpoint's description.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from backbone.checkpoint import resolve_prefix
from backbone.device import Device, detect_device
from backbone.inception_v4 import LOGITS_SCOPE
from backbone.precision import openvino_available, resolve_precision, resolve_runtime
from backbone.runners import LoadRequest, Runner, runner_class
from backbone.spec import FEATURE_DIM, IMAGE_SIZE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrunkTimings:
    """Seconds spent in each step of `Trunk.from_checkpoint`."""

    build_s: float
    restore_s: float
    warmup_s: float
    compile_s: float = 0.0  # OpenVINO: freeze + convert + compile, or import from the cache


def warm_up(features, batch_sizes) -> float:
    """The one warm-up: `features` of one zero batch of each size (first-run costs: arenas,
    kernels per shape); returns the seconds it took. `features` is a trunk's (or a stand-in's)
    `features` method."""
    start = time.perf_counter()
    for size in batch_sizes:
        features(np.zeros((size, IMAGE_SIZE, IMAGE_SIZE, 3), np.float32))
    return time.perf_counter() - start


class Trunk:
    """Inception-V4 up to `PreLogitsFlatten`, restored from a slim checkpoint.

    Build with `Trunk.from_checkpoint(...)`. `features` is thread-safe on every runner: a TF
    session runs concurrent `run` calls and releases the GIL while it computes; on OpenVINO
    each concurrent caller gets its own infer request.
    """

    def __init__(self, runner: Runner, *, checkpoint_prefix: str,
                 timings: TrunkTimings | None = None):
        self.runner = runner
        self.checkpoint_prefix = checkpoint_prefix
        report = runner.report
        self.timings = timings or TrunkTimings(report.build_s, report.restore_s, 0.0,
                                               compile_s=report.compile_s)
        self._closed = threading.Event()

    @classmethod
    def from_checkpoint(cls, prefix: str, *, device: str | Device = "auto",
                        intra_op_threads: int | None = None,
                        inter_op_threads: int | None = None,
                        with_logits: bool = False,
                        gpu_memory_limit_mb: int | None = None,
                        warmup_batch_sizes: tuple[int, ...] = (1,),
                        graph_cache_dir: str | os.PathLike | None = None,
                        precision: str = "fp32",
                        runtime: str = "tf") -> Trunk:
        """Builds the trunk graph once, restores it from a checkpoint and warms it up.

        Args:
          prefix: checkpoint prefix (or a directory with one) holding the trunk variables: the
            official `inception_v4.ckpt`, a slim fine-tuned one (any Logits class count), or
            one written by `multihead init-trunk`. Only the trunk (and with `with_logits`, the
            Logits layer) is restored; AuxLogits, optimizer slots etc. are ignored.
          device: "auto" (first GPU, else CPU), "cpu", "gpu", a TF device string, or a
            `Device` (see `backbone.device.detect_device`).
          intra_op_threads / inter_op_threads: TF thread pools; None lets TF choose. On
            OpenVINO, intra_op_threads caps its inference threads (INFERENCE_NUM_THREADS).
          with_logits: also build the checkpoint's own Logits layer (`features_and_logits`).
          gpu_memory_limit_mb: optional cap on GPU memory (memory growth is always on).
          warmup_batch_sizes: batch sizes run once before returning.
          graph_cache_dir: if given, the built graph is saved there (a MetaGraphDef keyed by
            TF version, class count and this network's source) and re-imported by later
            processes instead of rebuilt: about 1 s instead of about 5-8 s. The weights always
            come from `prefix`; a corrupt cache entry is ignored and rebuilt. With runtime
            "openvino" the compiled model is cached there too, keyed by the checkpoint's
            content: a restart then imports it without TensorFlow.
          precision: "fp32", "bf16" (CPUs with avx512_bf16 or amx_bf16), "fp16" (GPU) or
            "auto" (fp16 on a GPU, bf16 on a CPU that has it, else fp32); reported, resolved,
            as `trunk.precision`. Features are float32 whatever the precision.
          runtime: "tf", "openvino" (CPU; compiled in-process from the same restored tf-slim
            graph) or "auto" (openvino on the CPU when installed, else tf); reported, resolved,
            as `trunk.runtime`.

        Raises:
          CheckpointError: the file is missing (names the path) or a variable is missing or
            mis-shaped (names the variable and both shapes).
          PrecisionUnsupported: the precision cannot run natively here (never emulated).
          RuntimeUnavailable: runtime "openvino" without the package or on a GPU.
        """
        prefix = resolve_prefix(prefix)
        # NOTE: a CPU-only start detects its device without TensorFlow, so a cached OpenVINO
        # trunk starts without importing it.
        found = detect_device(device)
        precision = resolve_precision(precision, device=found)
        runtime = resolve_runtime(runtime, device=found, openvino=openvino_available())
        runner = runner_class(runtime).load(LoadRequest(
            prefix, found, precision, with_logits=with_logits,
            intra_op_threads=intra_op_threads, inter_op_threads=inter_op_threads,
            cache_dir=graph_cache_dir, gpu_memory_limit_mb=gpu_memory_limit_mb))
        trunk = cls(runner, checkpoint_prefix=prefix)
        trunk.warm_up(warmup_batch_sizes)
        t = trunk.timings
        log.info("trunk ready on %s (%s, %s) from %s: build %.1fs restore %.1fs compile %.1fs "
                 "warm-up %.1fs%s", trunk.device, runtime, precision, prefix, t.build_s,
                 t.restore_s, t.compile_s, t.warmup_s,
                 " (compiled model from the cache)" if trunk.compiled_from_cache else "")
        return trunk

    def warm_up(self, batch_sizes) -> None:
        """Runs one zero batch of each size (`warm_up`) and adds the time to
        `timings.warmup_s`."""
        took = warm_up(self.features, batch_sizes)
        self.timings = replace(self.timings, warmup_s=self.timings.warmup_s + took)

    # -- what runs, and what was restored ------------------------------------------------------

    @property
    def hardware(self) -> Device:
        """The detected device (kind, TF device string, CPU flags)."""
        return self.runner.info.device

    @property
    def device(self) -> str:
        """The TF device string the trunk runs on ("/CPU:0", "/GPU:0", ...)."""
        return self.runner.info.device.name

    @property
    def runtime(self) -> str:
        """Resolved runtime: "tf" | "openvino"."""
        return self.runner.info.runtime

    @property
    def precision(self) -> str:
        """Resolved precision: "fp32" | "bf16" | "fp16"."""
        return self.runner.info.precision

    @property
    def variables(self) -> list[tuple[str, list[int]]]:
        """[(name, shape)] restored, in creation order."""
        return self.runner.layout.variables

    @property
    def end_points(self) -> dict[str, list[int | None]]:
        """End point name -> static shape."""
        return self.runner.layout.end_points

    @property
    def num_classes(self) -> int:
        """Class count of the checkpoint's own Logits layer, 0 if built without it."""
        return self.runner.layout.num_classes

    @property
    def graph_from_cache(self) -> bool:
        """Whether the start skipped building the graph (a graph or compiled-model cache hit)."""
        return self.runner.report.graph_from_cache

    @property
    def compiled_from_cache(self) -> bool:
        """OpenVINO: whether the compiled trunk was imported from `graph_cache_dir`."""
        return self.runner.report.compiled_from_cache

    # -- running -------------------------------------------------------------------------------

    def _check(self, images) -> np.ndarray:
        if self._closed.is_set():
            raise RuntimeError("trunk is closed")
        images = np.asarray(images, dtype=np.float32)
        if images.ndim != 4 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3) or not len(images):
            raise ValueError(f"images must be float32 [N>=1, {IMAGE_SIZE}, {IMAGE_SIZE}, 3], "
                             f"got shape {list(images.shape)}")
        return images

    def features(self, images) -> np.ndarray:
        """Pre-logits features of a batch.

        Args:
          images: float32 [N, 299, 299, 3] in [-1, 1] (see `backbone.preprocess`).

        Returns:
          float32 [N, 1536], the `PreLogitsFlatten` end point.
        """
        return self.runner.features(self._check(images))

    def features_and_logits(self, images) -> tuple[np.ndarray, np.ndarray]:
        """Features [N, 1536] and the checkpoint's own Logits [N, num_classes] in one run."""
        if not self.num_classes:
            raise RuntimeError("trunk was built without its Logits layer (with_logits=False)")
        return self.runner.features_and_logits(self._check(images))

    def close(self) -> None:
        """Closes the runner; further calls raise. Safe to call twice."""
        if not self._closed.is_set():
            self._closed.set()
            self.runner.close()

    def __repr__(self) -> str:
        return (f"Trunk(device={self.device!r}, runtime={self.runtime!r}, "
                f"precision={self.precision!r}, checkpoint={self.checkpoint_prefix!r})")


__all__ = ["Trunk", "TrunkTimings", "warm_up", "FEATURE_DIM", "LOGITS_SCOPE"]
