"""The house rules that are not import layers (those are test_imports.py), checked on the source:

- no product module over MAX_MODULE_LINES lines: a module that grows past it holds two
  subjects (docs/architecture.md says where each one lives);
- no `__getattr__` in service/: a facade that forwards whatever it is asked grants by default
  (STYLE.md, "Fail closed"); what a caller may do is listed, each member with its rule
  (service.core.caller, tests/service/core/test_caller.py);
- `service/` imports nothing from `cli/` or `bench/` (both sit above it);
- SQL lives in the store and the accounts, never in `heads/` (head maths, files, training,
  the resident cache): no SQL text and no database driver there.

Each rule's checker is also run on a made-up source that breaks it, so that a checker that
stopped looking cannot pass the tree by finding nothing.
"""
from __future__ import annotations

import ast
import re

from tests.architecture.test_imports import MODULES, _edges
from tests.support.parsing import parse

MAX_MODULE_LINES = 600
# SQL statements as the store and the accounts write them (keywords in upper case).
SQL_RE = re.compile(r"\b(SELECT\s.+\sFROM|INSERT\s+INTO|UPDATE\s+\S+\s+SET|DELETE\s+FROM|"
                    r"CREATE\s+(TABLE|INDEX)|ALTER\s+TABLE|DROP\s+TABLE)\b", re.S)
DATABASE_DRIVERS = ("sqlite3", "psycopg")


def long_modules(sources: dict[str, str], limit: int = MAX_MODULE_LINES) -> list[str]:
    """'module: N lines' for each source longer than `limit` lines."""
    return sorted(f"{name}: {n} lines" for name, text in sources.items()
                  if (n := len(text.splitlines())) > limit)


def getattr_facades(sources: dict[str, str]) -> list[str]:
    """'module:line' of every `__getattr__` defined (module level or in a class)."""
    found = []
    for name, text in sources.items():
        for node in ast.walk(parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                    and node.name == "__getattr__":
                found.append(f"{name}:{node.lineno}")
    return sorted(found)


def sql_and_drivers(sources: dict[str, str]) -> list[str]:
    """'module:line what' of every SQL statement in a string and every database driver
    imported."""
    found = []
    for name, text in sources.items():
        for node in ast.walk(parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and SQL_RE.search(node.value):
                found.append(f"{name}:{node.lineno} SQL {node.value.strip()[:40]!r}")
            elif isinstance(node, ast.Import | ast.ImportFrom):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""])
                found += [f"{name}:{node.lineno} imports {m}" for m in modules
                          if m.split(".")[0] in DATABASE_DRIVERS]
    return sorted(found)


def _sources(prefix: str = "") -> dict[str, str]:
    return {name: path.read_text(encoding="utf-8") for name, path in MODULES.items()
            if name == prefix or name.startswith(prefix)}


def test_no_product_module_is_over_the_limit():
    assert long_modules(_sources()) == []


def test_the_line_counter_finds_a_long_module():
    sources = {"a": "x = 1\n" * (MAX_MODULE_LINES + 1), "b": "x = 1\n" * MAX_MODULE_LINES}
    assert long_modules(sources) == [f"a: {MAX_MODULE_LINES + 1} lines"]


def test_no_getattr_facade_in_service():
    assert getattr_facades(_sources("service.")) == []


def test_the_facade_finder_finds_one():
    source = ("class Caller:\n    def __init__(self, s):\n        self._s = s\n\n"
              "    def __getattr__(self, name):\n        return getattr(self._s, name)\n")
    assert getattr_facades({"m": source, "ok": "def f():\n    return 1\n"}) == ["m:5"]
    assert getattr_facades({"m": "def __getattr__(name):\n    return name\n"}) == ["m:1"]


def test_service_imports_nothing_from_cli_or_bench():
    upward = sorted((src, dst) for src, dsts in _edges().items() if src.startswith("service.")
                    for dst in dsts if dst.split(".")[0] in ("cli", "bench"))
    assert upward == []


def test_heads_holds_no_sql_and_no_database_driver():
    assert sql_and_drivers(_sources("heads")) == []


def test_the_sql_finder_finds_statements_and_drivers():
    source = ('import sqlite3\nfrom psycopg import sql\n'
              'Q = "SELECT id, tenant FROM keys WHERE revoked IS NULL"\n'
              'W = """INSERT INTO audit (at) VALUES (?)"""\n'
              'TEXT = "select a bot, then insert it into a request"\n')
    found = sql_and_drivers({"m": source})
    assert [f.split(" ", 1)[0] for f in found] == ["m:1", "m:2", "m:3", "m:4"]
    # And where SQL really is, it is found: the accounts' rows.
    assert sql_and_drivers(_sources("accounts.rows"))
