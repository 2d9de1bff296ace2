"""Number formatting and Markdown tables of bench.md, shared by every section's `render`."""
from __future__ import annotations

import math
from collections.abc import Mapping

from bench.stats import num


def fmt(value, digits: int = 3) -> str:
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


def mb(value) -> str:
    v = num(value)
    return "—" if math.isnan(v) else f"{v / 1e6:.1f} MB"


def kb(value) -> str:
    v = num(value)
    return "—" if math.isnan(v) else f"{v / 1e3:.0f} kB"


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table; cells that are not strings go through `fmt`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row)
                     + " |")
    return lines


def load_label(point: Mapping) -> str:
    """"1 client", "16 clients" or "Poisson 6.5/s" for a load point."""
    if point.get("mode") == "open":
        return f"Poisson {fmt(point.get('rate_per_s'))}/s"
    return f"{point.get('concurrency')} client{'s' if point.get('concurrency') != 1 else ''}"
