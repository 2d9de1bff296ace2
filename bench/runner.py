"""The benchmark run: the shared-trunk design against the naive ones, measured in ONE run.

`run` prepares what every section shares (a `Context`: the trunk checkpoint, the run's JPEGs,
a temp dir), then runs the selected sections (`bench.sections`, in registry order); a failing
section is recorded and the run goes on. It returns the results as bench.json holds them
(`meta`, `errors`, then one entry per section) and rewrites the reports after each section.

Everything is real: the real Inception-V4 trunk (a seeded random checkpoint in the official
layout unless a checkpoint is given; random weights cost exactly what the real ones do), real
server processes, real HTTP, real JPEG decoding. The flags and the command are in `bench.cli`.
"""
from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.context import Context, say
from bench.plan import Plan
from bench.report import write_reports
from bench.sections import SECTIONS
from bench.stats import machine_facts


def tf_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("tensorflow")
    except metadata.PackageNotFoundError:
        return None


def trunk_checkpoint(context: Context, given: str | None) -> tuple[str, str]:
    """(prefix, description) of the run's trunk: the given checkpoint, else a seeded random
    one in the official layout, written to the run's temp dir."""
    if given:
        from backbone.checkpoint import resolve_prefix

        prefix = resolve_prefix(given)
        return prefix, f"given checkpoint {prefix}"
    from backbone.checkpoint import DEMO_CHECKPOINT, write_random_checkpoint

    say("writing a seeded random trunk checkpoint (official layout) ...")
    seed = context.plan.seed
    prefix = write_random_checkpoint(str(context.tmp / "trunk" / DEMO_CHECKPOINT), seed=seed)
    return prefix, (f"seeded random weights (seed {seed}) in the official layout; the same "
                    "graph and cost as the official checkpoint")


def results_json(context: Context, meta: dict[str, Any]) -> dict[str, Any]:
    """The run's results as bench.json holds them (without the targets)."""
    return {"meta": meta, "errors": context.errors,
            **{name: result.to_json() for name, result in context.results.items()}}


def run(plan: Plan, out_dir: str | os.PathLike, *, trunk_checkpoint_prefix: str | None = None,
        command: str = "multihead bench") -> dict[str, Any]:
    """Runs the selected sections in order; returns the results (see the module doc)."""
    from bench.load import make_jpegs, stop_all_servers

    started = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    context = Context(plan, out, Path(tempfile.mkdtemp(prefix="multihead-bench-")))
    meta: dict[str, Any] = dict(
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), command=command,
        quick=plan.quick, sections=[s.name for s in SECTIONS if s.name in plan.sections],
        machine=machine_facts(tf_version()), plan=plan.to_json())
    try:
        context.jpegs = make_jpegs(plan.images)
        meta["image_bytes_mean"] = sum(len(j) for j in context.jpegs) / len(context.jpegs)
        context.prefix, meta["trunk_kind"] = trunk_checkpoint(context, trunk_checkpoint_prefix)
        for section in SECTIONS:
            if section.name not in plan.sections:
                continue
            say(f"section {section.name} ...")
            t0 = time.monotonic()
            try:
                context.results[section.name] = section.run(context)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001 - record, and measure the rest
                context.record_error(section.name, exc)
            finally:
                stop_all_servers()
                gc.collect()
            say(f"section {section.name} done in {time.monotonic() - t0:.0f} s")
            meta["duration_s"] = time.monotonic() - started
            write_reports(out, results_json(context, meta), None)  # partial results so far
    finally:
        stop_all_servers()
        shutil.rmtree(context.tmp, ignore_errors=True)
    meta["duration_s"] = time.monotonic() - started
    meta["server_starts"] = context.server_starts
    return results_json(context, meta)
