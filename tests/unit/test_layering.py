"""The package's layers hold: nothing imports upward, no package imports another of its own
layer, no cycle between packages or between modules, and the imports the design forbids are
absent. Every import counts: inside functions, under ``TYPE_CHECKING``, relative or absolute.

Bottom to top (ARCHITECTURE.md, "Layers"):

0. ``common`` (domain types, errors, settings machinery, telemetry, gRPC bootstrap) and the
   generated ``api``;
1. ``perf``: the GPU/model catalog, KV budget, roofline and calibration that worker, router,
   simulator and planner all use;
2. ``state`` (hot state: Redis and in-memory backends) and ``db`` (durable state);
3. the services: ``router``, ``pool``, ``kv_transfer``, ``worker``, and ``capacity`` (the pure
   planning policies: planner, autoscaler, expert placement);
4. ``sim``: the simulator, which runs the services' own policies;
5. ``governor``: the capacity governor service, which plans with the simulator;
6. ``cli`` on top (and the package's ``__main__``).
"""

from __future__ import annotations

import ast
import collections
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "services" / "pdserve"

LAYER_OF: dict[str, int] = {
    "api": 0, "common": 0,
    "perf": 1,
    "state": 2, "db": 2,
    "router": 3, "pool": 3, "kv_transfer": 3, "worker": 3, "capacity": 3,
    "sim": 4,
    "governor": 5,
    "cli": 6, "__main__": 7,
}
SAME_LAYER_ALLOWED: frozenset[tuple[str, str]] = frozenset({("common", "api")})

FORBIDDEN: dict[str, frozenset[str]] = {
    "router": frozenset({"worker", "pool", "kv_transfer"}),
    "worker": frozenset({"router", "capacity", "pool"}),
    "common": frozenset({"router", "pool", "kv_transfer", "worker", "capacity", "governor",
                         "sim", "state", "db", "perf", "cli"}),
}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name (resolved to a module of the package)
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(modules: dict[str, Path]) -> Iterator[Import]:
    for module, path in modules.items():
        if module.startswith("pdserve.api"):
            continue
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                names = [f"{prefix}.{alias.name}" for alias in node.names]
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]  # a module named by string (registries, importlib)
            for name in names:
                if not name.startswith("pdserve"):
                    continue
                resolved = (_resolve(name, modules) if not isinstance(node, ast.Constant)
                            else name if name in modules else None)
                if resolved and resolved != module:
                    yield Import(module, resolved, node.lineno)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__main__"


MODULES = _modules()
IMPORTS = list({(imp.importer, imp.imported): imp for imp in _imports(MODULES)}.values())


def test_every_package_has_a_layer() -> None:
    packages = {_package(m) for m in MODULES if m != "pdserve"}
    assert packages <= set(LAYER_OF), f"packages without a layer: {packages - set(LAYER_OF)}"


def test_nothing_imports_upward_or_sideways() -> None:
    wrong = []
    for imp in IMPORTS:
        src, dst = _package(imp.importer), _package(imp.imported)
        if src == dst or imp.imported == "pdserve" or (src, dst) in SAME_LAYER_ALLOWED:
            continue
        if LAYER_OF[dst] >= LAYER_OF[src]:
            wrong.append(f"{imp.importer}:{imp.line} -> {imp.imported} "
                         f"(layer {LAYER_OF[src]} -> {LAYER_OF[dst]})")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(wrong)


def test_forbidden_imports() -> None:
    wrong = [f"{imp.importer}:{imp.line} -> {imp.imported}" for imp in IMPORTS
             if _package(imp.imported) in FORBIDDEN.get(_package(imp.importer), ())]
    assert not wrong, "imports the design forbids:\n" + "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_cycle_between_packages() -> None:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for imp in IMPORTS:
        src, dst = _package(imp.importer), _package(imp.imported)
        if src != dst and imp.imported != "pdserve":
            edges[src].add(dst)
    assert not _cycles(edges)


def test_no_cycle_between_modules() -> None:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for imp in IMPORTS:
        edges[imp.importer].add(imp.imported)
    assert not _cycles(edges)


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], expected: list) -> None:
    assert _cycles(edges) == expected


def test_the_import_scanner_sees_function_level_and_type_checking_imports() -> None:
    seen = {(imp.importer, imp.imported) for imp in IMPORTS}
    # cli.main imports its commands inside functions; the scanner must see at least one.
    assert any(src == "pdserve.cli.main" for src, _ in seen)
