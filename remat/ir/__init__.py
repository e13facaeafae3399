"""The centre of remat: graph and plan types, their JSON form, validation and the simulator.

Imports only the standard library, pydantic and numpy, so the solvers and the service run
without torch.
"""

from remat.ir.budget import format_bytes, parse_budget, parse_bytes, resolve_budget
from remat.ir.builder import Out, StepBuilder
from remat.ir.cuts import Cut, articulation_cuts, block_cuts, block_key, forward_cuts
from remat.ir.devices import PROFILES, get_profile
from remat.ir.errors import (
    GraphTooLargeError,
    GraphValidationError,
    InfeasibleBudgetError,
    InvalidPlanError,
    RematError,
    SolverBugError,
    SolverUnavailableError,
)
from remat.ir.graph import SCHEMA_VERSION, DeviceProfile, Graph, HostLink, Node, Value
from remat.ir.plan import Plan, Step, ValueFate, compute, free, offload, prefetch
from remat.ir.plan_builders import eager_plan, keep_plan
from remat.ir.result import PlanFigures, Progress, SolveResult, Status
from remat.ir.simulate import Simulation, simulate

__all__ = [
    "PROFILES",
    "SCHEMA_VERSION",
    "Cut",
    "DeviceProfile",
    "Graph",
    "GraphTooLargeError",
    "GraphValidationError",
    "HostLink",
    "InfeasibleBudgetError",
    "InvalidPlanError",
    "Node",
    "Out",
    "Plan",
    "PlanFigures",
    "Progress",
    "RematError",
    "Simulation",
    "SolveResult",
    "SolverBugError",
    "SolverUnavailableError",
    "Status",
    "Step",
    "StepBuilder",
    "Value",
    "ValueFate",
    "articulation_cuts",
    "block_cuts",
    "block_key",
    "compute",
    "eager_plan",
    "format_bytes",
    "forward_cuts",
    "free",
    "get_profile",
    "keep_plan",
    "offload",
    "parse_budget",
    "parse_bytes",
    "prefetch",
    "resolve_budget",
    "simulate",
]
