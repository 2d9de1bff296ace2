"""The benchmark's report: the targets of `--check`, and the files bench.json, bench.md and
bench.png.

Everything here works on the results as bench.json holds them (JSON types only: `meta`,
`errors`, one entry per section), read back into each section's typed result; so it can be
tested on synthetic results without running anything. Each section renders its own Markdown
and states its own targets (`bench.sections`); this module puts them together. matplotlib is
optional (the `bench` extra): it is imported only to draw bench.png, and without it the JSON
and Markdown reports are still written.
"""
from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from bench.markdown import fmt, load_label, table
from bench.result import Result
from bench.sections import SECTIONS
from bench.sections.base import FAIL, PASS, SKIP, Target
from bench.sections.service import POLICY_NAMES
from bench.stats import get_path

__all__ = ["FAIL", "PASS", "SKIP", "Target", "evaluate_targets", "format_target_line",
           "render_markdown", "targets_failed", "typed_results", "write_reports"]


def typed_results(results: Mapping) -> dict[str, Result]:
    """The sections' typed results of a bench.json-shaped dict, by section name."""
    return {s.name: s.load(results[s.name]) for s in SECTIONS
            if isinstance(results.get(s.name), Mapping)}


def evaluate_targets(results: Mapping, sections: set[str] | None = None) -> list[Target]:
    """Every section's targets on a results dict, in section order, evaluated: SKIP when a
    section a target needs was not selected (`sections`, default: the run's own list), FAIL
    when it was selected but a number is missing (the section failed), else PASS/FAIL."""
    if sections is None:
        sections = set(get_path(results, "meta.sections", []) or [])
    typed = typed_results(results)
    return [target.evaluate(sections) for s in SECTIONS
            for target in s.targets(typed.get(s.name) or s.result_type(), typed)]


def targets_failed(targets: list[Target]) -> bool:
    return any(t.status == FAIL for t in targets)


def format_target_line(t: Target) -> str:
    measured = "not measured" if t.measured is None else f"{fmt(t.measured)} {t.unit}"
    limit = "—" if t.limit is None else f"{t.op} {fmt(t.limit)} {t.unit}"
    note = f"  ({t.note})" if t.note else ""
    return f"[{t.status}] {t.text}: {measured} (target {limit}){note}"


def render_markdown(results: Mapping, targets: list[Target] | None = None) -> str:
    """The Markdown report: a dated header with the machine, each section's tables, the
    errors, the targets."""
    meta = results.get("meta", {})
    machine = meta.get("machine", {})
    out: list[str] = [f"# multihead benchmark — {meta.get('date', '?')}", ""]
    simd = ", ".join(machine.get("cpu_simd") or []) or "no AVX"
    out.append(
        f"Machine: {machine.get('cpu_model', '?')}, {machine.get('cpu_cores', '?')} cores "
        f"({simd}), {fmt((machine.get('memory_bytes') or 0) / 2**30)} GiB RAM, "
        f"{machine.get('os', '?')}; TensorFlow {machine.get('tensorflow', '?')}, "
        f"Python {machine.get('python', '?')}, numpy {machine.get('numpy', '?')}; load average "
        f"at start {machine.get('load_average_at_start')}.")
    out.append(
        f"Run: `{meta.get('command', 'multihead bench')}` "
        f"({'quick' if meta.get('quick') else 'full'} mode), sections "
        f"{', '.join(meta.get('sections', []))}, "
        f"{fmt(meta.get('duration_s'))} s. Trunk: {meta.get('trunk_kind', '?')}.")
    out.append("")
    typed = typed_results(results)
    for section in SECTIONS:
        if section.name in typed and results.get(section.name):
            out.append(section.render(typed[section.name], typed))

    errors = results.get("errors") or {}
    if errors:
        out += ["## Errors", ""]
        for section_name, message in errors.items():
            out.append(f"- {section_name}: {message}")
        out += [""]

    if targets is not None:
        out += ["## Targets", ""]
        rows = [[t.text, "not measured" if t.measured is None else f"{fmt(t.measured)} {t.unit}",
                 "—" if t.limit is None else f"{t.op} {fmt(t.limit)} {t.unit}", t.status,
                 t.note] for t in targets]
        out += table(["target", "measured", "limit", "result", "notes"], rows)
        out += [""]
    return "\n".join(out)


# -- files --------------------------------------------------------------------------------

def _jsonable(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _jsonable(value.item())
    return value


def write_json(path: Path, results: Mapping, targets: list[Target] | None) -> None:
    data = dict(results)
    if targets is not None:
        data["targets"] = [asdict(t) for t in targets]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n", "utf-8")
    os.replace(tmp, path)


_said_no_matplotlib = False


def _import_matplotlib():
    """matplotlib, or None (saying so once per process) when it is not installed."""
    global _said_no_matplotlib
    try:
        import matplotlib
    except ImportError:
        if not _said_no_matplotlib:
            _said_no_matplotlib = True
            print("[bench] bench.png not drawn: matplotlib is not installed "
                  "(pip install 'multihead[bench]')", file=sys.stderr)
        return None
    return matplotlib


def plot_latency_throughput(path: Path, results: Mapping) -> bool:
    """Latency (p50, bar to p95) against throughput of every service load point, one line per
    batching policy, with the raw trunk's best rate, the raw trunk of the servers' runtime and
    the matmul ceiling as vertical lines.
    Returns False (and writes nothing) when there is nothing to plot or no matplotlib."""
    policies = get_path(results, "service.policies", {}) or {}
    if not any(p.get("points") for p in policies.values()):
        return False
    matplotlib = _import_matplotlib()
    if matplotlib is None:
        return False

    matplotlib.use("Agg")  # no display here; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    styles = {"mixed": ("tab:blue", "o"), "per_group": ("tab:orange", "s")}
    for policy, data in policies.items():
        points = [p for p in data.get("points", [])
                  if p.get("throughput_images_per_s") is not None and p.get("p50_ms") is not None]
        if not points:
            continue
        closed = sorted((p for p in points if p.get("mode") == "closed"),
                        key=lambda p: p["concurrency"])
        color, marker = styles.get(policy, ("tab:gray", "^"))
        xs = [p["throughput_images_per_s"] for p in closed]
        ys = [p["p50_ms"] for p in closed]
        ax.plot(xs, ys, marker=marker, color=color, label=f"{POLICY_NAMES.get(policy, policy)}, "
                "closed loop (p50, bar to p95)")
        for p in points:
            x, y = p["throughput_images_per_s"], p["p50_ms"]
            p95 = p.get("p95_ms") or y
            ax.errorbar([x], [y], yerr=[[0], [max(0.0, p95 - y)]], color=color, capsize=3,
                        marker=marker if p.get("mode") == "closed" else "D",
                        markerfacecolor="white" if p.get("mode") == "open" else color)
            ax.annotate(load_label(p), (x, y), textcoords="offset points",
                        xytext=(6, 4) if policy == "mixed" else (6, -10), fontsize=7,
                        color=color)
    best = get_path(results, "trunk.best_images_per_s")
    if best:
        ax.axvline(best, color="tab:green", linestyle="--", linewidth=1,
                   label=f"raw TF fp32 trunk best {best:.1f} images/s")
    raw = get_path(results, "service.raw_trunk") or {}
    if raw.get("images_per_s"):
        ax.axvline(raw["images_per_s"], color="tab:purple", linestyle="-.", linewidth=1,
                   label=f"raw {raw.get('name')} trunk (the servers' runtime) at batch "
                         f"{raw.get('batch_size')}: {raw['images_per_s']:.1f} images/s")
    ceiling = get_path(results, "trunk.ceiling_images_per_s")
    if ceiling:
        ax.axvline(ceiling, color="tab:red", linestyle=":", linewidth=1,
                   label=f"matmul ceiling {ceiling:.1f} images/s")
    ax.plot([], [], linestyle="none", marker="D", markerfacecolor="white", color="black",
            label="open hollow diamond: Poisson open loop")
    ax.set_xlabel("throughput (images/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        formatter = ScalarFormatter()
        formatter.set_scientific(False)
        axis_formatter(formatter)
    ax.set_xlim(left=0)
    machine = get_path(results, "meta.machine", {}) or {}
    ax.set_title(f"multihead service: latency vs throughput\n{get_path(results, 'meta.date', '')}"
                 f" — {machine.get('cpu_model', '')}, {machine.get('cpu_cores', '?')} cores, "
                 f"TF {machine.get('tensorflow', '?')}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_reports(out_dir: str | os.PathLike, results: Mapping,
                  targets: list[Target] | None) -> dict[str, Path]:
    """Writes bench.json, bench.md and (when there are service points and matplotlib is
    installed) bench.png into out_dir.

    Returns the paths written, by kind ("json", "md", "png").
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"json": out / "bench.json", "md": out / "bench.md"}
    write_json(written["json"], results, targets)
    written["md"].write_text(render_markdown(results, targets), "utf-8")
    png = out / "bench.png"
    if plot_latency_throughput(png, results):
        written["png"] = png
    return written

