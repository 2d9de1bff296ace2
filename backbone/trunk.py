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
from backbone.precision import (
    cpu_flags,
    maybe_has_gpu,
    openvino_available,
    resolve_precision,
    resolve_runtime,
    session_config,
)
from backbone.spec import FEATURE_DIM, IMAGE_SIZE
from backbone.tfimport import import_tensorflow

log = logging.getLogger(__name__)

INPUT_NAME = "input"


@dataclass(frozen=True)
class TrunkTimings:
    """Seconds spent in each step of `Trunk.from_checkpoint`."""

    build_s: float
    restore_s: float
    warmup_s: float
    compile_s: float = 0.0  # OpenVINO: freeze + convert + compile, or import from the cache


def select_device(device: str = "auto", gpu_memory_limit_mb: int | None = None) -> str:
    """Picks the TF device string for the trunk.

    "auto" takes the first GPU TensorFlow sees, else the CPU. On a GPU, memory growth is turned
    on (TensorFlow never gives GPU memory back, so do not grab it all up front) and an optional
    cap is applied; both must happen before the GPU is first used in this process.
    """
    tf = import_tensorflow(device)

    gpus = tf.config.list_physical_devices("GPU")
    if device == "auto":
        device = "/GPU:0" if gpus else "/CPU:0"
    device = _normalize_device(device)
    if "GPU" in device:
        if not gpus:
            raise CheckpointError(f"device '{device}' requested but TensorFlow sees no GPU")
        try:
            for gpu in gpus:
                tf.config.experimental.set_memory_growth(gpu, True)
            if gpu_memory_limit_mb:
                limit = tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_limit_mb)
                tf.config.set_logical_device_configuration(gpus[0], [limit])
        except RuntimeError:  # already initialised by an earlier Trunk: keep its settings
            log.info("GPU already initialised; memory settings of the first trunk stay")
    return device


def _normalize_device(device: str) -> str:
    device = device.upper().replace("/DEVICE:", "/")
    return device if device.startswith("/") else f"/{device}"


def _cpu_device_without_tf(device: str) -> str | None:
    """The CPU device string when it is known without importing TensorFlow, else None."""
    if device == "auto":
        return None if maybe_has_gpu() else "/CPU:0"
    device = _normalize_device(device)
    return device if device.startswith("/CPU") else None


class Trunk:
    """Inception-V4 up to `PreLogitsFlatten`, restored from a slim checkpoint.

    Build with `Trunk.from_checkpoint(...)`. `features` is thread-safe: a TF session runs
    concurrent `run` calls and releases the GIL while it computes; on OpenVINO each concurrent
    caller gets its own infer request (see `backbone.openvino_runtime`).
    """

    def __init__(self, *, graph, session, inputs, features, logits, device: str,
                 checkpoint_prefix: str, variables: list[tuple[str, list[int]]],
                 end_points: dict[str, list[int | None]], timings: TrunkTimings,
                 precision: str = "fp32", runtime: str = "tf", runner=None,
                 num_classes: int | None = None):
        self._graph = graph
        self._session = session
        self._inputs = inputs
        self._features = features
        self._logits = logits
        self._runner = runner  # OpenVinoRunner when runtime == "openvino"
        self._num_classes = (num_classes if num_classes is not None
                             else int(logits.shape[-1]) if logits is not None else 0)
        self.device = device
        self.precision = precision  # resolved: "fp32" | "bf16" | "fp16"
        self.runtime = runtime  # resolved: "tf" | "openvino"
        self.checkpoint_prefix = checkpoint_prefix
        self.variables = variables  # [(name, shape)] restored, in creation order
        self.end_points = end_points  # name -> static shape
        self.timings = timings
        self._closed = threading.Event()
        self._from_cache = False
        self._compiled_from_cache = False

    @property
    def num_classes(self) -> int:
        """Class count of the checkpoint's own Logits layer, 0 if built without it."""
        return self._num_classes

    @property
    def graph(self):
        """The TF graph (runtime "tf"); None on OpenVINO, which keeps no TF graph."""
        return self._graph

    @classmethod
    def from_checkpoint(cls, prefix: str, *, device: str = "auto",
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
          device: "auto" (first GPU, else CPU), "cpu", "gpu" or a TF device string.
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
        # NOTE: a CPU-only start resolves everything without TensorFlow, so a cached OpenVINO
        # trunk starts without importing it.
        device = _cpu_device_without_tf(device) or select_device(device, gpu_memory_limit_mb)
        precision = resolve_precision(precision, device=device, flags=cpu_flags())
        runtime = resolve_runtime(runtime, device=device, openvino=openvino_available())
        if runtime == "openvino":
            return cls._from_checkpoint_openvino(
                prefix, device=device, precision=precision, with_logits=with_logits,
                intra_op_threads=intra_op_threads, inter_op_threads=inter_op_threads,
                warmup_batch_sizes=warmup_batch_sizes, graph_cache_dir=graph_cache_dir)

        tf = import_tensorflow(device)

        num_classes = check_layout(prefix, with_logits=with_logits)
        config = session_config(device, precision, intra_op_threads, inter_op_threads)

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
        except Exception as exc:  # noqa: BLE001 - TF raises many types; all mean "cannot restore"
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
                    end_points=shapes, timings=TrunkTimings(t1 - t0, t2 - t1, 0.0),
                    precision=precision, runtime="tf")
        trunk._from_cache = bool(cache and cache.hit)
        trunk._warm_up(warmup_batch_sizes)
        t4 = time.perf_counter()
        trunk.timings = TrunkTimings(t1 - t0, t2 - t1, t4 - t3)
        log.info("trunk ready on %s (tf, %s) from %s: build %.1fs restore %.1fs warm-up %.1fs",
                 device, precision, prefix, t1 - t0, t2 - t1, t4 - t3)
        return trunk

    @classmethod
    def _from_checkpoint_openvino(cls, prefix: str, *, device: str, precision: str,
                                  with_logits: bool, intra_op_threads, inter_op_threads,
                                  warmup_batch_sizes, graph_cache_dir) -> Trunk:
        """Restores the tf-slim trunk as for runtime "tf", freezes it and compiles it with
        OpenVINO (or imports the compiled model from the cache, skipping TensorFlow)."""
        from backbone import openvino_runtime as ovr

        t0 = time.perf_counter()
        cache = (ovr.CompiledCache(graph_cache_dir, prefix=prefix, precision=precision,
                                   with_logits=with_logits) if graph_cache_dir else None)
        loaded = cache.load(precision, threads=intra_op_threads) if cache else None
        if loaded is not None:
            compiled, meta = loaded
            build_s = restore_s = 0.0
            graph_hit = True
        else:
            # The one definition of the net: the same build and restore as runtime "tf".
            source = cls.from_checkpoint(
                prefix, device=device, with_logits=with_logits, warmup_batch_sizes=(),
                intra_op_threads=intra_op_threads, inter_op_threads=inter_op_threads,
                graph_cache_dir=graph_cache_dir, precision="fp32", runtime="tf")
            t_compile = time.perf_counter()
            try:
                outputs = [source._features] + ([source._logits] if with_logits else [])
                graph_def, output_names = ovr.freeze(source._session, source._graph, outputs)
            finally:
                # NOTE: the TF session and its weights are not kept: OpenVINO holds its own
                # copy of the constants, so keeping both would double the trunk's memory.
                source.close()
            compiled = ovr.compile_graph(
                graph_def, input_name=source._inputs.name,
                output_names=output_names, precision=precision, image_size=IMAGE_SIZE,
                threads=intra_op_threads)
            del graph_def
            meta = {"variables": source.variables, "end_points": source.end_points,
                    "num_classes": source.num_classes}
            build_s, restore_s = source.timings.build_s, source.timings.restore_s
            graph_hit = source.graph_from_cache
            if cache:
                cache.save(compiled, meta)
            t0 = t_compile
        t1 = time.perf_counter()
        trunk = cls(graph=None, session=None, inputs=None, features=None, logits=None,
                    device=device, checkpoint_prefix=prefix,
                    variables=[(name, list(shape)) for name, shape in meta["variables"]],
                    end_points=meta["end_points"], timings=TrunkTimings(build_s, restore_s, 0.0),
                    precision=precision, runtime="openvino", runner=ovr.OpenVinoRunner(compiled),
                    num_classes=int(meta["num_classes"]))
        trunk._from_cache = graph_hit
        trunk._compiled_from_cache = loaded is not None
        trunk._warm_up(warmup_batch_sizes)
        t2 = time.perf_counter()
        trunk.timings = TrunkTimings(build_s, restore_s, t2 - t1, compile_s=t1 - t0)
        log.info("trunk ready on %s (openvino %s, %s) from %s: %s %.1fs warm-up %.1fs",
                 device, ovr.version(), precision, prefix,
                 "imported from cache" if loaded is not None else "compiled", t1 - t0, t2 - t1)
        return trunk

    def _warm_up(self, batch_sizes) -> None:
        for size in batch_sizes:
            self.features(np.zeros((size, IMAGE_SIZE, IMAGE_SIZE, 3), np.float32))

    @property
    def graph_from_cache(self) -> bool:
        """Whether the start skipped building the graph (a graph or compiled-model cache hit)."""
        return self._from_cache

    @property
    def compiled_from_cache(self) -> bool:
        """OpenVINO: whether the compiled trunk was imported from `graph_cache_dir`."""
        return self._compiled_from_cache

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
        images = self._check(images)
        if self._runner is not None:
            return self._runner.run(images)[0]
        return self._session.run(self._features, {self._inputs: images})

    def features_and_logits(self, images) -> tuple[np.ndarray, np.ndarray]:
        """Features [N, 1536] and the checkpoint's own Logits [N, num_classes] in one run."""
        if not self._num_classes:
            raise RuntimeError("trunk was built without its Logits layer (with_logits=False)")
        images = self._check(images)
        if self._runner is not None:
            features, logits = self._runner.run(images)
            return features, logits
        return tuple(self._session.run([self._features, self._logits], {self._inputs: images}))

    def close(self) -> None:
        """Closes the session; further calls raise. Safe to call twice."""
        if not self._closed.is_set():
            self._closed.set()
            if self._runner is not None:
                self._runner.close()
            else:
                self._session.close()

    def __repr__(self) -> str:
        return (f"Trunk(device={self.device!r}, runtime={self.runtime!r}, "
                f"precision={self.precision!r}, checkpoint={self.checkpoint_prefix!r})")


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
