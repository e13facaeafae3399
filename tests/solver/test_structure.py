"""The solver package's shape (issue 9, item 4): one module for the chain DP, one file per
chain method on top of it, one frozen MILP index shared by ``milp`` and ``lp-round``."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import remat.solver
from remat.ir.synthetic import transformer
from remat.solver.checkmate import CheckmateModel
from remat.solver.milp_index import MilpIndex

SOLVER_DIR = Path(remat.solver.__file__).parent


def _imported_names(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("remat."):
            out.extend((node.module, a.name) for a in node.names)
    return out


@pytest.mark.parametrize("path", sorted(SOLVER_DIR.glob("*.py")), ids=lambda p: p.name)
def test_no_solver_module_imports_anothers_privates(path: Path) -> None:
    for module, name in _imported_names(path):
        assert not name.startswith("_"), f"{path.name} imports private {name} from {module}"


def test_each_chain_method_sits_on_the_shared_dp() -> None:
    for name in ("rotor", "revolve", "pofo"):
        mods = {m for m, _ in _imported_names(SOLVER_DIR / f"{name}.py")}
        assert "remat.solver.chain_dp" in mods, name
    lp = {m for m, _ in _imported_names(SOLVER_DIR / "lp_round.py")}
    assert "remat.solver.milp_index" in lp


def test_index_and_model_are_frozen() -> None:
    g = transformer(1, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2)
    ix = MilpIndex.of(g, recompute_backward=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ix.rerun = ()  # type: ignore[misc]
    cm = CheckmateModel.build(g, 10**9, recompute_backward=True, index=ix)
    assert cm.index is ix
    with pytest.raises(dataclasses.FrozenInstanceError):
        cm.budget_bytes = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="index"):
        CheckmateModel.build(g, 10**9, recompute_backward=False, index=ix)
