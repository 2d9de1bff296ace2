"""docs/architecture.md's "Where to change what" held to the code: every recipe names files and
names that exist, and ends with the tests that check its claims, which exist too.

A recipe is a `###` section of that chapter. In its text:
- a backticked path (`backbone/runners/tf.py`, `store/directory/`) must exist in the repository;
- a backticked dotted name of a project package (`store.parts.BotsPart`,
  `service.codecs.routes.ENDPOINTS`) must import: the longest importable module prefix, then
  attributes;
- its last paragraph starts with "Checked by:" and names tests as `tests/...py::test_name`, each a
  test function defined in that file.

So a recipe that goes stale (a file moved, a name renamed, a test deleted) fails here, and a
claim such as "a new runtime is one module and one line" points at the test that proves it.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
CHAPTER = "## Where to change what"
PACKAGES = ("backbone", "heads", "accounts", "store", "service", "bench", "cli", "tests")
_ROOTS = "|".join(PACKAGES)
PATH_RE = re.compile(rf"`((?:{_ROOTS}|docs|Makefile|setup\.py)[^`\s]*)`")
DOTTED_RE = re.compile(rf"`((?:{_ROOTS})(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
TEST_RE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def recipes(text: str) -> dict[str, str]:
    """{recipe title: its text} of the chapter's `###` sections."""
    start = text.index(CHAPTER)
    end = text.find("\n## ", start + len(CHAPTER))
    chapter = text[start:end if end >= 0 else len(text)]
    parts = re.split(r"^### (.+)$", chapter, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


def missing_paths(body: str) -> list[str]:
    out = []
    for token in PATH_RE.findall(body):
        path = token.split("::")[0]
        if "/" not in path and path not in ("Makefile", "setup.py"):
            continue  # a dotted name (`unresolved_names`)
        if "*" in path or "<" in path:
            continue  # a pattern: `tests/service/test_settings*.py`, `service/transports/<name>/`
        if not (REPO / path).exists():
            out.append(token)
    return out


def unresolved_names(body: str) -> list[str]:
    out = []
    for dotted in DOTTED_RE.findall(body):
        if dotted.endswith((".py", ".md")):
            continue
        parts = dotted.split(".")
        obj = None
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                obj = None
            break
        if obj is None:
            out.append(dotted)
    return out


def checked_by(body: str) -> list[tuple[str, str]]:
    paragraphs = [p.strip() for p in body.strip().split("\n\n") if p.strip()]
    last = paragraphs[-1] if paragraphs else ""
    if not last.startswith("Checked by:"):
        return []
    return TEST_RE.findall(last)


def missing_tests(tests: list[tuple[str, str]]) -> list[str]:
    out = []
    for path, name in tests:
        file = REPO / path
        if not file.is_file() or not re.search(rf"^(async )?def {name}\(",
                                                file.read_text(encoding="utf-8"), re.M):
            out.append(f"{path}::{name}")
    return out


RECIPES = recipes(DOC.read_text(encoding="utf-8"))


def test_the_chapter_has_its_recipes():
    assert len(RECIPES) >= 6, sorted(RECIPES)


@pytest.mark.parametrize("title", sorted(RECIPES))
def test_a_recipe_names_what_exists_and_the_tests_that_check_it(title):
    body = RECIPES[title]
    assert missing_paths(body) == []
    assert unresolved_names(body) == []
    tests = checked_by(body)
    assert tests, f"recipe {title!r} ends with no 'Checked by:' paragraph naming tests"
    assert missing_tests(tests) == []


def test_the_checkers_find_what_is_stale():
    body = ("1. Edit `store/nowhere.py` and `backbone/precision.py`; call "
            "`store.front.HeadStore.get` and `store.front.NoSuchThing`.\n\n"
            "Checked by: tests/docs/test_architecture.py::test_the_checkers_find_what_is_stale,"
            " tests/docs/test_architecture.py::test_that_does_not_exist.\n")
    assert missing_paths(body) == ["store/nowhere.py"]
    assert unresolved_names(body) == ["store.front.NoSuchThing"]
    assert missing_tests(checked_by(body)) == [
        "tests/docs/test_architecture.py::test_that_does_not_exist"]
    assert checked_by("1. Do this.\n\nAnd that.\n") == []
