"""The trunk on TensorFlow: one tf-slim graph and one session, in the runner's own `tf.Graph`.

NOTE: everything lives in the runner's own graph (never the default graph), so several trunks
can coexist in one process and nothing leaks into code that uses the default graph. The graph
is finalized after the build: any accidental op creation later raises at once.

This is also where the net is defined for every other runtime: `TfRunner.freeze` hands the
restored graph, weights folded in, to a runtime that compiles it (OpenVINO).
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from backbone.checkpoint import check_layout
from backbone.errors import CheckpointError
from backbone.inception_v4 import PRELOGITS, build_inception_v4
from backbone.runners.base import Layout, LoadReport, LoadRequest, Runner, RunnerInfo
from backbone.runners.registry import ANYWHERE, GPU_ONLY, NATIVE_BF16, RunnerSpec, register
from backbone.spec import IMAGE_SIZE
from backbone.tfimport import import_tensorflow

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_PREFIX = "multihead_output_"

# TensorFlow: every device kind; bf16 through oneDNN's auto mixed precision on the CPU only (TF
# has no bf16 rewriter on a GPU), fp16 through the CUDA one on a GPU only (its CPU fp16 path
# only emulates it). The last resort of `auto`: it runs wherever the trunk does.
SPEC = RunnerSpec(
    name="tf", title="TensorFlow", packages=("tensorflow",), rank=100,
    precisions={"fp32": ANYWHERE,
                "bf16": replace(NATIVE_BF16, reason="TF's GPU mixed precision is fp16"),
                "fp16": GPU_ONLY})
PRECISIONS = tuple(SPEC.precisions)  # what a TF session runs


@dataclass(frozen=True)
class FrozenGraph:
    """The restored graph with every variable folded into a constant, ready to compile.

    Attributes:
      graph_def: the GraphDef (only the nodes the outputs need).
      input_name: the input tensor, float32 [N, 299, 299, 3] with a dynamic batch.
      output_names: the output tensors: features, then logits if loaded with them.
    """

    graph_def: object
    input_name: str
    output_names: list[str]


@register(SPEC)
class TfRunner(Runner):
    """A restored tf-slim graph in a `tf.compat.v1.Session`.

    `features` is thread-safe: a session runs concurrent `run` calls and releases the GIL
    while it computes.
    """

    def __init__(self, *, graph, session, inputs, outputs, info: RunnerInfo, layout: Layout,
                 report: LoadReport):
        self.graph = graph
        self._session = session
        self._inputs = inputs
        self._outputs = outputs  # [features] or [features, logits]
        self.info = info
        self.layout = layout
        self.report = report

    @classmethod
    def load(cls, request: LoadRequest) -> TfRunner:
        """Builds the graph (or imports it from the cache) and restores the checkpoint."""
        device = request.device.name
        tf = import_tensorflow(device)
        if request.device.is_gpu:
            configure_gpu_memory(tf, request.gpu_memory_limit_mb)
        num_classes = check_layout(request.prefix, with_logits=request.with_logits)
        config = session_config(request.precision, request.intra_op_threads,
                                request.inter_op_threads)

        t0 = time.perf_counter()
        cache = GraphCache(request.cache_dir, num_classes) if request.cache_dir else None
        built = cache.load(device) if cache else None
        if built is None:
            built = build_graph(device, num_classes)
            if cache:
                cache.save(built)
        graph, inputs, end_points, saver = built
        outputs = [end_points[PRELOGITS]] + ([end_points["Logits"]] if num_classes else [])
        graph.finalize()
        session = tf.compat.v1.Session(graph=graph, config=config)
        t1 = time.perf_counter()
        try:
            # NOTE: inside the graph: outside it, TF2's Saver takes its eager path.
            with graph.as_default():
                saver.restore(session, request.prefix)
        except Exception as exc:  # noqa: BLE001 - TF raises many types; all mean "cannot restore"
            session.close()
            raise CheckpointError(f"cannot restore trunk from '{request.prefix}': {exc}") from None
        t2 = time.perf_counter()
        with graph.as_default():
            variables = [(v.op.name, v.shape.as_list()) for v in tf.compat.v1.global_variables()]
        layout = Layout(variables, {name: t.shape.as_list() for name, t in end_points.items()},
                        num_classes)
        return cls(graph=graph, session=session, inputs=inputs, outputs=outputs,
                   info=RunnerInfo(SPEC.name, request.precision, request.device), layout=layout,
                   report=LoadReport(t1 - t0, t2 - t1, graph_from_cache=bool(cache and cache.hit)))

    def features(self, images: np.ndarray) -> np.ndarray:
        return self._session.run(self._outputs[0], {self._inputs: images})

    def features_and_logits(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        features, logits = self._session.run(self._outputs, {self._inputs: images})
        return features, logits

    def freeze(self) -> FrozenGraph:
        """The restored graph with every variable folded into a constant.

        Each output (features, then logits if loaded with them) gets an Identity node
        `multihead_output_<i>`, so every output is a terminal node: converters such as
        OpenVINO's frontend only expose terminal nodes as model outputs, and the features feed
        the Logits layer.
        """
        tf = import_tensorflow(self.info.device.name)
        graph_def = self.graph.as_graph_def()
        names = []
        for i, tensor in enumerate(self._outputs):
            node = graph_def.node.add(name=f"{OUTPUT_PREFIX}{i}", op="Identity",
                                      input=[tensor.name])
            node.attr["T"].type = tensor.dtype.as_datatype_enum
            names.append(node.name)
        # NOTE: keeps only the nodes the outputs need (the Saver, AuxLogits etc. are dropped).
        # TF logs once that this v1 API is deprecated: it is the one for a v1 graph and session.
        frozen = tf.compat.v1.graph_util.convert_variables_to_constants(self._session, graph_def,
                                                                        names)
        # The frontend names tensors, not nodes.
        return FrozenGraph(frozen, self._inputs.name, [f"{name}:0" for name in names])

    def close(self) -> None:
        self._session.close()


def configure_gpu_memory(tf, limit_mb: int | None) -> None:
    """Memory growth on every GPU (TensorFlow never gives GPU memory back, so do not grab it
    all up front) and an optional cap on the first; both before the GPU is first used."""
    gpus = tf.config.list_physical_devices("GPU")
    try:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        if limit_mb and gpus:
            limit = tf.config.LogicalDeviceConfiguration(memory_limit=limit_mb)
            tf.config.set_logical_device_configuration(gpus[0], [limit])
    except RuntimeError:  # already initialised by an earlier trunk: keep its settings
        log.info("GPU already initialised; memory settings of the first trunk stay")


def session_config(precision: str, intra_op_threads: int | None = None,
                   inter_op_threads: int | None = None):
    """The TF session ConfigProto for a resolved precision.

    bf16 turns on the oneDNN auto mixed precision rewriter (CPU); fp16 turns on the CUDA auto
    mixed precision rewriter (GPU). Both cast inside the graph: inputs and features stay
    float32. Call with an already resolved precision (`backbone.precision.resolve_precision`).
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import rewriter_config_pb2

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
    config.gpu_options.allow_growth = True
    if intra_op_threads:
        config.intra_op_parallelism_threads = intra_op_threads
    if inter_op_threads:
        config.inter_op_parallelism_threads = inter_op_threads
    rewrite = config.graph_options.rewrite_options
    if precision == "bf16":
        rewrite.auto_mixed_precision_onednn_bfloat16 = rewriter_config_pb2.RewriterConfig.ON
    elif precision == "fp16":
        rewrite.auto_mixed_precision = rewriter_config_pb2.RewriterConfig.ON
    return config


def build_graph(device: str, num_classes: int):
    """Builds the inference graph with tf-slim: (graph, input, end points, saver)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default(), tf.device(device), warnings.catch_warnings(), \
            _identity_equality(tf):
        # tf-slim calls Keras-1 era layer APIs that warn on every layer; nothing to act on.
        warnings.filterwarnings("ignore", category=UserWarning, message=".*deprecated")
        inputs = tf.compat.v1.placeholder(tf.float32, [None, IMAGE_SIZE, IMAGE_SIZE, 3],
                                          name=INPUT_NAME)
        end_points = build_inception_v4(inputs, num_classes=num_classes)
        saver = tf.compat.v1.train.Saver(
            var_list={v.op.name: v for v in tf.compat.v1.global_variables()})
    return graph, inputs, end_points, saver


@contextlib.contextmanager
def _identity_equality(tf):
    """Tensors and variables compared and hashed by identity while the graph is built.

    tf_keras' legacy `add_weight` (every tf-slim layer) puts all the graph's variables in a set
    for each new weight, and each `Variable.__hash__` first asks whether TF runs eagerly
    outside functions (a walk of the context stacks): quadratic in the 596 variables, about a
    fifth of the build's CPU time. Inside a graph's build that answer is always no, so hashing
    and equality are by identity anyway: switching TF's tensor equality off skips the question
    and changes no result. Put back as it was afterwards.
    NOTE: `Tensor._USE_EQUALITY` (read, not written) has no public getter.
    """
    was_on = getattr(tf.Tensor, "_USE_EQUALITY", True)
    tf.compat.v1.disable_tensor_equality()
    try:
        yield
    finally:
        if was_on:
            tf.compat.v1.enable_tensor_equality()


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
