"""``make demo``'s solver table: every registered solver, none of them crashing the demo."""

from __future__ import annotations

from examples.demo import FRACTIONS, solver_table
from remat import solver
from remat.ir.synthetic import transformer


def test_the_table_runs_every_registered_solver_and_shows_a_refusal() -> None:
    # make demo crashed on its 290-node GPT: poet refuses graphs over 16 nodes by raising
    # GraphTooLargeError, and the table let it through
    g = transformer(2)
    assert g.num_nodes > 16
    names = [n for n in solver.available() if n in ("poet", "rotor")]
    assert "poet" in names
    lines, results = solver_table(g, names)
    refused = [ln for ln in lines if ln.startswith("poet") and "refused" in ln]
    assert len(refused) == len(FRACTIONS)
    assert any("max_nodes=16" in ln for ln in lines)
    for frac in FRACTIONS:
        assert set(results[frac]) == {"rotor"}
