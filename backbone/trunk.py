"""The shared trunk: one Inception-V4 graph and session per process, pixels in, features out.

NOTE: everything lives in the Trunk's own `tf.Graph` (never the default graph), so several
Trunks can coexist in one process and nothing leaks into code that uses the default graph.
The graph is finalized after the build: any accidental op creation later raises at once.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backbone.checkpoint import check_layout, resolve_prefix
from backbone.errors import CheckpointError
from backbone.inception_v4 import LOGITS_SCOPE, PRELOGITS, build_inception_v4
from backbone.spec import FEATURE_DIM, IMAGE_SIZE

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
                    gpus[0],
                    [tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_limit_mb)])
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
        self._from_cache = False

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
                        warmup_batch_sizes: tuple[int, ...] = (1,),
                        graph_cache_dir: str | os.PathLike | None = None) -> Trunk:
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
          graph_cache_dir: if given, the built graph is saved there (a MetaGraphDef keyed by
            TF version, class count and this network's source) and re-imported by later
            processes instead of rebuilt: about 1 s instead of about 5-8 s. The weights always
            come from `prefix`; a corrupt cache entry is ignored and rebuilt.

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
        cache = GraphCache(graph_cache_dir, num_classes) if graph_cache_dir else None
        built = cache.load(device) if cache else None
        if built is None:
            built = _build_graph(device, num_classes)
            if cache:
                cache.save(built)
        graph, inputs, end_points_t, saver = built
        features = end_points_t[PRELOGITS]
        logits = end_points_t.get("Logits")
        graph.finalize()
        session = tf.compat.v1.Session(graph=graph, config=config)
        t1 = time.perf_counter()
        try:
            # NOTE: inside the graph: outside it, TF2's Saver takes its eager path.
            with graph.as_default():
                saver.restore(session, prefix)
        except Exception as exc:  # noqa: BLE001 - TF raises many types; all mean a bad file
            session.close()
            raise CheckpointError(f"cannot restore trunk from '{prefix}': {exc}") from None
        t2 = time.perf_counter()
        with graph.as_default():
            variables = tf.compat.v1.global_variables()
        specs = [(v.op.name, v.shape.as_list()) for v in variables]
        shapes = {name: t.shape.as_list() for name, t in end_points_t.items()}
        t3 = time.perf_counter()
        trunk = cls(graph=graph, session=session, inputs=inputs, features=features,
                    logits=logits, device=device, checkpoint_prefix=prefix, variables=specs,
                    end_points=shapes,
                    timings=TrunkTimings(t1 - t0, t2 - t1, 0.0))
        trunk._from_cache = bool(cache and cache.hit)
        for size in warmup_batch_sizes:
            trunk.features(np.zeros((size, IMAGE_SIZE, IMAGE_SIZE, 3), np.float32))
        t4 = time.perf_counter()
        trunk.timings = TrunkTimings(t1 - t0, t2 - t1, t4 - t3)
        log.info("trunk ready on %s from %s: build %.1fs restore %.1fs warm-up %.1fs",
                 device, prefix, t1 - t0, t2 - t1, t4 - t3)
        return trunk

    @property
    def graph_from_cache(self) -> bool:
        return self._from_cache

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


def _build_graph(device: str, num_classes: int):
    """Builds the inference graph with tf-slim: (graph, input, end points, saver)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default(), tf.device(device), warnings.catch_warnings():
        # tf-slim calls Keras-1 era layer APIs that warn on every layer; nothing to act on.
        warnings.filterwarnings("ignore", category=UserWarning, message=".*deprecated")
        inputs = tf.compat.v1.placeholder(tf.float32, [None, IMAGE_SIZE, IMAGE_SIZE, 3],
                                          name=INPUT_NAME)
        end_points = build_inception_v4(inputs, num_classes=num_classes)
        saver = tf.compat.v1.train.Saver(
            var_list={v.op.name: v for v in tf.compat.v1.global_variables()})
    return graph, inputs, end_points, saver


class GraphCache:
    """A built trunk graph saved as a MetaGraphDef (+ the names of its end points).

    Keyed by TensorFlow's version, the Logits class count and a digest of the network source,
    so a change to any of them builds afresh. Holds no weights.
    """

    def __init__(self, directory: str | os.PathLike, num_classes: int):
        import tensorflow as tf

        source = Path(inspect.getsourcefile(build_inception_v4)).read_bytes()
        key = hashlib.sha256(b"|".join([tf.__version__.encode(), str(num_classes).encode(),
                                        source])).hexdigest()[:16]
        self.path = Path(directory) / f"inception_v4-{key}.meta"
        self.names_path = self.path.with_suffix(".json")
        self.hit = False

    def load(self, device: str):
        import tensorflow as tf

        if not (self.path.exists() and self.names_path.exists()):
            return None
        try:
            names = json.loads(self.names_path.read_text())
            graph = tf.Graph()
            with graph.as_default(), tf.device(device):
                saver = tf.compat.v1.train.import_meta_graph(str(self.path))
            end_points = {k: graph.get_tensor_by_name(v) for k, v in names.items()}
            inputs = graph.get_tensor_by_name(f"{INPUT_NAME}:0")
        except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: rebuild, never fail
            log.warning("ignoring unusable graph cache %s: %s", self.path, exc)
            return None
        self.hit = True
        return graph, inputs, end_points, saver

    def save(self, built) -> None:
        import tensorflow as tf

        graph, _, end_points, saver = built
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            with graph.as_default():  # NOTE: outside a graph context TF2 refuses (eager)
                tf.compat.v1.train.export_meta_graph(str(tmp), graph=graph, clear_devices=True,
                                                     saver_def=saver.as_saver_def())
            tmp_names = self.names_path.with_name(f".{self.names_path.name}.{os.getpid()}.tmp")
            tmp_names.write_text(json.dumps({k: t.name for k, t in end_points.items()}))
            os.replace(tmp_names, self.names_path)  # names first: the .meta's arrival commits
            os.replace(tmp, self.path)
        except Exception as exc:  # noqa: BLE001 - e.g. a read-only store: never stop the service
            log.warning("cannot write graph cache %s: %s", self.path, exc)


__all__ = ["Trunk", "TrunkTimings", "GraphCache", "select_device", "FEATURE_DIM", "LOGITS_SCOPE"]
