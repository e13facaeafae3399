"""Who imports whom (DESIGN.md): ir is the centre; tracer, solver, executor and api depend on it
and not on each other, except api -> solver and executor -> tracer (the op-level executor runs
plans over the tracer's captured graph); report (pages, plots, progress) reads ir and runs
solvers for its frontier."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "remat"
ALLOWED = {
    "ir": {"ir"},
    "solver": {"ir", "solver"},
    "tracer": {"ir", "tracer"},
    "executor": {"ir", "executor", "tracer"},
    "api": {"ir", "solver", "api"},
    "report": {"ir", "solver", "report"},
}


def remat_imports(path: Path) -> set[str]:
    """Subpackages of remat a module imports, anywhere in it (lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = (
                [node.module] if node.module != "remat" else [f"remat.{a.name}" for a in node.names]
            )
        for name in names:
            parts = name.split(".")
            if parts[0] == "remat" and not (len(parts) > 1 and parts[1] == "__version__"):
                found.add(parts[1] if len(parts) > 1 else "<remat>")
    return found


# One lazy exception: a result's notebook view (SolveResult._repr_html_) draws with the report
# package when matplotlib is there and falls back to text when it is not.
LAZY = {"ir/result.py": {"report"}}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_design_allows(package: str) -> None:
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        lazy = LAZY.get(str(path.relative_to(ROOT)), set())
        extra = remat_imports(path) - ALLOWED[package] - lazy
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"imports outside the layering of DESIGN.md: {bad}"
