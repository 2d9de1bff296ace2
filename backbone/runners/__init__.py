"""The trunk's runners, one per runtime, behind one interface (`backbone.runners.base.Runner`).

`runner_class(runtime)` is the one place a runtime name becomes code; `Trunk.from_checkpoint`
resolves the runtime (`backbone.precision.resolve_runtime`) and loads the runner it names.
Importing this package imports neither TensorFlow nor OpenVINO.
"""
from __future__ import annotations

from backbone.runners.base import (
    Calibration,
    Layout,
    LoadReport,
    LoadRequest,
    Runner,
    RunnerInfo,
)
from backbone.runners.openvino import OpenVinoRunner
from backbone.runners.tf import TfRunner

# Resolved runtime name -> its runner; keys are `backbone.precision.RUNTIMES`.
RUNNERS: dict[str, type[Runner]] = {"tf": TfRunner, "openvino": OpenVinoRunner}


def runner_class(runtime: str) -> type[Runner]:
    """The runner of a resolved runtime name ("tf", "openvino")."""
    try:
        return RUNNERS[runtime]
    except KeyError:
        raise ValueError(f"no runner for runtime {runtime!r}: one of "
                         f"{', '.join(RUNNERS)}") from None


__all__ = ["RUNNERS", "Calibration", "Layout", "LoadReport", "LoadRequest", "OpenVinoRunner",
           "Runner", "RunnerInfo", "TfRunner", "runner_class"]
