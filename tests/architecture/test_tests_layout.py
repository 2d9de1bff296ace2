"""The tests mirror the source folders: a test folder is named after the source folder it tests
(tests/service/core for service/core, tests/cli for cli, ...) or is one of the suite's own
(support, data, docs, fuzz, architecture, scaleout), and no test file sits loose in a folder
that has sub-folders for its parts. And every `REPO = Path(__file__)...parents[N]` in the
tests is the repository's root (a test moved one folder deeper once ran its subprocesses from
tests/, where tests/service shadowed the service package)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support.parsing import parse

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# Folders of the suite itself, not of a source folder.
OWN = {"support", "data", "docs", "fuzz", "architecture", "scaleout", "hostile"}


def unmirrored(tests: Path, repo: Path) -> list[str]:
    """Test folders that name no source folder (nor one of OWN)."""
    out = []
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir()
                         and p.name != "__pycache__" and "__pycache__" not in p.parts):
        rel = folder.relative_to(tests)
        if rel.parts[0] in OWN:
            continue
        if not (repo / rel).is_dir():
            out.append(rel.as_posix())
    return out


def loose_tests(tests: Path) -> list[str]:
    """Test files in a folder of source tests that also has sub-folders of tests: they belong
    in the sub-folder of their subject."""
    out = []
    for folder in [tests, *(p for p in tests.rglob("*") if p.is_dir())]:
        rel = folder.relative_to(tests)
        if folder.name == "__pycache__" or (rel.parts and rel.parts[0] in OWN):
            continue
        subs = [p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
        if folder != tests and subs:
            out += [p.relative_to(tests).as_posix() for p in sorted(folder.glob("test_*.py"))]
    return out


def repo_roots(path: Path) -> list[tuple[int, Path]]:
    """(line, the folder it names) of each `Path(__file__)...parents[N]` in a test file."""
    found = []
    for node in ast.walk(parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "parents" and isinstance(node.slice, ast.Constant)
                and "__file__" in ast.unparse(node.value)):
            found.append((node.lineno, path.resolve().parents[node.slice.value]))
    return found


def test_every_test_folder_mirrors_a_source_folder():
    assert unmirrored(TESTS, REPO) == []


def test_no_test_file_is_loose_beside_the_folders_of_its_parts():
    assert loose_tests(TESTS) == []


def test_the_layout_checkers_find_what_is_wrong(tmp_path):
    (tmp_path / "src" / "service" / "core").mkdir(parents=True)
    tests = tmp_path / "tests"
    for folder in ("service/core", "service/nowhere", "support"):
        (tests / folder).mkdir(parents=True)
        (tests / folder / "__init__.py").write_text("")
    (tests / "service" / "test_loose.py").write_text("")
    assert unmirrored(tests, tmp_path / "src") == ["service/nowhere"]
    assert loose_tests(tests) == ["service/test_loose.py"]


def test_every_repo_root_in_the_tests_is_the_repository():
    wrong = []
    for path in sorted(TESTS.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        wrong += [f"{path.relative_to(REPO)}:{line} -> {root}"
                  for line, root in repo_roots(path)
                  if lines[line - 1].lstrip().startswith("REPO =") and root != REPO]
    assert wrong == []


def test_the_root_checker_sees_a_wrong_depth(tmp_path):
    deep = tmp_path / "tests" / "service" / "core"
    deep.mkdir(parents=True)
    test = deep / "test_x.py"
    test.write_text("from pathlib import Path\nREPO = Path(__file__).resolve().parents[2]\n")
    assert repo_roots(test) == [(2, tmp_path / "tests")]
