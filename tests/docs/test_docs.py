"""The README and `docs/` against the code.

- The reference tables (flags, metrics, error codes, routes) are parsed and compared with what
  the code has, both ways: something the code has and the docs lack fails, and so does
  something the docs name that the code no longer has. Each check is also run on a broken copy
  of the docs, to show it can fail. The tables are generated (`tests/docs/reference.py`) and
  must be current.
- Flags, metrics, `MULTIHEAD_*` variables and repository paths named in inline code anywhere in
  the docs must exist.
- Every relative link, and its `#anchor`, resolves; the README stays a front page.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.docs import reference

REPO = reference.REPO
README = REPO / "README.md"
# docs/bench/ holds a benchmark's generated output, kept as a sample: not prose to check.
DOC_FILES = [README, *sorted(reference.DOCS.glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^ *(```|~~~).*?^ *\1[^\n]*$", re.M | re.S)
INLINE = re.compile(r"(`+)(.+?)\1", re.S)
CELL_SPLIT = re.compile(r"(?<!\\)\|")
TICKED = re.compile(r"`([^`]+)`")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return FENCE.sub("", text)


def _inline_code(text: str) -> list[str]:
    return [m.group(2).strip() for m in INLINE.finditer(_prose(text))]


# -- the reference tables, parsed -----------------------------------------------------------------


def _rows(block: str) -> list[tuple[str | None, list[str]]]:
    """(the `### heading` above it, cells) for every body row of every table in `block`."""
    out, heading, header_seen = [], None, False
    for line in block.splitlines():
        stripped = line.strip()
        if stripped.startswith("### "):
            heading = stripped[4:].strip()
        if not stripped.startswith("|"):
            header_seen = False
            continue
        cells = [c.strip() for c in CELL_SPLIT.split(stripped.strip("|"))]
        if not header_seen:
            header_seen = True  # the header row
        elif not all(set(c) <= set("-: ") for c in cells):
            out.append((heading, cells))
    return out


def _ticked(text: str) -> list[str]:
    return TICKED.findall(text)


def documented_flags(block: str) -> set[tuple[str, str]]:
    out = set()
    for heading, cells in _rows(block):
        command = _ticked(heading or "")
        assert command, f"a flag row outside a `### \\`multihead ...\\`` heading: {cells}"
        out |= {(command[0], option) for option in _ticked(cells[0])}
    return out


def documented_first_column(block: str) -> set[str]:
    return {name for _, cells in _rows(block) for name in _ticked(cells[0])}


def documented_routes(block: str) -> set[tuple[str, str]]:
    return {(cells[0], path) for _, cells in _rows(block) for path in _ticked(cells[1])}


def actual_flags() -> set[tuple[str, str]]:
    return {(flag.command, option) for flag in reference.cli_flags() for option in flag.options}


def actual_metrics() -> set[str]:
    return {metric.name for metric in reference.metrics()}


def actual_codes() -> set[str]:
    return {error.code for error in reference.error_codes()}


def actual_routes() -> set[tuple[str, str]]:
    return {(route.method, route.path) for route in reference.routes()}


# block name -> (what the docs list, what the code has)
KINDS: dict[str, tuple[Callable[[str], set], Callable[[], set]]] = {
    "flags": (documented_flags, actual_flags),
    "metrics": (documented_first_column, actual_metrics),
    "errors": (documented_first_column, actual_codes),
    "routes": (documented_routes, actual_routes),
}


def _block(name: str) -> str:
    file, _ = reference.BLOCKS[name]
    found = reference.blocks(_text(reference.DOCS / file)).get(name)
    assert found is not None, f"docs/{file} has no generated block {name!r}"
    return found


def _differences(name: str, block: str) -> tuple[set, set]:
    """(in the code but not in the docs, in the docs but not in the code)."""
    parse, actual = KINDS[name]
    documented, existing = parse(block), actual()
    return existing - documented, documented - existing


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_name_the_code_has_is_documented_and_every_documented_one_exists(name):
    undocumented, gone = _differences(name, _block(name))
    assert not undocumented, (f"{name} missing from docs/{reference.BLOCKS[name][0]} (run "
                              f"`{reference.COMMAND}`): {sorted(undocumented)}")
    assert not gone, (f"{name} named in docs/{reference.BLOCKS[name][0]} that no longer exist "
                      f"(run `{reference.COMMAND}`): {sorted(gone)}")


def test_the_code_has_what_the_tables_are_about():
    """The readers see real surfaces, not empty ones (which would make the checks vacuous)."""
    assert ("multihead serve", "--max-batch-size") in actual_flags()
    assert ("multihead bots rollback", "--to") in actual_flags()
    assert {"multihead_trunk_info", "multihead_inflight_bytes",
            "multihead_requests_total"} <= actual_metrics()
    assert {"unknown_bot", "overloaded", "internal"} <= actual_codes()
    assert ("POST", "/v2/models/{bot_id}/infer") in actual_routes()


def _broken_copies(name: str) -> tuple[str, str]:
    """The block without its last row, and the block with a row for something that does not
    exist."""
    block = _block(name)
    lines = block.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("| "))
    without = "\n".join(lines[:last] + lines[last + 1:])
    bogus = {
        "flags": "| `--no-such-flag` |  |  | gone |",
        "metrics": "| `multihead_no_such_metric` | gauge |  | gone |",
        "errors": "| `no_such_code` | 400 | `INVALID_ARGUMENT` |  | gone |",
        "routes": "| GET | `/no/such/route` | `gone` | public | gone |",
    }[name]
    extra = "\n".join(lines[:last + 1] + [bogus] + lines[last + 1:])
    return without, extra


@pytest.mark.parametrize("name", sorted(KINDS))
def test_both_directions_fail_on_a_broken_copy(name):
    without, extra = _broken_copies(name)
    undocumented, gone = _differences(name, without)
    assert len(undocumented) >= 1 and not gone
    undocumented, gone = _differences(name, extra)
    assert not undocumented and len(gone) == 1, gone


def test_the_generated_blocks_are_current():
    assert reference.stale() == [], f"run `{reference.COMMAND}`"


def test_a_changed_block_is_stale(tmp_path, monkeypatch):
    file, _ = reference.BLOCKS["metrics"]
    copy = tmp_path / file
    copy.write_text(_text(reference.DOCS / file).replace(
        "`multihead_trunk_info`", "`multihead_trunk_nfo`"))
    for other in {f for f, _ in reference.BLOCKS.values()} - {file}:
        (tmp_path / other).write_text(_text(reference.DOCS / other))
    monkeypatch.setattr(reference, "DOCS", tmp_path)
    assert reference.stale() == [f"{file}: metrics"]
    assert reference.stale(write=True) == [f"{file}: metrics"]
    assert reference.stale() == []
    assert "`multihead_trunk_info`" in copy.read_text()


# -- names in the prose ---------------------------------------------------------------------------

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
METRIC = re.compile(r"multihead_[a-z0-9_]+")
ENV = re.compile(r"\bMULTIHEAD_[A-Z0-9_]+\b")
PATH = re.compile(r"(?:backbone|heads|service|bench|tests|docs)/[\w./-]*")
SAMPLE_SUFFIXES = ("", "_bucket", "_sum", "_count", "_created")
SOURCE_FOLDERS = ("backbone", "heads", "service", "bench", "tests")


def _all_inline_code() -> list[tuple[str, str]]:
    return [(path.relative_to(REPO).as_posix(), span) for path in DOC_FILES
            for span in _inline_code(_text(path))]


COMMANDS = ("multihead", ".venv/bin/multihead")


def named_flags(spans: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Flags in inline code that is a flag (`--pin a,b`) or a `multihead` command line (other
    tools' command lines, `python -m ... --write`, have flags of their own)."""
    return {(where, flag) for where, span in spans
            if span.startswith("--") or span.split()[0] in COMMANDS
            for flag in FLAG.findall(span)}


def test_every_flag_named_in_the_docs_exists():
    known = {option for _, option in actual_flags()} | {"--help"}
    unknown = sorted(f for f in named_flags(_all_inline_code()) if f[1] not in known)
    assert unknown == [], f"flags named in the docs that no `multihead` command has: {unknown}"
    assert not {f[1] for f in named_flags([("x", "multihead serve --gone")])} <= known


def _metric_names() -> set[str]:
    return {metric + suffix for metric in actual_metrics() for suffix in SAMPLE_SUFFIXES} | {
        metric.removesuffix("_total") for metric in actual_metrics()}


def named_metrics(spans: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Inline code that starts with a metric name (`multihead_x`, `multihead_x{bot="a"} 1`)."""
    return {(where, found.group()) for where, span in spans
            if (found := METRIC.match(span)) is not None}


def test_every_metric_named_in_the_docs_exists():
    known = _metric_names()
    named = named_metrics(_all_inline_code())
    assert any(m == "multihead_pinned_heads" for _, m in named)  # the prose is read at all
    unknown = sorted(m for m in named if m[1] not in known)
    assert unknown == [], f"metrics named in the docs that /metrics does not have: {unknown}"
    assert named_metrics([("x", 'multihead_gone{bot="a"} 1')]) - {
        ("x", m) for m in known}


def _known_env() -> set[str]:
    """The variables `--help` names, and every one the code, the tests or the Makefile spell."""
    known = {var for flag in reference.cli_flags() for var in ENV.findall(flag.help)}
    here = Path(__file__).parent  # these tests spell names that must NOT exist
    sources = [REPO / "Makefile"] + [path for folder in SOURCE_FOLDERS
                                     for path in (REPO / folder).rglob("*.py")
                                     if here not in path.parents]
    for path in sources:
        known |= set(ENV.findall(path.read_text(encoding="utf-8", errors="replace")))
    return known


def test_every_environment_variable_named_in_the_docs_exists():
    known = _known_env()
    assert {"MULTIHEAD_STORE", "MULTIHEAD_MAX_BATCH_SIZE", "MULTIHEAD_PG_BINDIR"} <= known
    named = {(path.relative_to(REPO).as_posix(), var) for path in DOC_FILES
             for var in ENV.findall(_text(path))}
    unknown = sorted(v for v in named if v[1] not in known)
    assert unknown == [], f"MULTIHEAD_* variables in the docs that nothing reads: {unknown}"
    assert "MULTIHEAD_NO_SUCH_VARIABLE" not in known


def test_every_repository_path_named_in_the_docs_exists():
    named = {(where, span) for where, span in _all_inline_code() if PATH.fullmatch(span)}
    assert ("docs/architecture.md", "service/core/errors.py") in named
    missing = sorted((where, span) for where, span in named if not (REPO / span).exists())
    assert missing == [], f"paths named in the docs that do not exist: {missing}"


STATUS_CODE = re.compile(r"\b[1-5]\d\d `([a-z]+(?:_[a-z]+)*)`")
# Codes the transports answer with before any codec runs (no route, wrong method): spelled in
# their source as `"code": "..."` or in a status -> code map.
TRANSPORT_CODE = re.compile(r'"code":\s*"([a-z_]+)"|\b[1-5]\d\d:\s*"([a-z_]+)"')


def _known_codes() -> set[str]:
    known = set(actual_codes())
    for path in (REPO / "service").rglob("*.py"):
        known |= {a or b for a, b in TRANSPORT_CODE.findall(path.read_text(encoding="utf-8"))}
    return known


def named_codes(text: str) -> set[str]:
    """Error codes the prose gives with their status: "503 `overloaded`"."""
    return set(STATUS_CODE.findall(_prose(text)))


def test_every_error_code_named_with_its_status_exists():
    known = _known_codes()
    assert "method_not_allowed" in known
    named = {(path.relative_to(REPO).as_posix(), code) for path in DOC_FILES
             for code in named_codes(_text(path))}
    assert ("docs/configuration.md", "image_too_large") in named
    unknown = sorted(c for c in named if c[1] not in known)
    assert unknown == [], f"error codes in the docs that nothing answers: {unknown}"
    assert named_codes("a 404 `no_such_code` answer") - known == {"no_such_code"}


# -- links, the README, the tour -----------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    out, seen = set(), {}
    for heading in HEADING.findall(_prose(text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(path: Path, text: str) -> list[str]:
    out = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(_text(dest))):
            out.append(f"{target} (no such anchor)")
    return out


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path):
    assert broken_links(path, _text(path)) == []


def test_a_broken_link_is_found():
    assert slug("Hot bots: `--pin` and `--preload`") == "hot-bots---pin-and---preload"
    assert slug("KServe — on paper") == "kserve--on-paper"
    text = "[a](docs/nowhere.md) [b](docs/protocols.md#no-such-heading) [c](#five-minute-tour)"
    assert broken_links(README, text) == ["docs/nowhere.md (no such file)",
                                          "docs/protocols.md#no-such-heading (no such anchor)"]


def test_the_readme_is_a_front_page():
    text = _text(README)
    assert len(text.splitlines()) <= README_MAX_LINES
    first_screen = "\n".join(text.splitlines()[:30])
    assert "make serve" in first_screen and "make test" in first_screen
    for doc in ("user-guide", "configuration", "protocols", "deployment", "performance",
                "architecture", "testing"):
        assert f"(docs/{doc}.md)" in text, doc


def test_the_tour_names_the_demo_bots_the_demo_creates():
    from heads.demo_images import KINDS as DEMO

    tour = _text(README).split("## Five-minute tour", 1)[1].split("\n## ", 1)[0]
    named = {bot: int(n) for bot, n in re.findall(r"`([a-z]+)`: (\d+)", tour)}
    assert named == {bot: len(labels) for bot, labels in DEMO.items()}


def threat_rows(text: str) -> list[list[str]]:
    """The rows of the security review's threat table (deployment.md), as their cells."""
    section = text.split("## Security review", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| Threat |"), lines[:1]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def threat_problems(text: str) -> list[str]:
    """What is wrong with the threat table: a row with an empty cell, no test named, or a test
    named that does not exist."""
    problems = []
    for threat, bound, setting, tests in threat_rows(text):
        if not (threat and bound and setting):
            problems.append(f"{threat or '?'}: an empty cell")
        named = re.findall(r"`(tests/[^`]+)`", tests)
        if not named:
            problems.append(f"{threat}: no test named")
        problems += [f"{threat}: {path} does not exist" for path in named
                     if not (REPO / path).exists()]
    return problems


def test_every_threat_names_its_bound_its_setting_and_a_test_that_exists():
    text = (reference.DOCS / "deployment.md").read_text(encoding="utf-8")
    assert len(threat_rows(text)) >= 15
    assert threat_problems(text) == []


def test_a_threat_without_a_test_or_with_a_missing_one_is_found():
    text = ("## Security review\n\n| Threat | Bound | Setting | Test |\n|---|---|---|---|\n"
            "| x | y | z | none |\n| p | q |  | `tests/nowhere/test_gone.py` |\n")
    assert threat_problems(text) == ["x: no test named", "p: an empty cell",
                                     "p: tests/nowhere/test_gone.py does not exist"]
