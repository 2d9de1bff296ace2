"""Log lines as a serving process writes them, captured in a test: `Captured(log_format)` adds
a handler with the service's own formatter (`service.core.logs`) to the root logger, at INFO,
beside pytest's, for the duration of a `with` block."""
from __future__ import annotations

import io
import json
import logging

from service.core import logs


class Captured:
    """A handler on the root logger writing `log_format` lines into a buffer, at INFO."""

    def __init__(self, log_format: str) -> None:
        self.buffer = io.StringIO()
        self.handler = logging.StreamHandler(self.buffer)
        self.handler.setFormatter(logs.JsonFormatter() if log_format == "json"
                                  else logs.TextFormatter())
        self.root = logging.getLogger()
        self.level = self.root.level

    def __enter__(self) -> Captured:
        self.level = self.root.level
        self.root.addHandler(self.handler)
        self.root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self.root.removeHandler(self.handler)
        self.root.setLevel(self.level)

    def text(self) -> str:
        return self.buffer.getvalue()

    def lines(self) -> list[str]:
        return self.text().splitlines()

    def json(self) -> list[dict]:
        """Every line as the JSON object it must be (ValueError if one is not)."""
        return [json.loads(line) for line in self.lines()]

    def access(self) -> list[dict]:
        return [x for x in self.json() if x["logger"] == logs.ACCESS_LOGGER]
