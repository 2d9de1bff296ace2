"""What every section of the benchmark is: a `Section` (name, run, render, targets) over a typed
`Result` (`bench.result`), and the `Target`s that `--check` verifies."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from bench.result import Result, Skipped
from bench.stats import num

if TYPE_CHECKING:  # pragma: no cover
    from bench.context import Context

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass(frozen=True)
class Target:
    """One target of `--check`: a number of this run compared with a limit (often a ratio of
    two numbers of the same run)."""

    key: str
    text: str  # what is compared, in words
    section: str  # the sections that measure it, joined by "+" (SKIP when one is not selected)
    measured: float | None
    limit: float | None
    op: str  # "<=" or ">="
    unit: str
    status: str = ""  # PASS / FAIL / SKIP once evaluated (`evaluate`)
    note: str = ""

    @classmethod
    def of(cls, key: str, text: str, needs: tuple[str, ...], measured, limit, op: str,
           unit: str, note: str = "") -> Target:
        """A target not yet evaluated; NaN or None numbers are recorded as None."""
        m, lim = num(measured), num(limit)
        return cls(key, text, "+".join(needs), None if math.isnan(m) else m,
                   None if math.isnan(lim) else lim, op, unit, "", note)

    def evaluate(self, selected: set[str]) -> Target:
        """This target with its status: SKIP when a section it needs was not selected, FAIL
        when one was but a number is missing (the section failed), else PASS/FAIL. A status
        the section set itself (SKIP: this machine cannot measure it) is kept."""
        from dataclasses import replace

        if self.status:
            return self
        if not all(s in selected for s in self.section.split("+")):
            return replace(self, status=SKIP)
        if self.measured is None or self.limit is None:
            return replace(self, status=FAIL)
        ok = self.measured <= self.limit if self.op == "<=" else self.measured >= self.limit
        return replace(self, status=PASS if ok else FAIL)


def note(template: str, *values) -> str:
    """`template` formatted with the values, or "" when one of them is missing (NaN/None)."""
    if any(math.isnan(num(v)) for v in values):
        return ""
    return template.format(*values)


Results = Mapping[str, Result]


@dataclass(frozen=True)
class Section:
    """One section of the benchmark.

    Attributes:
        name: its `--sections` name and its key in bench.json.
        result_type: the `Result` dataclass it returns.
        run: measures on this machine; `run(context) -> result` (raises on failure: the run
            records the error and goes on with the next section).
        render: the Markdown of bench.md for the result; `render(result, results)` (results:
            every section's result of the run, by name, for comparison rows).
        targets: what `--check` verifies, `targets(result, results) -> [Target]`, also called
            with an empty `result_type()` when the section did not run (its targets are then
            SKIP or FAIL, never silently absent).
    """

    name: str
    result_type: type[Result]
    run: Callable[[Context], Result]
    render: Callable[[Any, Results], str]
    targets: Callable[[Any, Results], list[Target]] = lambda result, results: []

    def load(self, data: Mapping[str, Any]) -> Result:
        """The typed result of a bench.json entry (a `Skipped` one when it says so)."""
        if "skipped" in data and "skipped" not in {f.name for f in fields(self.result_type)}:
            return Skipped.from_json(data)
        return self.result_type.from_json(data)
