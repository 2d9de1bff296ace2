"""The shared trunk: one Inception-V4 per process, pixels in, features out.

`Trunk` is a façade over exactly one runner (`backbone.runners`: TensorFlow, OpenVINO). It
detects the device once, resolves the runtime and precision by the rules of
`backbone.precision` (`choose`: looking up the INT8 trunks calibrated for the checkpoint),
loads the runner the runtime names, warms it up once, and adds what is common to every
runtime: the input check, the closed state and the checkpoint's description.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from backbone.checkpoint import cache_dir_of, resolve_prefix
from backbone.device import Device, detect_device
from backbone.inception_v4 import LOGITS_SCOPE
from backbone.precision import (
    INT8_FAILING,
    INT8_NONE,
    INT8_PASSING,
    float_layers_precision,
    resolve_precision,
    resolve_runtime,
)
from backbone.runners import Calibration, LoadRequest, Runner, registry
from backbone.spec import FEATURE_DIM, IMAGE_SIZE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrunkTimings:
    """Seconds spent in each step of `Trunk.from_checkpoint`."""

    build_s: float
    restore_s: float
    warmup_s: float
    compile_s: float = 0.0  # OpenVINO: freeze + convert + compile, or import from the cache


# What `choose` asks about the active heads: their top-1 agreement on an INT8 trunk (an
# `Int8Artifact`: its held-out features, `backbone.gate.agreement`), head name -> share. The
# caller knows the heads (a store, a service); the backbone only judges.
HeadsAgreement = Callable[[object], Mapping[str, float]]


@dataclass(frozen=True)
class TrunkChoice:
    """What a trunk will run as, resolved before anything is loaded (`choose`).

    Attributes:
      runtime: a registered runtime ("tf" | "openvino" | ...).
      precision: "fp32" | "bf16" | "fp16" | "int8".
      float_precision: the precision of the layers an INT8 trunk keeps in float.
      int8_artifact: precision "int8": the `backbone.quantize.Int8Artifact` to run.
      judged: the INT8 trunk whose gate is `gate`: the one run, else the newest one passed over
        (None where none was looked up or found).
      gate: its `backbone.gate.FidelityReport`, for the active heads when `choose` was given
        them, else as recorded at calibration.
      why: the precision and why, for the log ("int8: gate passed for 3 heads (...)",
        "bf16: the INT8 trunk's gate fails for head 'x' (...)").
    """

    runtime: str
    precision: str
    float_precision: str
    int8_artifact: object | None = None
    judged: object | None = None
    gate: object | None = None
    why: str = ""


def choose(prefix: str, *, device: Device, precision: str = "auto", runtime: str = "auto",
           int8_dir: str | os.PathLike | None = None,
           heads: HeadsAgreement | None = None) -> TrunkChoice:
    """Resolves the runtime, then the precision, by the rules of `backbone.precision`.

    The INT8 trunks calibrated for the checkpoint are looked up in `int8_dir` only where they
    matter (a runtime that declares the INT8 trunk, precision "int8" or "auto"); reads the
    checkpoint's fingerprint and no TensorFlow or OpenVINO. Each is judged by its gate
    (`backbone.gate`): for the active heads if `heads` is given (their agreement on its
    held-out features), else as recorded when it was calibrated. "auto" takes the newest one
    whose gate passes and passes over the others (a float precision then, `why` says which
    head failed); "int8" takes the newest passing one, else the newest one.

    Raises:
      ValueError, PrecisionUnsupported, Int8ArtifactMissing, RuntimeUnavailable: see
        `resolve_precision` and `resolve_runtime`.
    """
    runtime = resolve_runtime(runtime, device=device, available=registry.available())
    spec = registry.spec(runtime)
    wanted = precision.lower()
    looked_up = {needs.artifact for name, needs in spec.precisions.items()
                 if wanted in (name, "auto")}
    found = []
    if registry.INT8_TRUNK in looked_up and int8_dir is not None:
        from backbone.quantize import Int8Artifact

        found = Int8Artifact.available(int8_dir, prefix)  # newest first
    gates: dict[str, object] = {}

    def gate_of(artifact):
        if artifact.key not in gates:
            report = artifact.report()
            gates[artifact.key] = report if heads is None else report.for_heads(heads(artifact))
        return gates[artifact.key]

    passing = next((artifact for artifact in found if gate_of(artifact).passed), None)
    state = INT8_PASSING if passing else INT8_FAILING if found else INT8_NONE
    precision = resolve_precision(precision, device=device, runtime=runtime, int8=state)
    needs = spec.precisions[precision]
    artifact = (passing or found[0]) if needs.artifact is registry.INT8_TRUNK else None
    judged = artifact or (found[0] if found else None)
    gate = gate_of(judged) if judged is not None else None
    why = _why(precision, wanted, spec, gate, looked_up=registry.INT8_TRUNK in looked_up,
               kind=device.kind)
    return TrunkChoice(runtime, precision, float_layers_precision(device), artifact, judged,
                       gate, why)


def _why(precision: str, wanted: str, spec, gate, *, looked_up: bool, kind: str) -> str:
    """`TrunkChoice.why`: the precision and the reason, in one line."""
    if wanted != "auto":
        if precision == "int8" and gate is not None:
            return (f"int8: asked for; {gate.summary()}" if gate.passed else
                    f"int8: asked for, although the INT8 trunk's {gate.summary()}")
        return f"{precision}: asked for"
    if precision == "int8":
        return f"int8: {gate.summary()}"
    if gate is not None:
        return f"{precision}: the INT8 trunk's {gate.summary()}"
    if looked_up and kind == "cpu":
        return (f"{precision}: no INT8 trunk calibrated for this checkpoint "
                f"(`{registry.INT8_TRUNK.command}`)")
    if registry.INT8_TRUNK not in spec.artifacts:
        return f"{precision}: the fastest {spec.title} runs here (it runs no INT8 trunk)"
    return f"{precision}: the fastest {spec.title} runs here"


@dataclass(frozen=True)
class TrunkPlan:
    """A trunk resolved but not loaded (`Trunk.plan`): the choice and the runner's request.

    `Trunk.load(plan)` loads it; `packages` says what the load will import, so a start can
    import it beforehand (`import_packages`) and import no TensorFlow where none is needed.
    """

    choice: TrunkChoice
    request: LoadRequest

    @property
    def packages(self) -> tuple[str, ...]:
        """The heavy packages the load imports ("tensorflow", "openvino"):
        `registry.load_imports` (OpenVINO's imports OpenVINO to find its compiled model in the
        cache)."""
        return registry.load_imports(self.choice.runtime, self.request)

    @property
    def needs_tensorflow(self) -> bool:
        return "tensorflow" in self.packages

    @property
    def key(self) -> tuple:
        """What makes two plans load the same runner (a prefetched trunk is taken by an equal
        plan only): runtime, precision, INT8 trunk, checkpoint, device and load options."""
        request, artifact = self.request, self.choice.int8_artifact
        return (self.choice.runtime, request.precision, request.float_precision,
                getattr(artifact, "key", None), request.prefix, request.device,
                request.with_logits, request.intra_op_threads, request.inter_op_threads,
                None if request.cache_dir is None else os.fspath(request.cache_dir),
                request.gpu_memory_limit_mb)


# Trunks loading ahead of their `Trunk.load` (`prefetch`), by plan key.
_prefetch_lock = threading.Lock()
_prefetched: dict[tuple, concurrent.futures.Future] = {}


def prefetch(plan: TrunkPlan, *, warmup_batch_sizes: tuple[int, ...] = (1,)) -> bool:
    """Starts loading (and warming up) `plan`'s trunk in a background thread, for the first
    `Trunk.load` of an equal plan (`TrunkPlan.key`) to take: a process that knows its trunk
    before it is ready to ask for it (`serve`, while it imports its HTTP server: OpenVINO's
    import of a compiled model releases the GIL). A later `Trunk.load` of another plan closes
    it. Returns False if one for this plan is under way already."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    with _prefetch_lock:
        if plan.key in _prefetched:
            return False
        _prefetched[plan.key] = future

    def run() -> None:
        try:
            future.set_result(Trunk._load(plan, warmup_batch_sizes=warmup_batch_sizes,
                                          announce=False))
        except BaseException as exc:  # noqa: BLE001 - handed to the taker (who loads again)
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="multihead-trunk-prefetch").start()
    return True


def _log_choice(choice: TrunkChoice) -> None:
    """The precision and why (a warning when an INT8 trunk failing its gate is run)."""
    failing = choice.int8_artifact is not None and not choice.gate.passed
    log.log(logging.WARNING if failing else logging.INFO, "precision %s", choice.why)


def _close_when_done(future: concurrent.futures.Future) -> None:
    def close(done: concurrent.futures.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    future.add_done_callback(close)


def discard_prefetched() -> None:
    """Closes every prefetched trunk (once its load is over) that no `Trunk.load` took: the
    process will not load one (its bring-up failed before)."""
    with _prefetch_lock:
        futures = list(_prefetched.values())
        _prefetched.clear()
    for future in futures:
        _close_when_done(future)


def _take_prefetched(plan: TrunkPlan):
    """The trunk prefetched for `plan` (waiting for it), or None (none, or its load failed:
    logged, the caller loads); prefetches of other plans are closed once done."""
    with _prefetch_lock:
        future = _prefetched.pop(plan.key, None)
        others = list(_prefetched.values())
        _prefetched.clear()
    for other in others:
        _close_when_done(other)
    if future is None:
        return None
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - loaded again by the caller, which reports
        log.warning("the trunk's early load failed (%s): loading it again", exc)
        return None


def import_packages(packages, device: str | Device = "auto") -> float:
    """Imports `packages` (TensorFlow through `backbone.tfimport`, quiet where no GPU can be);
    returns the seconds it took. Thread-safe: a second caller waits for the first import."""
    import importlib

    from backbone.tfimport import import_tensorflow

    start = time.perf_counter()
    for package in packages:
        if package == "tensorflow":
            import_tensorflow(device)
        else:
            importlib.import_module(package)
    return time.perf_counter() - start


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

    # How `from_checkpoint` chose the runtime and precision, and why (None: built otherwise).
    choice: TrunkChoice | None = None

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
                        runtime: str = "tf",
                        int8_dir: str | os.PathLike | None = None,
                        heads: HeadsAgreement | None = None) -> Trunk:
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
          precision: "fp32", "bf16" (CPUs with avx512_bf16 or amx_bf16), "fp16" (GPU), "int8"
            (runtime openvino, from an INT8 trunk `multihead quantize` calibrated for this
            checkpoint in `int8_dir`; its float layers in bf16 where the CPU has it, else
            fp32) or "auto" (fp16 on a GPU; on the CPU int8 when OpenVINO runs it and a
            passing INT8 trunk exists, else bf16 where the CPU has it, else fp32); reported,
            resolved, as `trunk.precision`. Features are float32 whatever the precision.
          runtime: a registered runtime (`backbone.runners.registry`: "tf", "openvino" (CPU;
            compiled in-process from the same restored tf-slim graph), ...) or "auto" (the
            installed one of lowest rank that runs on the device: openvino on the CPU when
            installed, else tf); reported, resolved, as `trunk.runtime`.
          int8_dir: where the INT8 trunks of this checkpoint are; None: where `multihead
            quantize` writes them (and `serve` looks), graph_cache/ next to the checkpoint
            (`backbone.checkpoint.cache_dir_of`). With `graph_cache_dir` the compiled INT8
            trunk is cached there too.

        Raises:
          CheckpointError: the file is missing (names the path) or a variable is missing or
            mis-shaped (names the variable and both shapes).
          PrecisionUnsupported: the precision cannot run natively here (never emulated), or
            int8 on a runtime that does not run it ("tf") or with `with_logits`.
          Int8ArtifactMissing: precision "int8" and no INT8 trunk for this checkpoint (the
            message names `multihead quantize`).
          RuntimeUnavailable: a runtime without its package or on a device kind it does not
            run on ("openvino" on a GPU).
        """
        return cls.load(cls.plan(
            prefix, device=device, intra_op_threads=intra_op_threads,
            inter_op_threads=inter_op_threads, with_logits=with_logits,
            gpu_memory_limit_mb=gpu_memory_limit_mb, graph_cache_dir=graph_cache_dir,
            precision=precision, runtime=runtime, int8_dir=int8_dir, heads=heads),
            warmup_batch_sizes=warmup_batch_sizes)

    @classmethod
    def plan(cls, prefix: str, *, device: str | Device = "auto",
             intra_op_threads: int | None = None, inter_op_threads: int | None = None,
             with_logits: bool = False, gpu_memory_limit_mb: int | None = None,
             graph_cache_dir: str | os.PathLike | None = None, precision: str = "fp32",
             runtime: str = "tf", int8_dir: str | os.PathLike | None = None,
             heads: HeadsAgreement | None = None) -> TrunkPlan:
        """The first half of `from_checkpoint` (same arguments, same refusals): detects the
        device and resolves the runtime and precision (`choose`); loads nothing. A CPU-only
        start imports no TensorFlow here."""
        prefix = resolve_prefix(prefix)
        found = detect_device(device)
        choice = choose(prefix, device=found, precision=precision, runtime=runtime,
                        int8_dir=cache_dir_of(prefix) if int8_dir is None else int8_dir,
                        heads=heads)
        return TrunkPlan(choice, LoadRequest(
            prefix, found, choice.precision, with_logits=with_logits,
            intra_op_threads=intra_op_threads, inter_op_threads=inter_op_threads,
            cache_dir=graph_cache_dir, gpu_memory_limit_mb=gpu_memory_limit_mb,
            int8_artifact=choice.int8_artifact, float_precision=choice.float_precision))

    @classmethod
    def load(cls, plan: TrunkPlan, *, warmup_batch_sizes: tuple[int, ...] = (1,)) -> Trunk:
        """The second half of `from_checkpoint`: loads the planned runner (importing what it
        needs, `plan.packages`, unless imported already) and warms it up; or takes the trunk
        `prefetch` loaded for an equal plan (then warms it up at `warmup_batch_sizes` too)."""
        trunk = _take_prefetched(plan)
        if trunk is None:
            return cls._load(plan, warmup_batch_sizes=warmup_batch_sizes)
        trunk.choice = plan.choice  # equal runner; this plan's reasons (its heads judged)
        _log_choice(plan.choice)
        trunk.warm_up(warmup_batch_sizes)
        trunk._log_ready()
        return trunk

    @classmethod
    def _load(cls, plan: TrunkPlan, *, warmup_batch_sizes: tuple[int, ...],
              announce: bool = True) -> Trunk:
        choice, prefix = plan.choice, plan.request.prefix
        if announce:
            _log_choice(choice)
        runner = registry.runner_class(choice.runtime).load(plan.request)
        trunk = cls(runner, checkpoint_prefix=prefix)
        trunk.choice = choice
        trunk.warm_up(warmup_batch_sizes)
        if announce:
            trunk._log_ready()
        return trunk

    def _log_ready(self) -> None:
        """Logs what was loaded and how long each step took."""
        choice, prefix, trunk = self.choice, self.checkpoint_prefix, self
        t = trunk.timings
        log.info("trunk ready on %s (%s, %s) from %s: build %.1fs restore %.1fs compile %.1fs "
                 "warm-up %.1fs%s%s", trunk.device, choice.runtime, trunk.precision_label,
                 prefix, t.build_s, t.restore_s, t.compile_s, t.warmup_s,
                 " (compiled model from the cache)" if trunk.compiled_from_cache else "",
                 f"; calibrated on {trunk.calibration.description} at "
                 f"{trunk.calibration.date}" if trunk.calibration else "")

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
    def owns_cores(self) -> bool:
        """Whether the trunk's work runs on the host's CPU cores (not a GPU): then the server
        keeps image decoding off them while a batch runs (`service.core.cores`)."""
        return not self.runner.info.device.is_gpu

    @property
    def runtime(self) -> str:
        """Resolved runtime: "tf" | "openvino" | ... (a registered runtime)."""
        return self.runner.info.runtime

    @property
    def precision(self) -> str:
        """Resolved precision: "fp32" | "bf16" | "fp16" | "int8"."""
        return self.runner.info.precision

    @property
    def float_precision(self) -> str | None:
        """INT8: the precision of the layers left in float ("fp32" | "bf16"); else None."""
        return self.runner.info.float_precision

    @property
    def calibration(self) -> Calibration | None:
        """INT8: the calibration set (digest, image count, description, date); else None."""
        return self.runner.info.calibration

    @property
    def precision_label(self) -> str:
        """The precision for people: "int8 (float layers bf16)", "fp32", ..."""
        if self.float_precision:
            return f"{self.precision} (float layers {self.float_precision})"
        return self.precision

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


__all__ = ["HeadsAgreement", "Trunk", "TrunkChoice", "TrunkPlan", "TrunkTimings", "choose",
           "discard_prefetched", "import_packages", "prefetch", "warm_up",
           "FEATURE_DIM", "LOGITS_SCOPE"]
