"""Small sizes of every example model, shared by the executor tests (fast on two cores)."""

from __future__ import annotations

from typing import Any

from examples.models import build_gpt, build_mlp, build_resnet, build_unet, build_vit
from remat import solver

SMALL: dict[str, Any] = {
    "mlp": lambda: build_mlp(batch=16, in_features=32, hidden=64, depth=3, classes=10),
    "gpt": lambda: build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=1, n_heads=2),
    "resnet": lambda: build_resnet(batch=2, image=16, width=8, blocks_per_stage=1, stages=2),
    "unet": lambda: build_unet(batch=1, image=16, width=4, depth=2),
    "vit": lambda: build_vit(batch=2, image=16, patch=4, d_model=32, depth=1, n_heads=2),
}

SOLVERS = ["none", "checkpoint-all", "sqrt", "rotor", "milp"]
FRACTIONS = [0.7, 0.5]
MILP_TIME_LIMIT_S = 8.0

# (model, solver, fraction) -> the status of a solve that finds no plan, as it answers today.
# rotor and pofo see the ViT as a chain whose stages cannot fit; the MILP proves its class
# empty. A case that changes (a plan where there was none, or none where there was one) fails:
# update the table with what was measured.
NO_PLAN: dict[tuple[str, str, float], str] = {
    ("mlp", "milp", 0.5): "infeasible",
    ("resnet", "milp", 0.5): "infeasible",
    ("vit", "rotor", 0.7): "infeasible",
    ("vit", "rotor", 0.5): "infeasible",
    ("vit", "milp", 0.5): "infeasible",
    ("vit", "pofo", 0.7): "infeasible",
    ("vit", "pofo", 0.5): "infeasible",
}
# Cases where the MILP may run out of MILP_TIME_LIMIT_S before it has a plan, depending on the
# machine's load (on 2 cores: the GPT at 50% does); with a plan they are checked in full.
MAY_TIME_OUT = {("gpt", "milp", 0.5)}


def solve_expected(model: str, name: str, graph: Any, budget: int, frac: float) -> Any:
    """Solve ``model``'s graph with solver ``name`` at ``budget`` (``frac`` of the activation
    peak). Returns the result when it has a plan; None when it has none and :data:`NO_PLAN`
    (or :data:`MAY_TIME_OUT`) says so, the status checked. Any other missing plan fails."""
    opts = {"time_limit_s": MILP_TIME_LIMIT_S} if name == "milp" else {}
    result = solver.get(name)(graph, budget, **opts)
    key = (model, name, frac)
    if result.plan is not None:
        assert key not in NO_PLAN, f"{key} now finds a plan ({result.status}): update NO_PLAN"
        return result
    if key in MAY_TIME_OUT and result.status == "timeout":
        return None
    assert key in NO_PLAN, f"{name} returned no plan for {model} at {frac} ({result.status})"
    assert result.status == NO_PLAN[key], (key, result.status)
    return None
