"""Small sizes of every example model, shared by the executor tests (fast on two cores)."""

from __future__ import annotations

from typing import Any

import pytest

from examples.models import build_gpt, build_mlp, build_resnet, build_unet, build_vit
from remat import solver

SMALL: dict[str, Any] = {
    "mlp": lambda: build_mlp(batch=16, in_features=32, hidden=64, depth=3, classes=10),
    "gpt": lambda: build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=1, n_heads=2),
    "resnet": lambda: build_resnet(batch=2, image=16, width=8, blocks_per_stage=1, stages=2),
    "unet": lambda: build_unet(batch=1, image=16, width=4, depth=2),
    "vit": lambda: build_vit(batch=2, image=16, patch=4, d_model=32, depth=1, n_heads=2),
}

# Solvers named by the issue; those not registered yet are skipped with a reason.
SOLVERS = ["none", "checkpoint-all", "sqrt", "rotor", "milp"]
FRACTIONS = [0.7, 0.5]
MILP_TIME_LIMIT_S = 8.0


def solve_or_skip(name: str, graph: Any, budget: int) -> Any:
    """Solve with ``name``; skip (with the reason) when it is not registered or finds no plan."""
    if name not in solver.available():
        pytest.skip(f"solver {name!r} is not registered")
    opts = {"time_limit_s": MILP_TIME_LIMIT_S} if name == "milp" else {}
    result = solver.get(name)(graph, budget, **opts)
    if result.plan is None:
        pytest.skip(f"{name} returned no plan at this budget ({result.status})")
    return result
