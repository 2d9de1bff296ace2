"""The trunk's runners, one per runtime, behind one interface (`backbone.runners.base.Runner`).

Each runner registers itself in its own module (`backbone.runners.registry.register`), declaring
its devices, precisions, artifacts and rank; `Trunk.from_checkpoint` resolves the runtime by
those declarations (`backbone.precision.resolve_runtime`) and loads the runner it names
(`runner_class`). Importing this package (or any module of it) registers the built-in runners:
TensorFlow, then OpenVINO, which builds on it and imports it first; registration order is the
order of every list (`--runtime`'s choices, the bench's combinations). It imports neither
TensorFlow nor OpenVINO.
"""
from __future__ import annotations

# What each built-in runner's load imports (declared there, not in the runners' own modules).
from backbone.runners import imports as _imports  # noqa: F401
from backbone.runners.base import (
    Calibration,
    Layout,
    LoadReport,
    LoadRequest,
    Runner,
    RunnerInfo,
)
from backbone.runners.openvino import OpenVinoRunner
from backbone.runners.registry import RUNNERS, RunnerSpec, register, runner_class
from backbone.runners.tf import TfRunner

__all__ = ["RUNNERS", "Calibration", "Layout", "LoadReport", "LoadRequest", "OpenVinoRunner",
           "Runner", "RunnerInfo", "RunnerSpec", "TfRunner", "register", "runner_class"]
