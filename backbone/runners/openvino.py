"""The trunk on OpenVINO: the restored tf-slim graph, frozen in memory and compiled in-process.

tf-slim stays the one definition of the net. `OpenVinoRunner.load` loads the TF runner exactly
as for runtime "tf" (fp32), takes its restored graph through `TfRunner.freeze` (variables
become constants; input with a dynamic batch, output `PreLogitsFlatten` and optionally
`Logits`), `compile_graph` hands it to OpenVINO's TensorFlow frontend and the CPU plugin, and
`CompiledCache` keeps the compiled blob next to the graph cache, so a restart imports it (no
TensorFlow, no conversion). Precision "int8" compiles the INT8 model `multihead quantize` made
of the same frozen graph (`backbone.quantize.Int8Artifact`, an OpenVINO IR: no TensorFlow
either), its float layers in fp32 or bf16, and caches the compiled blob the same way.

`import backbone` imports no OpenVINO: the package is imported on the first load.

Choices (this machine: 2 cores AMD EPYC Zen 3, AVX2 only, no bf16; the machine was shared
and loaded during measurement, so the numbers below are ratios within one run, not rates):
  - PERFORMANCE_HINT LATENCY: one stream over both cores, OPTIMAL_NUMBER_OF_INFER_REQUESTS 1.
    THROUGHPUT makes two one-core streams, which only pays with >= 2 concurrent callers; the
    service feeds the trunk from one thread with cross-bot batches, so LATENCY is the fit.
  - requests: a pool of infer requests, one per concurrent caller, created on demand and
    reused. With one stream, concurrent requests queue inside the plugin, so the pool adds no
    throughput; it makes `features` safe from many threads (a request is not) and costs one
    request's activations per concurrent caller, so a single serving thread uses one.
  - the batch dimension is dynamic and compiled once (shapes 1..16 all run on one model).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import io
import json
import logging
import os
import queue
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from backbone import telemetry
from backbone.errors import Int8ArtifactMissing, PrecisionUnsupported
from backbone.runners import tf as tf_runner
from backbone.runners.base import (
    Calibration,
    Layout,
    LoadReport,
    LoadRequest,
    Runner,
    RunnerInfo,
)
from backbone.runners.registry import (
    ANYWHERE,
    INT8_TRUNK,
    NATIVE_BF16,
    Needs,
    RunnerSpec,
    register,
)
from backbone.spec import IMAGE_SIZE

log = logging.getLogger(__name__)

# OpenVINO: the CPU plugin only; fp32, bf16 where the CPU has it, and int8 from the INT8 trunk
# of `multihead quantize`. `auto` prefers it on the CPU where it is installed.
SPEC = RunnerSpec(
    name="openvino", title="OpenVINO", engine="OpenVINO's CPU plugin", devices=("cpu",),
    packages=("openvino",), extra="openvino", rank=10,
    summary="compiled in-process from the same restored tf-slim graph, cached in graph_cache/ "
            "next to the trunk checkpoint",
    precisions={"fp32": ANYWHERE, "bf16": NATIVE_BF16, "int8": Needs(artifact=INT8_TRUNK)})
DEVICE = "CPU"
PERFORMANCE_HINT = "LATENCY"
_OV_PRECISION = {"fp32": "f32", "bf16": "bf16"}
LAYOUT_RT_INFO = ("multihead", "layout")  # where a model keeps its `Layout`


def _ov():
    telemetry.off()  # before `openvino` imports its converter
    import openvino

    return openvino


def version() -> str:
    return _ov().__version__


def compile_graph(frozen: tf_runner.FrozenGraph, *, precision: str, threads: int | None = None):
    """Converts a frozen graph with OpenVINO's TF frontend and compiles it for the CPU.

    Returns:
      An `openvino.CompiledModel` with a dynamic batch dimension.
    """
    config = compile_config(precision, threads)
    return _checked(_ov().Core().compile_model(convert_graph(frozen), DEVICE, config), precision)


def convert_graph(frozen: tf_runner.FrozenGraph):
    """The frozen graph as an `openvino.Model` (OpenVINO's TF frontend), dynamic batch."""
    return _ov().convert_model(frozen.graph_def,
                               input=[(frozen.input_name, [-1, IMAGE_SIZE, IMAGE_SIZE, 3])],
                               output=frozen.output_names)


def set_layout(model, layout: Layout) -> None:
    """Keeps the restored net's `Layout` in a model's runtime info (JSON), which NNCF's
    quantization and the IR files keep: an INT8 trunk then loads without TensorFlow."""
    model.set_rt_info(json.dumps(layout.to_json()), list(LAYOUT_RT_INFO))


def layout_of(model) -> Layout:
    """The `Layout` a model carries (`set_layout`)."""
    return Layout.from_json(json.loads(model.get_rt_info(list(LAYOUT_RT_INFO)).astype(str)))


def compile_config(precision: str, threads: int | None = None) -> dict:
    """OpenVINO CPU properties for a resolved float precision ("fp32" or "bf16"; for an INT8
    model, the precision of its float layers)."""
    if precision not in _OV_PRECISION:
        raise PrecisionUnsupported(f"precision {precision!r} is not a float precision of "
                                   f"OpenVINO's CPU plugin: use 'fp32' or 'bf16'")
    config = {"PERFORMANCE_HINT": PERFORMANCE_HINT,
              "INFERENCE_PRECISION_HINT": _OV_PRECISION[precision]}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    return config


def _checked(compiled, precision: str):
    """Refuses a compiled model that does not run in the requested precision.

    NOTE: on a CPU without bf16 the plugin silently compiles bf16 as f32; the trunk's own
    check (CPU flags) refuses first, this one catches anything that slips past it.
    """
    got = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    want = _OV_PRECISION[precision]
    if want not in got.lower().replace("float32", "f32").replace("bfloat16", "bf16"):
        raise PrecisionUnsupported(f"OpenVINO compiled the trunk in {got}, not {precision}: "
                                   f"this CPU does not support {precision}")
    return compiled


class CompiledCache:
    """The compiled trunk exported by OpenVINO (`<dir>/inception_v4-ov-<key>.blob`) + metadata.

    Keyed by everything the blob depends on: the weights (the V2 checkpoint's `.index`, whose
    entries hold every tensor's crc32c, and the data shard sizes; a V1 file's full bytes), the
    precision, the outputs, the network and freezing source, and the TensorFlow and OpenVINO
    versions; an INT8 trunk's entry also by its artifact's key (checkpoint, calibration set,
    libraries) and the precision of its float layers (`variant`). A hit starts the trunk
    without TensorFlow. A corrupt entry is ignored and rewritten; a read-only directory only
    costs the cache.
    """

    def __init__(self, directory: str | os.PathLike, *, prefix: str, precision: str,
                 with_logits: bool, variant: str = ""):
        from backbone import inception_v4

        digest = hashlib.sha256()
        for part in (version(), _dist_version("tensorflow"), precision, str(with_logits),
                     PERFORMANCE_HINT, variant):
            digest.update(part.encode() + b"|")
        for source in (inspect.getsourcefile(inception_v4), tf_runner.__file__, __file__):
            digest.update(Path(source).read_bytes())
        digest.update(checkpoint_fingerprint(prefix).encode())
        key = digest.hexdigest()[:16]
        self.path = Path(directory) / f"inception_v4-ov-{key}.blob"
        self.meta_path = self.path.with_suffix(".json")
        self.hit = False

    def load(self, precision: str, threads: int | None = None):
        """(compiled model, metadata dict) or None."""
        if not (self.path.exists() and self.meta_path.exists()):
            return None
        try:
            meta = json.loads(self.meta_path.read_text())
            compiled = _ov().Core().import_model(self.path.read_bytes(), DEVICE,
                                                 compile_config(precision, threads))
            compiled = _checked(compiled, precision)
        except PrecisionUnsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - a corrupt or foreign blob: recompile
            log.warning("ignoring unusable compiled-trunk cache %s: %s", self.path, exc)
            return None
        self.hit = True
        return compiled, meta

    def save(self, compiled, meta: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            stream = io.BytesIO()  # NOTE: export_model() without a stream also returns one
            compiled.export_model(stream)
            tmp.write_bytes(stream.getbuffer())
            del stream
            tmp_meta = self.meta_path.with_name(f".{self.meta_path.name}.{os.getpid()}.tmp")
            tmp_meta.write_text(json.dumps(meta))
            os.replace(tmp_meta, self.meta_path)  # metadata first: the blob's arrival commits
            os.replace(tmp, self.path)
        except Exception as exc:  # noqa: BLE001 - e.g. a read-only store: never stop the service
            log.warning("cannot write compiled-trunk cache %s: %s", self.path, exc)


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def checkpoint_fingerprint(prefix: str) -> str:
    """A digest that changes whenever the checkpoint's tensors do, read without TensorFlow.

    V2: the `.index` file (names, shapes, offsets and a crc32c of every tensor) and the sizes
    of the data shards. V1 (one file, like the official `inception_v4.ckpt`): all its bytes.
    A start asks for it several times (compiled-model cache, INT8 trunks): it is read once per
    state of the files (path, inode, size and modification time of each).
    """
    index = Path(f"{prefix}.index")
    files = [index, *sorted(index.parent.glob(f"{index.name[:-len('.index')]}.data-*"))] \
        if index.exists() else [Path(prefix)]
    state = tuple((str(p.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
                  for p in files for st in [p.stat()])
    return _fingerprint(prefix, state)


@functools.lru_cache(maxsize=8)
def _fingerprint(prefix: str, state: tuple) -> str:  # `state` keys the cache only
    digest = hashlib.sha256()
    index = Path(f"{prefix}.index")
    if index.exists():
        digest.update(index.read_bytes())
        for shard in sorted(index.parent.glob(f"{index.name[:-len('.index')]}.data-*")):
            digest.update(f"{shard.name}:{shard.stat().st_size}".encode())
    else:
        with open(prefix, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@register(SPEC)
class OpenVinoRunner(Runner):
    """Runs a compiled trunk from many threads: a pool of infer requests, one per caller.

    A caller takes an idle request (or creates one when all are busy) and gives it back after
    the run, so N concurrent callers use at most N requests and a single serving thread uses
    one. `infer` releases the GIL; outputs are copied out of the request before it is reused.
    """

    def __init__(self, compiled, *, info: RunnerInfo, layout: Layout, report: LoadReport):
        self._compiled = compiled
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._idle.put(compiled.create_infer_request())
        self.info = info
        self.layout = layout
        self.report = report

    @classmethod
    def load(cls, request: LoadRequest) -> OpenVinoRunner:
        """Imports the compiled trunk from the cache, or loads the TF runner (fp32), freezes
        its restored graph, compiles it and caches the result. Precision "int8" compiles the
        request's INT8 artifact instead (`_load_int8`)."""
        if request.precision == "int8":
            return cls._load_int8(request)
        t0 = time.perf_counter()
        threads = request.intra_op_threads
        cache = (CompiledCache(request.cache_dir, prefix=request.prefix,
                               precision=request.precision, with_logits=request.with_logits)
                 if request.cache_dir else None)
        loaded = cache.load(request.precision, threads=threads) if cache else None
        if loaded is not None:
            compiled, meta = loaded
            layout = Layout.from_json(meta)
            report = LoadReport(compile_s=time.perf_counter() - t0, graph_from_cache=True,
                                compiled_from_cache=True)
        else:
            # The one definition of the net: the same build and restore as runtime "tf".
            source = tf_runner.TfRunner.load(replace(request, precision="fp32"))
            t_compile = time.perf_counter()
            try:
                frozen = source.freeze()
            finally:
                # NOTE: the TF session and its weights are not kept: OpenVINO holds its own
                # copy of the constants, so keeping both would double the trunk's memory.
                source.close()
            compiled = compile_graph(frozen, precision=request.precision, threads=threads)
            del frozen
            layout = source.layout
            report = replace(source.report, compile_s=time.perf_counter() - t_compile)
            if cache:
                cache.save(compiled, layout.to_json())
        return cls(compiled, info=RunnerInfo(SPEC.name, request.precision, request.device),
                   layout=layout, report=report)

    @classmethod
    def _load_int8(cls, request: LoadRequest) -> OpenVinoRunner:
        """The INT8 trunk: the artifact's model (an OpenVINO IR, no TensorFlow) compiled with
        its float layers in `request.float_precision`, or that compiled model imported from
        the cache (a restart)."""
        artifact = request.int8_artifact
        if artifact is None:
            raise Int8ArtifactMissing("precision 'int8' was asked for without an INT8 trunk")
        if request.with_logits:
            raise PrecisionUnsupported("the INT8 trunk computes features only, not the "
                                       "checkpoint's Logits layer: load it in fp32 or bf16")
        t0 = time.perf_counter()
        threads, float_precision = request.intra_op_threads, request.float_precision
        calibration = Calibration.from_metadata(artifact.metadata())
        cache = (CompiledCache(request.cache_dir, prefix=request.prefix, precision="int8",
                               with_logits=False, variant=f"{artifact.key}|{float_precision}")
                 if request.cache_dir else None)
        loaded = cache.load(float_precision, threads=threads) if cache else None
        if loaded is not None:
            compiled, meta = loaded
            layout = Layout.from_json(meta)
        else:
            model = artifact.load()
            layout = layout_of(model)
            compiled = _checked(_ov().Core().compile_model(
                model, DEVICE, compile_config(float_precision, threads)), float_precision)
            del model
            if cache:
                cache.save(compiled, layout.to_json())
        # NOTE: an INT8 start never builds the TF graph: the artifact is the converted model.
        report = LoadReport(compile_s=time.perf_counter() - t0, graph_from_cache=True,
                            compiled_from_cache=loaded is not None)
        if not calibration.passed:
            log.warning("the INT8 trunk %s failed its gate when it was calibrated (kept with "
                        "--force or by the demo): served because int8 was asked for",
                        artifact.xml_path.name)
        info = RunnerInfo(SPEC.name, "int8", request.device, float_precision=float_precision,
                          calibration=calibration)
        return cls(compiled, info=info, layout=layout, report=report)

    def run(self, images: np.ndarray) -> list[np.ndarray]:
        """Every output of the model for a float32 batch [N, H, W, 3], as float32 arrays."""
        try:
            request = self._idle.get_nowait()
        except queue.Empty:
            request = self._compiled.create_infer_request()
        try:
            result = request.infer({0: images}, share_inputs=True, share_outputs=False)
            return [np.asarray(result[i], dtype=np.float32) for i in range(len(result))]
        finally:
            self._idle.put(request)

    def features(self, images: np.ndarray) -> np.ndarray:
        return self.run(images)[0]

    def executed_precisions(self) -> dict[str, dict[str, int]]:
        """What the CPU plugin runs: layer type -> {precision: layer count}, from the compiled
        model's execution graph (e.g. {"Convolution": {"u8": 149}} for an INT8 trunk)."""
        out: dict[str, dict[str, int]] = {}
        for op in self._compiled.get_runtime_model().get_ops():
            info = op.get_rt_info()
            kind = str(info["layerType"].astype(str))
            precision = str(info["runtimePrecision"].astype(str)).lower()
            out.setdefault(kind, {}).setdefault(precision, 0)
            out[kind][precision] += 1
        return out

    def features_and_logits(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        features, logits = self.run(images)
        return features, logits

    def close(self) -> None:
        self._compiled = None
        self._idle = queue.SimpleQueue()
