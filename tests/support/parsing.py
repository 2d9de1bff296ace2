"""`parse`: `ast.parse` for the architecture tests, tried again on one CPython 3.11.7 error.

In a `make test` worker where earlier tests left threads running (servers, TensorFlow),
`ast.parse` of a sound file once raised "SystemError: AST constructor recursion depth
mismatch" (the AST converter's depth check; later CPython releases fixed errors of this
message), and the same file parsed on the next try. Any other error, or this one every time,
is raised."""
from __future__ import annotations

import ast

ATTEMPTS = 5


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    for attempt in range(ATTEMPTS):
        try:
            return ast.parse(source, filename=filename)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
