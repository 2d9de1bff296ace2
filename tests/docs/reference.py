"""The reference tables of `docs/`, generated from the code's public surfaces.

    python -m tests.docs.reference           # exit 1 and name the stale blocks, if any
    python -m tests.docs.reference --write   # rewrite the generated blocks in docs/*.md

Four tables, each read from what users actually meet, never from internals a refactoring moves:

    flags    every option of every `multihead` command   <- the argparse parsers of cli.main
    metrics  every metric `/metrics` exposes              <- the registry of a `Metrics()`, and
                                                            the Ray merge's own (metrics_merge)
    errors   every error code with its statuses          <- `error_status` / `grpc_status` of every
                                                            error class of service, heads, backbone
    routes   every HTTP route by protocol                <- service.codecs.routes.ENDPOINTS

A generated block sits between `<!-- BEGIN GENERATED <name> ... -->` and
`<!-- END GENERATED <name> -->` in one file of `docs/`; the prose around it is written by hand.
`tests/docs/test_docs.py` checks that the blocks are current and that every name in them exists
(and every existing one is in them).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
COMMAND = "python -m tests.docs.reference --write"

BEGIN = re.compile(r"<!-- BEGIN GENERATED (\w+)[^>]*-->\n")
END = "<!-- END GENERATED {name} -->"


# -- what the code has ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    command: str  # "multihead bots list"
    group: str  # the argparse group's title ("options", "serve settings", ...)
    options: tuple[str, ...]  # ("--graph-cache", "--no-graph-cache")
    help: str
    choices: tuple[str, ...] = ()


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    # NOTE: argparse has no public way to list a parser's actions; `_actions`, `_action_groups`
    # and `_SubParsersAction` have been stable since Python 3.2.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def commands(parser: argparse.ArgumentParser | None = None,
             prefix: str = "multihead") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command path with its parser, root first (`multihead`, `multihead serve`, ...)."""
    if parser is None:
        from cli.main import build_parser

        parser = build_parser()
    yield prefix, parser
    for name, sub in _subparsers(parser):
        yield from commands(sub, f"{prefix} {name}")


def cli_flags() -> list[Flag]:
    """Every optional flag of every `multihead` command, except each parser's own `--help`."""
    out = []
    for command, parser in commands():
        for group in parser._action_groups:
            for action in group._group_actions:
                if not action.option_strings or isinstance(action, argparse._HelpAction):
                    continue
                text = (action.help or "").replace("%%", "%")
                choices = tuple(str(c) for c in action.choices or ())
                out.append(Flag(command, group.title or "options",
                                tuple(action.option_strings), text, choices))
    return out


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed: `multihead_requests_total`, `multihead_trunk_seconds`
    kind: str
    labels: tuple[str, ...]
    help: str


def metrics() -> list[Metric]:
    """Every metric family of a fresh `Metrics()`, by the name `/metrics` shows, then the
    families the merge of replicas' metrics adds under `--ray`."""
    from service.core import metrics_merge
    from service.core.metrics import Metrics

    m = Metrics()
    # NOTE: prometheus_client exposes a metric's label names only as `_labelnames`; the families
    # `collect()` returns carry labels only once a labelled child exists.
    labels = {}
    for value in vars(m).values():
        describe = getattr(value, "describe", None)
        if callable(describe):
            for family in describe():
                labels[family.name] = tuple(getattr(value, "_labelnames", ()))
    out = []
    for family in m.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out.append(Metric(name, family.type, labels.get(family.name, ()), family.documentation))
    out += [Metric(family.name, family.type, (), family.documentation)
            for family in metrics_merge.describe()]
    return out


@dataclass(frozen=True)
class ErrorCode:
    code: str
    http: int
    grpc: str
    headers: tuple[str, ...]
    raised_for: tuple[str, ...]  # "`UnknownBot`: No bot with this id is registered (HTTP 404)."


LAYERS = ("service.", "store.", "accounts.", "heads.", "backbone.")
INTERNAL = "internal"


def _error_classes() -> list[type[BaseException]]:
    import accounts.errors  # noqa: F401
    import backbone.errors  # noqa: F401 - loaded so that their classes are found below
    import heads.errors  # noqa: F401
    import service.codecs.routes  # noqa: F401 - the whole service core with it
    import store.errors  # noqa: F401

    seen, todo, out = set(), [BaseException], []
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                if sub.__module__.startswith(LAYERS):
                    out.append(sub)
    return sorted(out, key=lambda c: (c.__module__, c.__qualname__))


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def error_codes() -> list[ErrorCode]:
    """Every code the error table gives to an error class of the service, heads and backbone
    layers, with its HTTP status, gRPC status and extra headers; `internal` for the rest."""
    from service.core.errors import error_status, grpc_status

    rows: dict[tuple[str, int, str], dict] = {}
    for cls in _error_classes():
        exc = cls.__new__(cls)  # no constructor: the mapping depends on the class alone
        status, code, headers = error_status(exc)
        grpc, _ = grpc_status(exc)
        row = rows.setdefault((code, status, grpc), {"headers": set(), "raised": []})
        row["headers"].update(headers)
        if code != INTERNAL:
            row["raised"].append(f"`{cls.__name__}`: {_first_sentence(cls.__doc__)}")
    if not any(code == INTERNAL for code, _, _ in rows):
        rows[(INTERNAL, 500, "INTERNAL")] = {"headers": set(), "raised": []}
    out = []
    for (code, status, grpc), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        raised = tuple(row["raised"]) if code != INTERNAL else (
            "any other error: a server fault (generic message; logged with its traceback)",)
        out.append(ErrorCode(code, status, grpc, tuple(sorted(row["headers"])), raised))
    return out


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # without the path parameters' regexes: /v2/models/{bot_id}/infer
    name: str
    protocol: str
    access: str
    summary: str


PARAM_REGEX = re.compile(r"\{(\w+):[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")


def plain_path(path: str) -> str:
    """`/v2/models/{bot_id:[^{}/:]+}/infer` -> `/v2/models/{bot_id}/infer`."""
    return PARAM_REGEX.sub(r"{\1}", path)


def routes() -> list[Route]:
    from service.codecs.routes import ENDPOINTS

    return [Route(e.method, plain_path(e.path), e.name, e.tag or "other", e.access, e.summary)
            for e in ENDPOINTS]


# Who may call an endpoint, by its access rule (service/core/auth.py), with --auth keys.
WHO = {"public": "anyone", "infer": "infer or manage key, operator",
       "manage": "manage key, operator", "metrics": "metrics key, operator",
       "operator": "operator"}


# -- Markdown -----------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Table-cell text: `|` escaped, and `<`/`>` outside code spans too (else a `<store>` in a
    help text would render as an HTML tag and vanish)."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


ENV_DEFAULT = re.compile(r"\s*\((?:env (?P<env>\w+); )?default: (?P<default>[^()]*)\)\s*$")


def split_help(text: str) -> tuple[str, str, str]:
    """`"most images (env MULTIHEAD_X; default: 16)"` -> `("most images", "MULTIHEAD_X", "16")`."""
    found = ENV_DEFAULT.search(text)
    if found is None:
        return text, "", ""
    return text[:found.start()], found["env"] or "", found["default"]


def render_flags() -> list[str]:
    lines: list[str] = []
    by_command: dict[str, dict[str, list[Flag]]] = {}
    for flag in cli_flags():
        by_command.setdefault(flag.command, {}).setdefault(flag.group, []).append(flag)
    for command, groups in by_command.items():
        lines += ["", f"### `{command}`"]
        for group, flags in groups.items():
            if len(groups) > 1:
                lines += ["", f"*{group}*"]
            rows = []
            for flag in flags:
                meaning, env, default = split_help(flag.help)
                if flag.choices and not all(c in meaning for c in flag.choices):
                    meaning += f" (one of {', '.join(flag.choices)})"
                rows.append((", ".join(f"`{o}`" for o in flag.options),
                             f"`{env}`" if env else "", default, meaning))
            lines += [""] + table(("flag", "environment", "default", "meaning"), rows)
    return lines[1:]


def render_metrics() -> list[str]:
    rows = [(f"`{m.name}`", m.kind, ", ".join(f"`{label}`" for label in m.labels), m.help)
            for m in metrics()]
    return table(("metric", "type", "labels", "meaning"), rows)


def render_errors() -> list[str]:
    rows = [(f"`{e.code}`", str(e.http), f"`{e.grpc}`", ", ".join(e.headers),
             " ".join(e.raised_for)) for e in error_codes()]
    return table(("code", "HTTP", "gRPC", "headers", "raised for"), rows)


def render_routes() -> list[str]:
    lines: list[str] = []
    by_protocol: dict[str, list[Route]] = {}
    for route in routes():
        by_protocol.setdefault(route.protocol, []).append(route)
    for protocol, group in by_protocol.items():
        rows = [(r.method, f"`{r.path}`", f"`{r.name}`", WHO[r.access], r.summary)
                for r in group]
        lines += ["", f"*{protocol}*", ""] + table(
            ("method", "route", "operation", "who", "what"), rows)
    return lines[1:]


# name -> (file under docs/, renderer)
BLOCKS: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "flags": ("configuration.md", render_flags),
    "metrics": ("deployment.md", render_metrics),
    "errors": ("protocols.md", render_errors),
    "routes": ("protocols.md", render_routes),
}


def generated(name: str) -> str:
    """The text of block `name`, markers included."""
    _, render = BLOCKS[name]
    return "\n".join([f"<!-- BEGIN GENERATED {name}: {COMMAND} -->", *render(),
                      END.format(name=name)])


def blocks(text: str) -> dict[str, str]:
    """The generated blocks of one document, markers included, by name."""
    out = {}
    for found in BEGIN.finditer(text):
        name = found[1]
        end = text.find(END.format(name=name), found.end())
        if end < 0:
            raise ValueError(f"generated block {name!r} has no end marker")
        out[name] = text[found.start():end + len(END.format(name=name))]
    return out


def stale(write: bool = False) -> list[str]:
    """Names of the blocks whose text differs from the code's (rewritten when `write`)."""
    out = []
    for name, (file, _) in BLOCKS.items():
        path = DOCS / file
        text = path.read_text()
        current = blocks(text).get(name)
        if current is None:
            raise ValueError(f"{path}: no generated block {name!r}")
        fresh = generated(name)
        if current != fresh:
            out.append(f"{file}: {name}")
            if write:
                path.write_text(text.replace(current, fresh))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale blocks")
    args = parser.parse_args(argv)
    names = stale(write=args.write)
    for name in names:
        print(("rewrote " if args.write else "stale: ") + name)
    return 1 if names and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
