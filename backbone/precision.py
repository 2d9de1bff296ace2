"""Which precision and which runtime the trunk runs in: pure resolution rules, no side effects.

Everything here is a function of its inputs (the `Device`, the runtimes installed here, the
resolved runtime, whether an INT8 trunk was calibrated for the checkpoint) and of what the
runners declare (`backbone.runners.registry`: devices, precisions and what each needs, rank),
so the rules are unit-tested with fake devices and fake runners; `Trunk.from_checkpoint` feeds
them what it found. No rule names a runtime: each reads the runners' declarations (the one
name here is `resolve_precision`'s default runtime, "tf", `Trunk.from_checkpoint`'s default).

Rules:
  - a runtime runs on the device kinds it declares, where its packages are installed. "auto"
    picks the available runner of lowest rank that runs on the device (OpenVINO on the CPU
    when installed, else TensorFlow).
  - a precision runs on a runtime that declares it, where what it declares it needs is there:
      - a device kind ("fp16": a GPU; TF's CPU fp16 path only emulates it, for testing. TF's
        "bf16": the CPU, TF has no bf16 auto mixed precision rewriter on a GPU);
      - CPU flags ("bf16": `avx512_bf16` or `amx_bf16` in /proc/cpuinfo). Without them it is
        refused, never emulated: OpenVINO silently falls back to f32 there (its compiled model
        reports INFERENCE_PRECISION_HINT f32), and TF's oneDNN rewriter would emulate bf16
        through slower conversions;
      - an artifact ("int8": an INT8 trunk calibrated for this checkpoint by `multihead
        quantize`, `backbone.quantize.Int8Artifact`); without one it is refused, naming the
        command. OpenVINO's CPU plugin runs INT8 on any x86 CPU with AVX2 (VNNI and AMX make
        it faster). The layers NNCF leaves in float run in `float_layers_precision`: bf16
        where the CPU has it, else fp32.
  - "auto": the first of `AUTO_ORDER` (fp16, int8, bf16, fp32: fastest first) that the
    runtime declares and whose needs are met, an INT8 trunk only if it passed its fidelity
    bounds: fp16 on a GPU; on the CPU int8 on OpenVINO with a passing INT8 trunk, else bf16
    where the CPU has it, else fp32.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from backbone.device import Device
from backbone.errors import Int8ArtifactMissing, PrecisionUnsupported, RuntimeUnavailable
from backbone.runners import registry
from backbone.runners.registry import KIND_NAMES, Names, Needs, RunnerSpec

# Live views of the registry: a runner registered later (a plugin, a test's fake) is in them.
RUNTIMES = Names(lambda: tuple(registry.SPECS))
PRECISIONS = Names(registry.precisions)
RUNTIME_CHOICES = Names(lambda: (*registry.SPECS, "auto"))  # `--runtime`
PRECISION_CHOICES = Names(lambda: (*registry.precisions(), "auto"))  # `--precision`
# What `auto` tries, fastest first; a precision not listed here runs only when asked for.
AUTO_ORDER = ("fp16", "int8", "bf16", "fp32")
# What is known of the artifacts calibrated for a checkpoint (`resolve_precision`'s input):
# none, only ones written with --force below a fidelity bound, or one that passed.
INT8_NONE, INT8_FAILING, INT8_PASSING = "none", "failing", "passing"

Specs = Mapping[str, RunnerSpec]


def resolve_precision(requested: str, *, device: Device, runtime: str = "tf",
                      int8: str = INT8_NONE, runners: Specs | None = None) -> str:
    """Turns "fp32" | "bf16" | "fp16" | "int8" | "auto" into the precision the trunk will run in.

    Args:
      requested: the user's choice (one of `PRECISION_CHOICES`).
      device: where the trunk runs (see `backbone.device.detect_device`).
      runtime: the resolved runtime (see `resolve_runtime`).
      int8: the INT8 trunks calibrated for this checkpoint: `INT8_NONE`, `INT8_FAILING` (only
        ones forced below a bound: "int8" takes them, "auto" does not) or `INT8_PASSING`.
      runners: the declarations to read (default: the registered runners).

    Raises:
      ValueError: an unknown name.
      PrecisionUnsupported: the precision cannot run natively on this device or runtime.
      Int8ArtifactMissing: "int8" and no INT8 trunk calibrated for this checkpoint.
    """
    runners = registry.SPECS if runners is None else runners
    names = (*registry.precisions(runners), "auto")
    requested = requested.lower()
    if requested not in names:
        raise ValueError(f"precision must be one of {', '.join(names)}, got {requested!r}")
    if runtime not in runners:
        raise ValueError(f"no runner for runtime {runtime!r}: one of {', '.join(runners)}")
    spec = runners[runtime]
    if requested == "auto":
        for precision in AUTO_ORDER:
            needs = spec.precisions.get(precision)
            if needs is not None and _refusal(precision, needs, device, runners,
                                              int8=int8, passing_only=True) is None:
                return precision
        raise PrecisionUnsupported(f"runtime {runtime!r} runs none of {', '.join(AUTO_ORDER)} "
                                   f"on {device}: ask for one of {', '.join(spec.precisions)}")
    if requested in spec.precisions:
        refusal = _refusal(requested, spec.precisions[requested], device, runners, int8=int8,
                           passing_only=False)
    else:
        refusal = _elsewhere(requested, spec, device, runners)
    if refusal is not None:
        raise refusal
    return requested


def _refusal(precision: str, needs: Needs, device: Device, runners: Specs, *, int8: str,
             passing_only: bool) -> PrecisionUnsupported | None:
    """Why `precision` cannot run on `device` with these needs (None: it can)."""
    if needs.device is not None and needs.device != device.kind:
        use = _suggest(precision, device, runners)
        if needs.reason:
            return PrecisionUnsupported(f"precision {precision!r} is not supported on {device} "
                                        f"({needs.reason}): use {use}")
        return PrecisionUnsupported(f"precision {precision!r} needs a "
                                    f"{KIND_NAMES[needs.device]}, the trunk runs on {device}: "
                                    f"use {use}")
    if needs.cpu_flags and not any(flag in device.cpu_flags for flag in needs.cpu_flags):
        which = {1: "none", 2: "neither"}.get(len(needs.cpu_flags), "none of them")
        return PrecisionUnsupported(f"precision {precision!r} needs a CPU with "
                                    f"{' or '.join(needs.cpu_flags)}, this CPU has {which}: "
                                    f"use 'fp32' or 'auto'")
    if needs.artifact is not None:
        found = (INT8_PASSING,) if passing_only else (INT8_PASSING, INT8_FAILING)
        if int8 not in found:
            return Int8ArtifactMissing(f"precision {precision!r} needs {needs.artifact.what} "
                                       f"and there is none: make one with "
                                       f"`{needs.artifact.command}`")
    return None


def _suggest(precision: str, device: Device, runners: Specs) -> str:
    """What to ask for instead of `precision` on `device`: the precisions some runner runs on
    this device kind only (with what else they need, fastest first), and 'fp32' where none
    of them is sure to run."""
    made_for: dict[str, Needs] = {}
    for spec in runners.values():
        for name, needs in spec.precisions.items():
            if needs.device == device.kind and name != precision:
                made_for.setdefault(name, needs)
    order = sorted(made_for, key=lambda name: (AUTO_ORDER.index(name) if name in AUTO_ORDER
                                               else len(AUTO_ORDER)))
    words = [f"{name!r}" + (f" (CPUs with {'/'.join(made_for[name].cpu_flags)})"
                            if made_for[name].cpu_flags else "") for name in order]
    if all(needs.conditional for needs in made_for.values()) and precision != "fp32":
        words.append("'fp32'")
    return " or ".join(words) or "'auto'"


def _elsewhere(precision: str, spec: RunnerSpec, device: Device,
               runners: Specs) -> PrecisionUnsupported:
    """The refusal of a precision that runtime `spec` does not run: the first reason the
    runtimes that run it cannot run it here, else their names."""
    others = [s for s in runners.values() if precision in s.precisions]
    on_this_kind = [s for s in others if s.runs_on(device.kind)]
    if not on_this_kind:  # only runtimes of another device kind run it
        kinds = sorted({kind for s in others for kind in s.devices})
        return PrecisionUnsupported(
            f"precision {precision!r} runs on {' or '.join(s.where for s in others)}, not on "
            f"{device}: use {_suggest(precision, device, runners)} or device "
            f"{' or '.join(repr(kind) for kind in kinds)}")
    here = [s for s in on_this_kind if s.precisions[precision].device in (None, device.kind)]
    if not here:  # the runtimes here run it on another device kind only
        return _refusal(precision, on_this_kind[0].precisions[precision], device, runners,
                        int8=INT8_PASSING, passing_only=False)
    extras = sorted({s.extra for s in here if s.extra})
    needs = f" (needs the {' or '.join(extras)} extra)" if extras else ""
    return PrecisionUnsupported(
        f"precision {precision!r} runs on {' or '.join(s.title for s in here)}, not on "
        f"runtime {spec.name!r}: use runtime {' or '.join(repr(s.name) for s in here)} or "
        f"'auto'{needs}")


def float_layers_precision(device: Device) -> str:
    """The float precision of a CPU trunk: bf16 where the CPU computes it natively, else fp32.

    It is `auto`'s float choice, and the precision of the layers an INT8 trunk keeps in float.
    """
    return "bf16" if device.bf16 else "fp32"


def resolve_runtime(requested: str, *, device: Device, available: Collection[str],
                    runners: Specs | None = None) -> str:
    """Turns "tf" | "openvino" | ... | "auto" into the runtime the trunk will run on.

    Args:
      requested: the user's choice (one of `RUNTIME_CHOICES`).
      device: where the trunk runs.
      available: the runtimes whose packages are installed here
        (`backbone.runners.registry.available()`).
      runners: the declarations to read (default: the registered runners).

    Raises:
      ValueError: an unknown name.
      RuntimeUnavailable: a runtime on a device kind it does not run on, or without its
        packages installed; "auto" where no installed runtime runs on the device.
    """
    runners = registry.SPECS if runners is None else runners
    names = (*runners, "auto")
    requested = requested.lower()
    if requested not in names:
        raise ValueError(f"runtime must be one of {', '.join(names)}, got {requested!r}")
    usable = [s.name for s in registry.ranked(runners)
              if s.runs_on(device.kind) and s.name in available]
    if requested == "auto":
        if not usable:
            raise RuntimeUnavailable(f"no installed runtime runs the trunk on {device}")
        return usable[0]
    spec = runners[requested]
    others = [name for name in runners if name in usable and name != requested]
    use = f"runtime {' or '.join(repr(name) for name in others)}" if others else ""
    if not spec.runs_on(device.kind):
        kinds = " or ".join(repr(kind) for kind in spec.devices)
        raise RuntimeUnavailable(
            f"runtime {requested!r} runs the trunk on the "
            f"{' or '.join(KIND_NAMES[kind] for kind in spec.devices)} only, not on {device}: "
            f"use {use + ' or ' if use else ''}device {kinds}")
    if requested not in available:
        raise RuntimeUnavailable(
            f"runtime {requested!r} needs the {' and '.join(spec.packages)} "
            f"package{'s' if len(spec.packages) > 1 else ''} ({spec.install})"
            + (f": use {use}" if use else ""))
    return requested


def combinations(*, device: Device, available: Collection[str], int8: str = INT8_NONE,
                 runners: Specs | None = None) -> list[tuple[str, str]]:
    """Every (runtime, precision) that runs on `device` here when asked for, in registration
    order of the runtimes and declaration order of their precisions (the bench measures them)."""
    runners = registry.SPECS if runners is None else runners
    out = []
    for name, spec in runners.items():
        try:
            resolve_runtime(name, device=device, available=available, runners=runners)
        except RuntimeUnavailable:
            continue
        for precision in spec.precisions:
            try:
                resolve_precision(precision, device=device, runtime=name, int8=int8,
                                  runners=runners)
            except PrecisionUnsupported:
                continue
            out.append((name, precision))
    return out


# -- help texts (`--runtime`, `--precision`), from the declarations --------------------------------

def runtime_help(runners: Specs | None = None) -> str:
    """`--runtime`'s help: each runtime with its device kinds and summary, and what auto picks."""
    runners = registry.SPECS if runners is None else runners
    parts = []
    for spec in runners.values():
        words = ", ".join(filter(None, [
            "/".join(KIND_NAMES[kind] for kind in spec.devices)
            if set(spec.devices) != set(KIND_NAMES) else "", spec.summary]))
        words += f"; needs the {spec.extra} extra" if spec.extra else ""
        parts.append(f"{spec.name} ({words})" if words else spec.name)
    auto = []
    for spec in registry.ranked(runners):
        conditions = ([f"on a {'/'.join(KIND_NAMES[kind] for kind in spec.devices)}"]
                      if set(spec.devices) != set(KIND_NAMES) else [])
        conditions += ["when installed"] if spec.extra else []
        if not conditions:  # it runs wherever auto runs: the last resort
            auto.append(f"else {spec.name}")
            break
        auto.append(f"{spec.name} {' '.join(conditions)}")
    return f"trunk runtime: {'; '.join(parts)}; auto = {', '.join(auto)}"


def precision_help(runners: Specs | None = None) -> str:
    """`--precision`'s help, naming the runtimes that run an INT8 trunk."""
    runners = registry.SPECS if runners is None else runners
    int8 = [s for s in runners.values() if registry.INT8_TRUNK in s.artifacts]
    names = " or ".join(s.name for s in int8) or "none installed"
    titles = " or ".join(s.title for s in int8) or "a runtime"
    return ("trunk precision: fp32; bf16 (CPUs with avx512_bf16 or AMX); fp16 (GPU); int8 "
            f"(runtime {names}, from the INT8 trunk `multihead quantize` calibrated for the "
            "checkpoint; its float layers in bf16 where the CPU has it, else fp32); auto = fp16 "
            f"on a GPU, int8 where {titles} runs and a passing INT8 trunk exists, else bf16 on a "
            "CPU that has it, else fp32. Refused where the hardware, the runtime or the INT8 "
            "trunk lacks it, never emulated; heads stay fp32")


__all__ = ["AUTO_ORDER", "INT8_FAILING", "INT8_NONE", "INT8_PASSING", "PRECISIONS",
           "PRECISION_CHOICES", "RUNTIMES", "RUNTIME_CHOICES", "combinations",
           "float_layers_precision", "precision_help", "resolve_precision", "resolve_runtime",
           "runtime_help"]
