"""The shared trunk: one Inception-V4 graph and session per process, pixels in, features out.

NOTE: everything lives in the Trunk's own `tf.Graph` (never the default graph), so several
Trunks can coexist in one process and nothing leaks into code that uses the default graph.
The graph is finalized after the build: any accidental op creation later raises at once.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np

from backbone.checkpoint import check_layout, resolve_prefix
from backbone.errors import CheckpointError
from backbone.inception_v4 import (FEATURE_DIM, IMAGE_SIZE, LOGITS_SCOPE, PRELOGITS,
                                   build_inception_v4)

log = logging.getLogger(__name__)

INPUT_NAME = "input"


@dataclass(frozen=True)
class TrunkTimings:
    """Seconds spent in each step of `Trunk.from_checkpoint`."""

    build_s: float
    restore_s: float
    warmup_s: float


def select_device(device: str = "auto", gpu_memory_limit_mb: int | None = None) -> str:
    """Picks the TF device string for the trunk.

    "auto" takes the first GPU TensorFlow sees, else the CPU. On a GPU, memory growth is turned
    on (TensorFlow never gives GPU memory back, so do not grab it all up front) and an optional
    cap is applied; both must happen before the GPU is first used in this process.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if device == "auto":
        device = "/GPU:0" if gpus else "/CPU:0"
    device = device.upper().replace("/DEVICE:", "/")
    if not device.startswith("/"):
        device = f"/{device}"
    if "GPU" in device:
        if not gpus:
            raise CheckpointError(f"device '{device}' requested but TensorFlow sees no GPU")
        try:
            for gpu in gpus:
                tf.config.experimental.set_memory_growth(gpu, True)
            if gpu_memory_limit_mb:
                tf.config.set_logical_device_configuration(
                    gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_limit_mb)])
        except RuntimeError:  # already initialised by an earlier Trunk: keep its settings
            log.info("GPU already initialised; memory settings of the first trunk stay")
    return device


class Trunk:
    """Inception-V4 up to `PreLogitsFlatten`, restored from a slim checkpoint.

    Build with `Trunk.from_checkpoint(...)`. `features` is thread-safe: a TF session runs
    concurrent `run` calls and releases the GIL while it computes.
    """

    def __init__(self, *, graph, session, inputs, features, logits, device: str,
                 checkpoint_prefix: str, variables: list[tuple[str, list[int]]],
                 end_points: dict[str, list[int | None]], timings: TrunkTimings):
        self._graph = graph
        self._session = session
        self._inputs = inputs
        self._features = features
        self._logits = logits
        self.device = device
        self.checkpoint_prefix = checkpoint_prefix
        self.variables = variables  # [(name, shape)] restored, in creation order
        self.end_points = end_points  # name -> static shape
        self.timings = timings
        self._closed = threading.Event()

    @property
    def num_classes(self) -> int:
        """Class count of the checkpoint's own Logits layer, 0 if built without it."""
        return int(self._logits.shape[-1]) if self._logits is not None else 0

    @property
    def graph(self):
        return self._graph

    @classmethod
    def from_checkpoint(cls, prefix: str, *, device: str = "auto",
                        intra_op_threads: int | None = None,
                        inter_op_threads: int | None = None,
                        with_logits: bool = False,
                        gpu_memory_limit_mb: int | None = None,
                        warmup_batch_sizes: tuple[int, ...] = (1,)) -> "Trunk":
        """Builds the trunk graph once, restores it from a checkpoint and warms it up.

        Args:
          prefix: checkpoint prefix (or a directory with one) holding the trunk variables: the
            official `inception_v4.ckpt`, a slim fine-tuned one (any Logits class count), or
            one written by `multihead init-trunk`. Only the trunk (and with `with_logits`, the
            Logits layer) is restored; AuxLogits, optimizer slots etc. are ignored.
          device: "auto" (first GPU, else CPU), "cpu", "gpu" or a TF device string.
          intra_op_threads / inter_op_threads: TF thread pools; None lets TF choose.
          with_logits: also build the checkpoint's own Logits layer (`features_and_logits`).
          gpu_memory_limit_mb: optional cap on GPU memory (memory growth is always on).
          warmup_batch_sizes: batch sizes run once before returning.

        Raises:
          CheckpointError: the file is missing (names the path) or a variable is missing or
            mis-shaped (names the variable and both shapes).
        """
        import tensorflow as tf

        prefix = resolve_prefix(prefix)
        num_classes = check_layout(prefix, with_logits=with_logits)
        device = select_device(device, gpu_memory_limit_mb)
        config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
        config.gpu_options.allow_growth = True
        if intra_op_threads:
            config.intra_op_parallelism_threads = intra_op_threads
        if inter_op_threads:
            config.inter_op_parallelism_threads = inter_op_threads

        t0 = time.perf_counter()
        graph = tf.Graph()
        with graph.as_default(), tf.device(device), warnings.catch_warnings():
            # tf-slim calls Keras-1 era layer APIs that warn on every layer; nothing to act on.
            warnings.filterwarnings("ignore", category=UserWarning, message=".*deprecated")
            inputs = tf.compat.v1.placeholder(tf.float32, [None, IMAGE_SIZE, IMAGE_SIZE, 3],
                                              name=INPUT_NAME)
            end_points = build_inception_v4(inputs, num_classes=num_classes)
            variables = tf.compat.v1.global_variables()
            saver = tf.compat.v1.train.Saver(var_list={v.op.name: v for v in variables})
        features = end_points[PRELOGITS]
        logits = end_points.get("Logits")
        graph.finalize()
        session = tf.compat.v1.Session(graph=graph, config=config)
        t1 = time.perf_counter()
        try:
            # NOTE: inside the graph: outside it, TF2's Saver takes its eager path.
            with graph.as_default():
                saver.restore(session, prefix)
        except Exception as exc:
            session.close()
            raise CheckpointError(f"cannot restore trunk from '{prefix}': {exc}") from None
        t2 = time.perf_counter()
        specs = [(v.op.name, v.shape.as_list()) for v in variables]
        shapes = {name: t.shape.as_list() for name, t in end_points.items()}
        t3 = time.perf_counter()
        trunk = cls(graph=graph, session=session, inputs=inputs, features=features,
                    logits=logits, device=device, checkpoint_prefix=prefix, variables=specs,
                    end_points=shapes,
                    timings=TrunkTimings(t1 - t0, t2 - t1, 0.0))
        for size in warmup_batch_sizes:
            trunk.features(np.zeros((size, IMAGE_SIZE, IMAGE_SIZE, 3), np.float32))
        t4 = time.perf_counter()
        trunk.timings = TrunkTimings(t1 - t0, t2 - t1, t4 - t3)
        log.info("trunk ready on %s from %s: build %.1fs restore %.1fs warm-up %.1fs",
                 device, prefix, t1 - t0, t2 - t1, t4 - t3)
        return trunk

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
        return self._session.run(self._features, {self._inputs: self._check(images)})

    def features_and_logits(self, images) -> tuple[np.ndarray, np.ndarray]:
        """Features [N, 1536] and the checkpoint's own Logits [N, num_classes] in one run."""
        if self._logits is None:
            raise RuntimeError("trunk was built without its Logits layer (with_logits=False)")
        return tuple(self._session.run([self._features, self._logits],
                                       {self._inputs: self._check(images)}))

    def close(self) -> None:
        """Closes the session; further calls raise. Safe to call twice."""
        if not self._closed.is_set():
            self._closed.set()
            self._session.close()

    def __repr__(self) -> str:
        return f"Trunk(device={self.device!r}, checkpoint={self.checkpoint_prefix!r})"


__all__ = ["Trunk", "TrunkTimings", "select_device", "FEATURE_DIM", "LOGITS_SCOPE"]
