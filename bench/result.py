"""The typed results of the benchmark's sections.

A result is a dataclass whose fields are its section's entry of bench.json (`to_json`);
`from_json` reads such an entry back (missing keys take their defaults), so that the report and
the targets work alike on a fresh run and on a bench.json written earlier, or made up in a
test. Measurements nested deeper (load points, batch tables) stay plain JSON dicts inside the
fields.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Self


@dataclass
class Result:
    """Base of the sections' results: every field has a default (an empty result is one whose
    targets were not measured)."""

    def to_json(self) -> dict[str, Any]:
        """The section's entry of bench.json (the fields, in their order)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """A result from a bench.json entry; unknown keys are ignored, missing ones default."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Skipped(Result):
    """A section that could not run on this machine (a missing extra), and why."""

    skipped: str = ""
