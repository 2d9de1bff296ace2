"""Section `coldstart`: `multihead serve` process start to /readyz 200, with and without a
saved graph (`--graph-cache`), on a fresh store."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.context import Context
from bench.markdown import table
from bench.result import Result
from bench.sections.base import Results, Section, Target


@dataclass
class ColdstartResult(Result):
    # {label, healthz_s, ready_s, build_s, restore_s, server_ready_s, notes} per start
    starts: list[dict] = field(default_factory=list)
    restart_with_saved_graph_s: float | None = None
    target_note: str = ""
    note: str = ""


def coldstart_timings(server_timings: dict[str, float]) -> dict[str, float]:
    """What a cold start records of the server's own /readyz timings: `build_s`, `restore_s`
    and `server_ready_s` (the server's seconds from its start to ready), when it reported them."""
    out = {key: server_timings[key] for key in ("build_s", "restore_s") if key in server_timings}
    if "ready_s" in server_timings:
        out["server_ready_s"] = server_timings["ready_s"]
    return out


def run(context: Context) -> ColdstartResult:
    store = context.tmp / "coldstart-store"
    store.mkdir(parents=True, exist_ok=True)
    result = ColdstartResult()

    def start(label: str, notes: str = "", **options) -> dict:
        # INFO: the server log then shows its start-up steps, for whoever reads it.
        server = context.server(f"coldstart-{len(result.starts)}", store, log_level="INFO",
                                **options)
        context.start(server)
        server.stop()
        entry = {"label": label, "healthz_s": server.healthz_s, "ready_s": server.ready_s,
                 **coldstart_timings(server.server_timings())}
        if "build_s" in entry:
            notes = (notes + "; " if notes else "") + (
                f"graph {entry['build_s']:.1f} s, restore {entry['restore_s']:.1f} s")
        entry["notes"] = notes
        result.starts.append(entry)
        return entry

    # `multihead serve --graph-cache`: the graph is kept in <store>/trunk/graph_cache.
    if not context.plan.quick:  # quick: the first start below builds the graph from code too
        start("plain start, no saved graph", "graph built from code, warm-up on",
              **{"graph-cache": False})
    start("first start with the graph cache (graph built from code, then saved)",
          "warm-up on", **{"graph-cache": True})
    restart = start("restart with the saved graph", "default flags, warm-up on",
                    **{"graph-cache": True})
    start("restart with the saved graph, --no-warmup (reference)", "ready before warm-up",
          warmup=False, **{"graph-cache": True})
    result.restart_with_saved_graph_s = restart["ready_s"]
    result.target_note = (
        f"default flags, warm-up on; graph {restart.get('build_s', math.nan):.1f} s, restore "
        f"{restart.get('restore_s', math.nan):.1f} s; with --no-warmup ready in "
        f"{result.starts[-1]['ready_s']:.1f} s")
    result.note = (
        "Saved graph: `--graph-cache` (the default). The target is the default restart "
        "(warm-up on: the server runs the trunk once before /readyz says ready: at batch 1 "
        "on a CPU, at every power-of-two batch size up to the max on a GPU). Times run from "
        "spawning the process, Python and TensorFlow imports included.")
    return result


def render(cold: ColdstartResult, results: Results) -> str:
    out = ["## Cold start (`multihead serve` process start to /readyz 200)", ""]
    rows = [[s["label"], s.get("healthz_s"), s.get("ready_s"), s.get("notes", "")]
            for s in cold.starts]
    out += table(["start", "/healthz 200 s", "/readyz 200 s", "notes"], rows)
    if cold.note:
        out += ["", cold.note]
    out += [""]
    return "\n".join(out)


def targets(cold: ColdstartResult, results: Results) -> list[Target]:
    return [Target.of("restart_saved_graph", "restart with a saved graph to /readyz 200 <= 5 s",
                      ("coldstart",), cold.restart_with_saved_graph_s, 5.0, "<=", "s",
                      cold.target_note or cold.note or "")]


SECTION = Section("coldstart", ColdstartResult, run, render, targets)
