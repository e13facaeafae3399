"""Who imports whom (DESIGN.md, "Layers and imports"), drawn from the code's own imports.

Every module of ``remat/`` belongs to a layer; a layer imports only the layers listed for it,
each of them lower in the order below. Every import counts, wherever it stands: at the top of
a module, inside a function (lazy), under ``TYPE_CHECKING``. And no module reaches itself again
through its imports: the house drawn from them has no circle, across layers or within one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "remat"

# The order, bottom first: ir < tracer, solver < executor < report, torch_compile, enabling < api <
# client < the `remat` facade < pytest_plugin < cli. Layers of one rank stay apart.
RANK = {
    "ir": 0,
    "_version": 0,
    "tracer": 1,
    "solver": 1,
    "executor": 2,
    "report": 3,
    "torch_compile": 3,
    "enabling": 3,
    "api": 4,
    "client": 5,
    "<remat>": 6,
    "pytest_plugin": 7,
    "cli": 8,
}

# What each layer may import besides itself. The service runs without torch, so api reads no
# torch-backed layer; the executors never import the solvers (torch_compile injects one).
ALLOWED = {
    "ir": set(),
    "_version": set(),
    "tracer": {"ir"},
    "solver": {"ir"},
    "executor": {"ir", "tracer"},
    "report": {"ir", "solver"},
    "torch_compile": {"ir", "solver", "tracer", "executor"},
    "enabling": {"ir", "solver", "executor"},
    "api": {"ir", "_version", "solver"},
    "client": {"ir", "api"},
    "<remat>": {
        "ir",
        "_version",
        "solver",
        "report",
        "tracer",
        "executor",
        "torch_compile",
        "enabling",
        "client",
    },
    "pytest_plugin": {"<remat>", "ir", "solver", "tracer", "executor", "report"},
    "cli": set(RANK) - {"cli"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "<remat>"
    return "cli" if parts[1] == "cli" or parts[1].startswith("cli_") else parts[1]


def imported_modules(module: str) -> set[str]:
    """The remat modules ``module`` imports, anywhere in it: ``from remat import solver``
    imports the module ``remat.solver``, ``from remat.ir import Graph`` the package
    ``remat.ir``, ``from . import x`` resolves against the module's own package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{a.name}" for a in node.names} & MODULES.keys()
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(source)
    return {m for m in found if m in MODULES and m != module}


GRAPH = {m: imported_modules(m) for m in MODULES}


def test_every_module_has_a_layer() -> None:
    assert {layer(m) for m in MODULES} <= set(RANK)


def test_the_layers_only_point_down() -> None:
    for name, allowed in ALLOWED.items():
        assert all(RANK[a] < RANK[name] for a in allowed), name


@pytest.mark.parametrize("name", sorted(RANK))
def test_each_layer_imports_only_what_design_allows(name: str) -> None:
    bad = {
        m: sorted({layer(d) for d in deps} - ALLOWED[name] - {name})
        for m, deps in GRAPH.items()
        if layer(m) == name
    }
    bad = {m: layers for m, layers in bad.items() if layers}
    assert not bad, f"imports outside the layering of DESIGN.md: {bad}"


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative: the graph is a few hundred modules deep at most, but recursion is not needed)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_no_module_imports_itself_again_through_others() -> None:
    assert import_circles(GRAPH) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"x": {"y"}, "y": {"x"}}) == [["x", "y"]]
