"""The runner registry: each runner declares itself once, in its own module, and every list of
runtimes (the precision rules, `Trunk`'s choice, the bench's combinations, the demo, `--help`)
is read from here.

    @register(RunnerSpec(name="onnx", title="ONNX Runtime", packages=("onnxruntime",),
                         precisions={"fp32": ANYWHERE}, rank=20))
    class OnnxRunner(Runner): ...

A declaration is data (`RunnerSpec`): what the runner is called, whether its packages are
installed (looked up, never imported), the device kinds it runs on, the precisions it runs and
what each needs (`Needs`: a device kind, CPU flags, an artifact such as `INT8_TRUNK`), and its
rank for runtime "auto". The rules that read it are `backbone.precision`'s. Registration order
is the order of every list (the built-in runners register when `backbone.runners` is imported:
TensorFlow, then OpenVINO).

Importing this module imports no runtime (TensorFlow, OpenVINO, ...).
"""
from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from backbone.device import BF16_CPU_FLAGS
from backbone.runners.base import LoadRequest, Runner

DEVICE_KINDS = ("cpu", "gpu")  # `backbone.device.Device.kind`
# A device kind for people: "a CPU", "the GPU only".
KIND_NAMES = {"cpu": "CPU", "gpu": "GPU"}


@dataclass(frozen=True)
class Artifact:
    """Something a precision needs that is made beforehand for each checkpoint.

    Attributes:
      name: a short name ("int8 trunk").
      what: the artifact in a sentence, as a refusal says it is missing ("an INT8 trunk
        calibrated for this checkpoint").
      command: the command that makes one.
    """

    name: str
    what: str
    command: str


# The INT8 trunk of `multihead quantize` (`backbone.quantize.Int8Artifact`, in graph_cache/ next
# to the checkpoint: `backbone.checkpoint.cache_dir_of`); `backbone.trunk.choose` looks it up
# for every runner that declares it.
INT8_TRUNK = Artifact("int8 trunk", "an INT8 trunk calibrated for this checkpoint",
                      "multihead quantize --images DIR")


@dataclass(frozen=True)
class Needs:
    """What one precision needs on one runner; `Needs()` runs wherever the runner does.

    Attributes:
      device: the one device kind it runs on ("cpu" | "gpu"), or None.
      cpu_flags: the CPU must have one of these (native support, never emulated).
      artifact: an artifact made beforehand for the checkpoint (`INT8_TRUNK`), or None.
      reason: why, said when it is refused on another device kind ("TF's GPU mixed precision
        is fp16").
    """

    device: str | None = None
    cpu_flags: tuple[str, ...] = ()
    artifact: Artifact | None = None
    reason: str = ""

    def __post_init__(self):
        if self.device is not None and self.device not in DEVICE_KINDS:
            raise ValueError(f"device must be one of {', '.join(DEVICE_KINDS)} or None, "
                             f"got {self.device!r}")

    @property
    def conditional(self) -> bool:
        """Whether it needs more than a device kind (CPU flags or an artifact)."""
        return bool(self.cpu_flags or self.artifact)


ANYWHERE = Needs()  # fp32
NATIVE_BF16 = Needs(device="cpu", cpu_flags=BF16_CPU_FLAGS)  # bf16 on the CPU, never emulated
GPU_ONLY = Needs(device="gpu")


@dataclass(frozen=True)
class RunnerSpec:
    """What a runner declares about itself (see the module docstring).

    Attributes:
      name: the runtime's name (`--runtime`, `trunk.runtime`, "<runtime>-<precision>" in the
        bench).
      title: its name for people ("OpenVINO").
      precisions: precision -> what it needs there, in the order the runner prefers to list
        them.
      devices: the device kinds it runs on.
      packages: the import names it needs; it is available where all are importable.
      extra: the multihead extra that installs them ("openvino"), or "".
      rank: `auto` picks the available runner of lowest rank that runs on the device.
      engine: what runs the trunk, as a refusal names it ("OpenVINO's CPU plugin"); default:
        the title.
      summary: a few words for `--runtime`'s help, after its device kinds.
    """

    name: str
    title: str
    precisions: Mapping[str, Needs]
    devices: tuple[str, ...] = DEVICE_KINDS
    packages: tuple[str, ...] = ()
    extra: str = ""
    rank: int = 100
    engine: str = ""
    summary: str = ""
    artifacts: tuple[Artifact, ...] = field(init=False)

    def __post_init__(self):
        unknown = set(self.devices) - set(DEVICE_KINDS)
        if not self.devices or unknown:
            raise ValueError(f"runner {self.name!r}: devices must be some of "
                             f"{', '.join(DEVICE_KINDS)}, got {self.devices!r}")
        if not self.precisions:
            raise ValueError(f"runner {self.name!r} declares no precision")
        object.__setattr__(self, "precisions", MappingProxyType(dict(self.precisions)))
        object.__setattr__(self, "artifacts", tuple(dict.fromkeys(
            needs.artifact for needs in self.precisions.values() if needs.artifact)))

    def available(self) -> bool:
        """Whether every package it needs can be imported here (none is imported)."""
        return all(importlib.util.find_spec(package) is not None for package in self.packages)

    def runs_on(self, kind: str) -> bool:
        return kind in self.devices

    @property
    def install(self) -> str:
        """How to install what it needs."""
        if self.extra:
            return f"pip install 'multihead[{self.extra}]'"
        return f"pip install {' '.join(self.packages)}"

    @property
    def where(self) -> str:
        return self.engine or self.title


# name -> declaration / runner class, in registration order. Read through the views below.
_specs: dict[str, RunnerSpec] = {}
_runners: dict[str, type[Runner]] = {}
SPECS: Mapping[str, RunnerSpec] = MappingProxyType(_specs)
RUNNERS: Mapping[str, type[Runner]] = MappingProxyType(_runners)

R = TypeVar("R", bound=type[Runner])
# name -> the packages a load of that runtime imports, by request (`load_imports`).
_load_imports: dict[str, Callable[[LoadRequest], tuple[str, ...]]] = {}


def register(spec: RunnerSpec) -> Callable[[R], R]:
    """Class decorator: registers a `Runner` under `spec.name`.

    Raises:
      ValueError: the name is registered already, or is "auto".
    """
    def decorate(runner: R) -> R:
        add(spec, runner)
        return runner

    return decorate


def add(spec: RunnerSpec, runner: type[Runner]) -> None:
    """Registers `runner` under `spec.name` (what `register` does)."""
    if spec.name in _specs or spec.name == "auto":
        raise ValueError(f"runtime {spec.name!r} is registered already")
    if not (isinstance(runner, type) and issubclass(runner, Runner)):
        raise TypeError(f"runtime {spec.name!r}: {runner!r} is not a Runner")
    _specs[spec.name] = spec
    _runners[spec.name] = runner


def remove(name: str) -> None:
    """Unregisters a runtime (a test's fake runner; see `registered`)."""
    del _specs[name], _runners[name]
    _load_imports.pop(name, None)


def declare_load_imports(name: str,
                         packages: Callable[[LoadRequest], tuple[str, ...]]) -> None:
    """Declares what a registered runtime's load imports for a request (`load_imports`).

    NOTE: the built-in declarations are in `backbone.runners.imports`, not in the runners'
    modules: those modules' source keys the compiled-model cache and the INT8 trunks.
    """
    spec(name)
    _load_imports[name] = packages


def load_imports(name: str, request: LoadRequest) -> tuple[str, ...]:
    """The heavy packages ("tensorflow", "openvino") a load of runtime `name` for `request`
    will import, decided before loading it: a start imports them beforehand, beside other
    work, and only them (no TensorFlow for a compiled model in the cache). Default: the
    runtime's declared packages."""
    if name in _load_imports:
        return tuple(_load_imports[name](request))
    return spec(name).packages


@contextlib.contextmanager
def registered(spec: RunnerSpec, runner: type[Runner]) -> Iterator[RunnerSpec]:
    """Registers `runner` for the `with` block only (tests)."""
    add(spec, runner)
    try:
        yield spec
    finally:
        remove(spec.name)


def spec(name: str) -> RunnerSpec:
    """The declaration of a registered runtime.

    Raises:
      ValueError: no runner is registered under `name`.
    """
    try:
        return _specs[name]
    except KeyError:
        raise ValueError(f"no runner for runtime {name!r}: one of "
                         f"{', '.join(_specs)}") from None


def runner_class(name: str) -> type[Runner]:
    """The runner of a resolved runtime name ("tf", "openvino", ...)."""
    spec(name)
    return _runners[name]


def available() -> frozenset[str]:
    """The registered runtimes whose packages are installed here (none is imported)."""
    return frozenset(name for name, s in _specs.items() if s.available())


def ranked(specs: Mapping[str, RunnerSpec] | None = None) -> list[RunnerSpec]:
    """Declarations by rank (lowest first; ties in registration order): `auto`'s order."""
    specs = SPECS if specs is None else specs
    return sorted(specs.values(), key=lambda s: s.rank)  # NOTE: sorted() is stable


def precisions(specs: Mapping[str, RunnerSpec] | None = None) -> tuple[str, ...]:
    """Every precision some runner runs, in order of first declaration."""
    specs = SPECS if specs is None else specs
    return tuple(dict.fromkeys(p for s in specs.values() for p in s.precisions))


class Names(Sequence[str]):
    """A read-only sequence of names, computed anew at each use: a runner registered after it
    was made (a plugin, a test's fake) is in it. It serves as a settings field's `choices` and
    as argparse's (`in`, iteration)."""

    def __init__(self, names: Callable[[], tuple[str, ...]]):
        self._names = names

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, value) -> bool:
        return value in self._names()

    def __iter__(self):
        return iter(self._names())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # mutable content: not a key

    def __repr__(self) -> str:
        return repr(self._names())


__all__ = ["ANYWHERE", "Artifact", "DEVICE_KINDS", "GPU_ONLY", "INT8_TRUNK", "KIND_NAMES",
           "NATIVE_BF16", "Names", "Needs", "RUNNERS", "RunnerSpec", "SPECS", "add", "available",
           "declare_load_imports", "load_imports", "precisions", "ranked", "register",
           "registered", "remove", "runner_class", "spec"]
