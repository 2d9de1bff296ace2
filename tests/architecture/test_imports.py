"""The import layers of the project, checked by parsing every module's imports (lazy ones in
functions and `TYPE_CHECKING` ones included). Layers are folders (LAYERS below):

    backbone <- heads <- accounts <- store <- service/core <- service/codecs
             <- service/transports/common <- service/transports/{http,grpc,ray} <- bench <- cli

The three transports never import each other. No import cycle among modules; aiohttp only in
the HTTP transport and the benchmark client; grpc and the packages of its generated code
(tritonclient, tensorflow_serving) only in the gRPC transport and the benchmark's gRPC client
(bench.grpc_load); Ray and Starlette only in the Ray transport; psycopg only in the PostgreSQL
store backend (store.pg); OpenVINO only in the backbone and NNCF only
in backbone.quantize; OpenTelemetry only in service.core.tracing (lazily: tracing is off by
default); matplotlib only in the benchmark's report; no private name imported
from another module.
"""
from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

from tests.support.parsing import parse

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("backbone", "heads", "accounts", "store", "service", "bench", "cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement in the file."""
    tree = parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def _edges() -> dict[str, set[str]]:
    """Module -> project modules it imports (`from pkg import mod` counts as pkg.mod)."""
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(name, path):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
            if len(targets) < len(names) or not names:
                targets.append(module)
            edges[name].update(t for t in targets if t in MODULES and t != name)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


# Layers by folder (a module's layer is that of the longest prefix that names it); lower
# layers must not import higher ones. Every module of `service/` lives in one of its folders.
LAYERS = {
    "backbone": 0,
    "heads": 1,
    "accounts": 2,
    "store": 3,
    "service": 4,  # the package's __init__ only (the test below keeps it so)
    "service.core": 4,
    "service.codecs": 5,
    "service.transports.common": 6,
    "service.transports.http": 7,
    "service.transports.grpc": 7,
    "service.transports.ray": 7,
    "bench": 8,
    "cli": 9,
}


def _layer(module: str) -> int:
    """The layer of a module, by the longest folder prefix in LAYERS."""
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")),
               key=len, default=None)
    assert best is not None, f"{module} is in no layer folder"
    return LAYERS[best]


def test_every_service_module_lives_in_a_layer_folder():
    loose = sorted(str(path.relative_to(REPO)) for path in MODULES.values()
                   if path.parent == REPO / "service" and path.name != "__init__.py")
    assert loose == []
    assert all(_layer(m) >= 0 for m in MODULES)


def test_the_transports_never_import_each_other():
    rooms = ("service.transports.http", "service.transports.grpc", "service.transports.ray")
    crossing = sorted((src, dst) for src, dsts in _edges().items() for dst in dsts
                      for a in rooms for b in rooms
                      if a != b and src.startswith(a + ".") and dst.startswith(b + "."))
    assert crossing == []


def test_the_parser_sees_every_package_and_edges():
    assert {"backbone.trunk", "store.front", "service.transports.http.app", "service.codecs.native",
            "bench.runner"} <= set(MODULES)
    assert "service.core.engine" in _edges()["service.core.lifecycle"]


def test_no_import_cycle():
    assert _cycles(_edges()) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lower_layers_never_import_higher_ones():
    wrong = sorted((src, dst) for src, dsts in _edges().items() for dst in dsts
                   if _layer(dst) > _layer(src))
    assert wrong == []


AIOHTTP_ALLOWED = ("service.transports.http.", "bench.")
MATPLOTLIB_ALLOWED = ("bench.report",)
GRPC_ALLOWED = ("service.transports.grpc.", "bench.grpc_load")
RAY_ALLOWED = ("service.transports.ray.",)


@pytest.mark.parametrize("library,allowed", [("aiohttp", AIOHTTP_ALLOWED),
                                             ("matplotlib", MATPLOTLIB_ALLOWED),
                                             ("grpc", GRPC_ALLOWED),
                                             ("tritonclient", GRPC_ALLOWED),
                                             ("tensorflow_serving", GRPC_ALLOWED),
                                             ("ray", RAY_ALLOWED),
                                             ("starlette", RAY_ALLOWED),
                                             ("psycopg", ("store.pg",)),
                                             ("openvino", ("backbone.",)),
                                             ("nncf", ("backbone.quantize",)),
                                             ("opentelemetry", ("service.core.tracing",)),
                                             ("tensorflow", ("backbone.", "heads.files",
                                                             "store.front", "heads.train",
                                                             "bench.sections.trunk",
                                                             "bench.sections.baselines"))])
def test_heavy_libraries_stay_where_they_belong(library, allowed):
    users = sorted({name for name, path in MODULES.items()
                    for module, _, _ in _imports(name, path)
                    if module == library or module.startswith(f"{library}.")})
    assert users, f"nobody imports {library}: the check is not looking"
    assert [u for u in users if not u.startswith(allowed)] == []


def test_no_private_name_is_imported_from_another_module():
    private = sorted(f"{name}:{line} imports {module}.{n}"
                     for name, path in MODULES.items()
                     for module, names, line in _imports(name, path)
                     if module in MODULES and module != name
                     for n in names if n.startswith("_") and not n.startswith("__"))
    assert private == []


def test_a_plain_install_brings_no_matplotlib():
    requires = importlib.metadata.requires("multihead") or []
    plain = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("tensorflow") for r in plain), requires
    assert not [r for r in plain if r.lower().startswith("matplotlib")]
    assert [r for r in requires if r.lower().startswith("matplotlib")], \
        "matplotlib should be in the bench extra"
