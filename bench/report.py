"""The benchmark's targets (`--check`) and its report files: bench.json, bench.md, bench.png.

Everything here works on the plain results dict that `bench.runner` fills in (JSON types
only), so it can be tested on synthetic results without running anything. matplotlib is
optional (the `bench` extra): it is imported only to draw bench.png, and without it the JSON
and Markdown reports are still written.
"""
from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.stats import get_path, ratio

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class Target:
    """One target of issue 6, as evaluated on a run."""

    key: str
    text: str  # what is compared, in words
    section: str  # the section that measures it (SKIP when not selected)
    measured: float | None
    limit: float | None
    op: str  # "<=" or ">="
    unit: str
    status: str  # PASS / FAIL / SKIP
    note: str = ""


def _num(value) -> float:
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _note(template: str, *values: float) -> str:
    """`template` formatted with the values, or "" when one of them is missing (NaN)."""
    if any(math.isnan(_num(v)) for v in values):
        return ""
    return template.format(*values)


def _status(measured: float, limit: float, op: str, selected: bool) -> str:
    if not selected:
        return SKIP
    if math.isnan(measured) or math.isnan(limit):
        return FAIL  # selected but not measured (an error or a missing prerequisite)
    return PASS if (measured <= limit if op == "<=" else measured >= limit) else FAIL


def _c16_point(results: Mapping, policy: str) -> Mapping | None:
    for point in get_path(results, f"service.policies.{policy}.points", []) or []:
        if point.get("mode") == "closed" and point.get("concurrency") == 16:
            return point
    return None


def _c1_point(results: Mapping) -> Mapping | None:
    for point in get_path(results, "service.policies.mixed.points", []) or []:
        if point.get("mode") == "closed" and point.get("concurrency") == 1:
            return point
    return None


def _target(key, text, needs, measured, limit, op, unit, sections, note="") -> Target:
    selected = all(s in sections for s in needs)
    m, lim = _num(measured), _num(limit)
    return Target(key, text, "+".join(needs), None if math.isnan(m) else m,
                  None if math.isnan(lim) else lim, op, unit, _status(m, lim, op, selected), note)


def evaluate_targets(results: Mapping, sections: set[str] | None = None) -> list[Target]:
    """Evaluates every target of issue 6 on a results dict.

    A target is SKIP when one of the sections it needs was not selected, FAIL when it was
    selected but a number is missing (the section failed), else PASS/FAIL on the numbers.
    """
    if sections is None:
        sections = set(get_path(results, "meta.sections", []) or [])
    targets: list[Target] = []

    def add(key, text, needs, measured, limit, op, unit, note=""):
        targets.append(_target(key, text, needs, measured, limit, op, unit, sections, note))

    trunk_best = _num(get_path(results, "trunk.best_images_per_s"))
    trunk_b1_ms = _num(get_path(results, "trunk.batch1_forward_ms"))
    c16 = _c16_point(results, "mixed") or {}
    c16_pg = _c16_point(results, "per_group") or {}
    c1 = _c1_point(results) or {}

    add("service_throughput_c16", "service images/s at 16 clients >= 0.90 x raw trunk best",
        ["service", "trunk"], c16.get("throughput_images_per_s"), 0.90 * trunk_best, ">=",
        "images/s", _note("raw trunk best {:.2f} images/s", trunk_best))
    add("service_p50_c1", "service p50 at 1 client <= raw batch-1 forward + 25 ms",
        ["service", "trunk"], c1.get("p50_ms"), trunk_b1_ms + 25.0, "<=", "ms",
        _note("raw batch-1 forward {:.1f} ms", trunk_b1_ms))
    rebuild_ms = _num(get_path(results, "baselines.rebuild.latency.p50_ms"))
    add("rebuild_vs_service", "rebuild-per-request latency >= 20 x service p50 at 1 client",
        ["baselines", "service"], ratio(rebuild_ms, _num(c1.get("p50_ms"))), 20.0, ">=", "x",
        _note("rebuild p50 {:.0f} ms", rebuild_ms))
    weight_bytes = _num(get_path(results, "scale.weight_bytes_per_bot"))
    growth = _num(get_path(results, "scale.rss_growth_per_bot_bytes"))
    add("rss_per_bot", "server RSS growth per bot <= 1.5 x its weight bytes", ["scale"],
        ratio(growth, weight_bytes), 1.5, "<=", "x",
        _note("{:.0f} kB per bot vs {:.0f} kB of weights", growth / 1e3, weight_bytes / 1e3))
    add("registration_p50", "registration p50 <= 20 ms", ["scale"],
        get_path(results, "scale.registration_p50_ms"), 20.0, "<=", "ms")
    warm = _num(get_path(results, "scale.warm.p50_ms"))
    add("cold_bot", "cold-bot first request <= warm + 20 ms", ["scale"],
        get_path(results, "scale.cold.p50_ms"), warm + 20.0, "<=", "ms",
        _note("warm p50 {:.1f} ms", warm))
    single = _num(get_path(results, "fanout.single.p50_ms"))
    add("fanout", "10-bot fan-out <= 1.2 x single-bot latency (p50)", ["fanout"],
        ratio(_num(get_path(results, "fanout.fanout.p50_ms")), single), 1.2, "<=", "x",
        _note("single-bot p50 {:.1f} ms", single))
    mixed_batch = _num(c16.get("mean_batch_size"))
    pg_batch = _num(c16_pg.get("mean_batch_size"))
    add("batch_mixing", "mean batch at 16 clients, 100 Zipf bots >= 3 x per-bot policy's",
        ["service"], ratio(mixed_batch, pg_batch), 3.0, ">=", "x",
        _note("mixed {:.2f} vs per-bot {:.2f} rows/batch", mixed_batch, pg_batch))
    restart = get_path(results, "coldstart.restart_with_saved_graph_s")
    note = (get_path(results, "coldstart.target_note")
            or get_path(results, "coldstart.note", "") or "")
    add("restart_saved_graph", "restart with a saved graph to /readyz 200 <= 5 s", ["coldstart"],
        restart, 5.0, "<=", "s", note)
    # Trunk speed by runtime and precision: the bf16 targets need a CPU with bf16.
    bf16 = bool(get_path(results, "trunk.bf16_cpu"))
    runtimes = get_path(results, "trunk.runtimes") or {}
    fp32 = runtimes.get("tf-fp32") or {}
    speed_sections = sections | ({"bf16-cpu"} if bf16 else set())
    no_bf16 = "" if bf16 else "this CPU has no avx512_bf16/amx_bf16"
    for size in (1, 8):
        key = f"images_per_s_b{size}"
        best = max((_num(r.get(key)) for r in runtimes.values() if r.get(key)), default=math.nan)
        targets.append(_target(
            f"best_trunk_b{size}", f"best runtime x precision >= 1.8 x TF fp32 at batch {size}",
            ["trunk", "bf16-cpu"], ratio(best, _num(fp32.get(key))), 1.8, ">=", "x",
            speed_sections, no_bf16))
    targets.append(_target(
        "tf_bf16_b8", "TF bf16 >= 1.5 x TF fp32 at batch 8", ["trunk", "bf16-cpu"],
        ratio(_num((runtimes.get("tf-bf16") or {}).get("images_per_s_b8")),
              _num(fp32.get("images_per_s_b8"))), 1.5, ">=", "x", speed_sections, no_bf16))
    start = _num(get_path(results, "overload.rss_start_bytes"))
    budget = _num(get_path(results, "overload.budget_bytes"))
    add("overload_peak", "RSS peak under N x 10 MB uploads <= start + 1.25 x in-flight budget",
        ["overload"], get_path(results, "overload.rss_peak_bytes"), start + 1.25 * budget, "<=",
        "bytes", _note("start {:.0f} MB, budget {:.0f} MB", start / 1e6, budget / 1e6))
    add("overload_after", "RSS after the uploads <= 1.10 x start", ["overload"],
        ratio(_num(get_path(results, "overload.rss_after_bytes")), start), 1.10, "<=", "x")
    add("overload_wrong", "wrong answers under overload == 0", ["overload"],
        get_path(results, "overload.wrong_answers"), 0, "<=", "")
    soak_start = _num(get_path(results, "soak.rss_first_half_mean_bytes"))
    add("soak_flat", "soak: RSS mean of the 2nd half <= 1.10 x the 1st half's", ["soak"],
        ratio(_num(get_path(results, "soak.rss_second_half_mean_bytes")), soak_start), 1.10,
        "<=", "x")
    return targets


def targets_failed(targets: list[Target]) -> bool:
    return any(t.status == FAIL for t in targets)


def format_target_line(t: Target) -> str:
    measured = "not measured" if t.measured is None else f"{_fmt(t.measured)} {t.unit}"
    limit = "—" if t.limit is None else f"{t.op} {_fmt(t.limit)} {t.unit}"
    note = f"  ({t.note})" if t.note else ""
    return f"[{t.status}] {t.text}: {measured} (target {limit}){note}"


# -- formatting ---------------------------------------------------------------------------

def _fmt(value, digits: int = 3) -> str:
    """Numbers for tables: 3 significant digits, thousands kept whole; NaN/None -> em dash."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    v = float(value)
    if math.isnan(v):
        return "—"
    if math.isinf(v):
        return "∞"
    if v != 0 and abs(v) >= 10 ** digits:
        return f"{v:,.0f}"
    if v == int(v) and abs(v) < 10 ** digits:
        return str(int(v))
    return f"{v:.{digits}g}"


def _mb(value) -> str:
    v = _num(value)
    return "—" if math.isnan(v) else f"{v / 1e6:.1f} MB"


def _kb(value) -> str:
    v = _num(value)
    return "—" if math.isnan(v) else f"{v / 1e3:.0f} kB"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in row)
                     + " |")
    return lines


def _load_label(point: Mapping) -> str:
    if point.get("mode") == "open":
        return f"Poisson {_fmt(point.get('rate_per_s'))}/s"
    return f"{point.get('concurrency')} client{'s' if point.get('concurrency') != 1 else ''}"


POLICY_NAMES = {"mixed": "mixed (cross-bot)", "per_group": "per-bot"}


def render_markdown(results: Mapping, targets: list[Target] | None = None) -> str:
    """The Markdown report: a dated header with the machine, one table per section, targets."""
    meta = results.get("meta", {})
    machine = meta.get("machine", {})
    out: list[str] = [f"# multihead benchmark — {meta.get('date', '?')}", ""]
    simd = ", ".join(machine.get("cpu_simd") or []) or "no AVX"
    out.append(
        f"Machine: {machine.get('cpu_model', '?')}, {machine.get('cpu_cores', '?')} cores "
        f"({simd}), {_fmt((machine.get('memory_bytes') or 0) / 2**30)} GiB RAM, "
        f"{machine.get('os', '?')}; TensorFlow {machine.get('tensorflow', '?')}, "
        f"Python {machine.get('python', '?')}, numpy {machine.get('numpy', '?')}; load average "
        f"at start {machine.get('load_average_at_start')}.")
    out.append(
        f"Run: `{meta.get('command', 'multihead bench')}` "
        f"({'quick' if meta.get('quick') else 'full'} mode), sections "
        f"{', '.join(meta.get('sections', []))}, "
        f"{_fmt(meta.get('duration_s'))} s. Trunk: {meta.get('trunk_kind', '?')}.")
    out.append("")

    trunk = results.get("trunk")
    if trunk:
        out += ["## Raw trunk (in process, preprocessed 640×480 JPEGs)", ""]
        rows = [[b["batch_size"], b["images_per_s"], b["median_s"] * 1000, b["runs"]]
                for b in trunk.get("batches", [])]
        out += _table(["batch", "images/s", "ms per batch (median)", "timed runs"], rows)
        mm = trunk.get("matmul", {})
        out += ["", f"Float32 matmul through TensorFlow ({mm.get('n')}×{mm.get('n')}, best of "
                f"{mm.get('runs')}): {_fmt(mm.get('gflops_best'))} GFLOP/s (median "
                f"{_fmt(mm.get('gflops_median'))}). Inception-V4 costs "
                f"{_fmt(trunk.get('flops_per_image', 0) / 1e9)} GFLOP per image (contract), so "
                f"the ceiling is {_fmt(trunk.get('ceiling_images_per_s'))} images/s; the best "
                f"trunk rate {_fmt(trunk.get('best_images_per_s'))} images/s (batch "
                f"{trunk.get('best_batch_size')}) is {_fmt(trunk.get('efficiency_pct'))} % of it. "
                f"Graph build {_fmt(trunk.get('build_s'))} s, restore "
                f"{_fmt(trunk.get('restore_s'))} s. RSS of the benchmark process once the trunk "
                f"is loaded and has run once: "
                f"{_fmt((trunk.get('rss_after_load_bytes') or 0) / 1e6)} MB (TensorFlow runtime "
                f"included).", ""]
        runtimes = trunk.get("runtimes") or {}
        if len(runtimes) > 1 or not trunk.get("bf16_cpu", True):
            sizes = [b["batch_size"] for b in trunk.get("batches", [])]
            out += [f"By runtime and precision (images/s; min cosine of the features against "
                    f"TF fp32; this CPU {'has' if trunk.get('bf16_cpu') else 'has no'} "
                    f"avx512_bf16/amx_bf16, so bf16 "
                    f"{'runs' if trunk.get('bf16_cpu') else 'is refused and not measured'}):",
                    ""]
            rows = []
            for name, r in runtimes.items():
                rates = {b["batch_size"]: b["images_per_s"] for b in r.get("batches", [])}
                rows.append([name, *[rates.get(size) for size in sizes], r.get("min_cosine"),
                             r.get("error", "")])
            out += _table(["runtime-precision", *[f"batch {s}" for s in sizes], "min cosine",
                           "error"], rows)
            out += [""]

    service = results.get("service")
    if service:
        out += [f"## Service over HTTP ({service.get('bots')} bots, Zipf s="
                f"{_fmt(service.get('zipf_s'))}, {service.get('image')}, feature cache off)", ""]
        rows = []
        for policy, data in service.get("policies", {}).items():
            for p in data.get("points", []):
                rows.append([POLICY_NAMES.get(policy, policy), _load_label(p), p.get("requests"),
                             p.get("throughput_images_per_s"), p.get("ratio_to_trunk"),
                             p.get("p50_ms"), p.get("p95_ms"), p.get("p99_ms"),
                             p.get("mean_batch_size"), p.get("mean_batch_bots"),
                             p.get("errors")])
        out += _table(["policy", "load", "requests", "images/s", "× trunk best", "p50 ms",
                       "p95 ms", "p99 ms", "mean batch", "bots/batch", "errors"], rows)
        parts = [("request", "request (server)"), ("decode", "decode per image"),
                 ("queue_wait", "queue wait per image"), ("trunk_per_batch", "trunk per batch"),
                 ("heads_per_batch", "heads per batch")]
        rows = []
        for policy, data in service.get("policies", {}).items():
            for p in data.get("points", []):
                server_ms = p.get("server_ms") or {}
                if server_ms:
                    rows.append([POLICY_NAMES.get(policy, policy), _load_label(p), p.get("p50_ms"),
                                 p.get("mean_ms")] + [server_ms.get(k) for k, _ in parts])
        if rows:
            out += ["", "Where the time goes: client-side latency against the server's own "
                    "histograms (means over the load point, ms):", ""]
            out += _table(["policy", "load", "client p50", "client mean"]
                          + [label for _, label in parts], rows)
        dist_rows, keys = [], []
        for policy, data in service.get("policies", {}).items():
            for p in data.get("points", []):
                if p.get("mode") == "closed" and p.get("concurrency") == 16:
                    dist = p.get("batch_size_distribution", {})
                    keys = keys or [k for k in dist if k != "all"]
                    dist_rows.append([POLICY_NAMES.get(policy, policy)] +
                                     [dist.get(k, 0) for k in keys])
        if dist_rows:
            out += ["", "Batches by size at 16 clients (from the server's "
                    "`multihead_batch_size` histogram):", ""]
            out += _table(["policy"] + [f"{k} rows" for k in keys], dist_rows)
        starts = [f"{POLICY_NAMES.get(k, k)} {_fmt(v.get('server', {}).get('ready_s'))} s"
                  for k, v in service.get("policies", {}).items()]
        out += ["", "Server start to ready: " + ", ".join(starts) + " (the servers of a run "
                "share one saved trunk graph, so only the first builds it; cold starts are "
                "measured on their own below).", ""]

    fan = results.get("fanout")
    if fan:
        out += ["## Fan-out (one distinct image per request, trunk included)", ""]
        out += _table(["bots per request", "requests", "p50 ms", "p95 ms", "mean ms"],
                      [[1, fan["single"]["n"], fan["single"]["p50_ms"], fan["single"]["p95_ms"],
                        fan["single"]["mean_ms"]],
                       [fan.get("n_bots"), fan["fanout"]["n"], fan["fanout"]["p50_ms"],
                        fan["fanout"]["p95_ms"], fan["fanout"]["mean_ms"]]])
        out += ["", f"Ratio {_fmt(fan.get('ratio_p50'))} (p50).", ""]

    base = results.get("baselines")
    if base:
        out += ["## Baselines: the naive designs on the same machine and images", ""]
        rows = []
        c1 = _c1_point(results)
        c16 = _c16_point(results, "mixed")
        if c1 or c16:
            per_bot = get_path(results, "scale.rss_growth_per_bot_bytes")
            rows.append(["shared trunk service (this project)",
                         (c1 or {}).get("p50_ms"), (c16 or {}).get("throughput_images_per_s"),
                         _kb(per_bot) if per_bot is not None else "one head (see Bot scale)",
                         "p50 at 1 client; images/s at 16 clients; RSS per resident head"])
        rb = base.get("rebuild")
        if rb:
            rows.append(["rebuild graph + restore per request", rb["latency"]["p50_ms"],
                         rb.get("throughput_images_per_s"), "—",
                         f"{rb['latency']['n']} requests; build {_fmt(rb.get('build_s_median'))}"
                         f" s, restore {_fmt(rb.get('restore_s_median'))} s each"])
        fm = base.get("full_models")
        if fm:
            rows.append([f"K={fm.get('k')} full models, routed per bot",
                         fm["latency"]["p50_ms"], fm.get("throughput_images_per_s"),
                         _mb(fm.get("rss_per_model_bytes_mean")),
                         f"{fm.get('requests')} requests, {fm.get('concurrency')} clients, "
                         f"batch 1 per model; RSS {_mb(fm.get('rss_total_bytes'))} for "
                         f"{fm.get('k')} models"])
        out += _table(["design", "p50 ms", "images/s", "RSS per bot", "notes"], rows)
        out += [""]

    scale = results.get("scale")
    if scale:
        out += [f"## Bot scale (heads of {scale.get('classes')} classes, "
                f"{_kb(scale.get('weight_bytes_per_bot'))} of weights each)", ""]
        rows = []
        for lv in scale.get("levels", []):
            rows.append([lv["bots"], lv["register"]["p50_ms"], lv["register"]["p99_ms"],
                         lv.get("touched"), _kb(lv.get("rss_growth_per_bot_bytes")),
                         lv.get("rss_growth_ratio"), lv.get("resident_heads")])
        out += _table(["registered bots", "register p50 ms", "register p99 ms",
                       "touched via server", "RSS growth per bot", "× weight bytes",
                       "resident heads"], rows)
        cold, warm = scale.get("cold", {}), scale.get("warm", {})
        out += ["", f"RSS: {scale.get('method', '')} Overall "
                f"{_kb(scale.get('rss_growth_per_bot_bytes'))} per bot = "
                f"{_fmt(scale.get('rss_growth_ratio'))} × weight bytes. "
                f"Registration p50 over all {scale.get('registrations')} registrations: "
                f"{_fmt(scale.get('registration_p50_ms'))} ms (p99 "
                f"{_fmt(scale.get('registration_p99_ms'))} ms).",
                f"First request to a cold bot (head not resident): p50 {_fmt(cold.get('p50_ms'))}"
                f" ms, p95 {_fmt(cold.get('p95_ms'))} ms (n={cold.get('n')}); warm bot: p50 "
                f"{_fmt(warm.get('p50_ms'))} ms, p95 {_fmt(warm.get('p95_ms'))} ms "
                f"(n={warm.get('n')}); {scale.get('latency_method', '')}", ""]

    cold_start = results.get("coldstart")
    if cold_start:
        out += ["## Cold start (`multihead serve` process start to /readyz 200)", ""]
        rows = [[s["label"], s.get("healthz_s"), s.get("ready_s"), s.get("notes", "")]
                for s in cold_start.get("starts", [])]
        out += _table(["start", "/healthz 200 s", "/readyz 200 s", "notes"], rows)
        if cold_start.get("note"):
            out += ["", cold_start["note"]]
        out += [""]

    if results.get("replicas"):
        from bench.replicas import render_markdown as replicas_markdown

        out += replicas_markdown(results["replicas"])
    if results.get("grpc"):
        from bench.grpc_load import render_markdown as grpc_markdown

        out += grpc_markdown(results["grpc"])
    overload = results.get("overload")
    if overload:
        out += [f"## Overload: {overload['uploads']} concurrent uploads of "
                f"{overload['upload_bytes'] / 1e6:.1f} MB to one server", ""]
        out += _table(["RSS start", "RSS peak", "RSS after", "in-flight budget", "answers",
                       "wrong", "elapsed s"],
                      [[_mb(overload["rss_start_bytes"]), _mb(overload["rss_peak_bytes"]),
                        _mb(overload["rss_after_bytes"]), _mb(overload["budget_bytes"]),
                        ", ".join(f"{k}: {v}" for k, v in sorted(overload["statuses"].items())),
                        overload["wrong_answers"], overload["elapsed_s"]]])
        out += [""]
    soak = results.get("soak")
    if soak:
        out += [f"## Soak: {soak['duration_s']:.0f} s of mixed valid and hostile traffic, "
                f"{soak['clients']} clients", ""]
        out += _table(["requests", "statuses", "RSS start", "RSS 1st half mean",
                       "RSS 2nd half mean", "RSS max", "RSS end"],
                      [[soak["requests"],
                        ", ".join(f"{k}: {v}" for k, v in sorted(soak["statuses"].items())),
                        _mb(soak["rss_start_bytes"]), _mb(soak["rss_first_half_mean_bytes"]),
                        _mb(soak["rss_second_half_mean_bytes"]), _mb(soak["rss_max_bytes"]),
                        _mb(soak["rss_end_bytes"])]])
        out += [""]

    errors = results.get("errors") or {}
    if errors:
        out += ["## Errors", ""]
        for section, message in errors.items():
            out.append(f"- {section}: {message}")
        out += [""]

    if targets is not None:
        out += ["## Targets (issue 6)", ""]
        rows = [[t.text, "not measured" if t.measured is None else f"{_fmt(t.measured)} {t.unit}",
                 "—" if t.limit is None else f"{t.op} {_fmt(t.limit)} {t.unit}", t.status,
                 t.note] for t in targets]
        out += _table(["target", "measured", "limit", "result", "notes"], rows)
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
    batching policy, with the raw trunk's best rate and the matmul ceiling as vertical lines.
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
            ax.annotate(_load_label(p), (x, y), textcoords="offset points",
                        xytext=(6, 4) if policy == "mixed" else (6, -10), fontsize=7,
                        color=color)
    best = get_path(results, "trunk.best_images_per_s")
    if best:
        ax.axvline(best, color="tab:green", linestyle="--", linewidth=1,
                   label=f"raw trunk best {best:.1f} images/s")
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

