"""No usage data leaves a multihead process.

OpenVINO's model converter (`openvino.convert_model`, imported with `openvino`) and NNCF send
usage statistics to Google Analytics unless the user opted out (`opt_in_out --opt_out`, a file
in the home directory) or the process runs in CI. They send from a process forked by
`multiprocessing`. Forked from a server that runs many threads, that child can deadlock in the
dynamic loader and outlive the server, holding its listening sockets and its log: seen, a
`multihead serve` child stuck resolving www.google-analytics.com an hour after the benchmark
had stopped its parent (the first start of a trunk, whose graph is converted then).

Both libraries fall back to sending nothing when `openvino_telemetry` cannot be imported;
`off()` makes it so for this process. Call it before `openvino` or `nncf` is imported.
"""
from __future__ import annotations

import sys

MODULE = "openvino_telemetry"


def off() -> None:
    """Makes `import openvino_telemetry` fail in this process (the libraries' own fallback:
    no telemetry). Idempotent; a module already imported is replaced too, so that a library
    imported later falls back as well."""
    sys.modules[MODULE] = None  # type: ignore[assignment]
