"""Request and response bodies of the service, named for their role.

Only pydantic and the torch-free core are imported here, so :mod:`remat.client` can use these
types without FastAPI.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from remat.ir import Graph, PlanFigures, SolveResult

BudgetSpec = Annotated[
    StrictInt | StrictFloat | StrictStr,
    Field(
        description="Total device bytes (an integer), a quantity such as '12GiB', a percentage "
        "such as '70%', or a fraction in (0, 1] of the no-remat dynamic peak (plus static bytes)."
    ),
]
OptionValue = StrictInt | StrictFloat | StrictStr | bool | None
GraphId = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of canonical JSON")]
JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]

# Magnitudes beyond these cannot be a real training step and would overflow the simulator's
# sums; such graphs are rejected with the field named instead of failing deep inside a solver.
MAX_BYTES = 2**60
MAX_TIME_S = 1e7
MAX_FLOPS = 2**62


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _finite_positive(v: float | None, field: str) -> float | None:
    if v is not None and not (math.isfinite(v) and v > 0):
        raise ValueError(f"{field} must be a positive finite number, got {v!r}")
    return v


class GraphRef(_Strict):
    """A graph inline (``graph``) or stored earlier (``graph_id``): exactly one of them."""

    graph: Graph | None = None
    graph_id: GraphId | None = None

    @model_validator(mode="after")
    def _one_graph(self) -> GraphRef:
        if (self.graph is None) == (self.graph_id is None):
            raise ValueError("give exactly one of 'graph' (inline) or 'graph_id' (stored)")
        return self


class SolveRequest(GraphRef):
    """Solve one graph at one budget."""

    budget: BudgetSpec
    solver: str | None = Field(
        default=None,
        max_length=100,
        description="A registered solver name (GET /v1/solvers); default 'auto'.",
    )
    time_limit_s: float | None = Field(
        default=None, description="Solver time limit; default: the service's default_time_limit_s."
    )
    options: dict[str, OptionValue] = Field(
        default_factory=dict, description="Options of the named solver (see GET /v1/solvers)."
    )

    @field_validator("time_limit_s")
    @classmethod
    def _time_limit(cls, v: float | None) -> float | None:
        return _finite_positive(v, "time_limit_s")


class SolveResponse(_Strict):
    """A solve's answer: the result with its plan, and whether it came from the store."""

    graph_id: str
    request_key: str
    cached: bool
    result: SolveResult


class FrontierRequest(GraphRef):
    """Solve one graph at several budgets: the budget/time trade-off curve."""

    budgets: list[BudgetSpec] | None = Field(
        default=None,
        description="Budgets to solve at; default: 100%, 80%, 60%, 50%, 40%, 30%, 20%, 10%.",
    )
    solver: str | None = Field(default=None, max_length=100)
    time_limit_s: float | None = Field(
        default=None,
        description="Time limit per budget; default: the synchronous cap shared by all budgets.",
    )
    options: dict[str, OptionValue] = Field(default_factory=dict)

    @field_validator("time_limit_s")
    @classmethod
    def _time_limit(cls, v: float | None) -> float | None:
        return _finite_positive(v, "time_limit_s")


class FrontierPoint(_Strict):
    """One budget of a frontier: the simulator's figures of the plan found (not the plan)."""

    budget: int | float | str
    budget_bytes: int
    status: str
    solver: str
    figures: PlanFigures | None = None
    overhead: float | None = None
    lower_bound_s: float | None = None
    gap: float | None = None
    min_budget_bytes: int | None = None
    min_budget_lower_bytes: int | None = None
    solve_time_s: float = 0.0

    @classmethod
    def of(cls, budget: int | float | str, result: SolveResult) -> FrontierPoint:
        """The point of ``result``, solved for the budget spec ``budget``."""
        return cls(
            budget=budget,
            budget_bytes=result.budget_bytes,
            status=result.status,
            solver=result.solver,
            figures=result.figures,
            overhead=result.overhead,
            lower_bound_s=result.lower_bound_s,
            gap=result.gap,
            min_budget_bytes=result.min_budget_bytes,
            min_budget_lower_bytes=result.min_budget_lower_bytes,
            solve_time_s=result.solve_time_s,
        )

    @property
    def peak_bytes(self) -> int | None:
        return None if self.figures is None else self.figures.peak_bytes

    @property
    def total_time_s(self) -> float | None:
        return None if self.figures is None else self.figures.total_time_s


class FrontierResult(_Strict):
    """The points of a frontier, in the order of the requested budgets."""

    solver: str
    baseline_time_s: float
    eager_peak_bytes: int
    static_bytes: int
    points: list[FrontierPoint]


class FrontierResponse(_Strict):
    graph_id: str
    request_key: str
    cached: bool
    result: FrontierResult


class GraphSummary(_Strict):
    """What the service knows about a stored graph without sending it back."""

    id: str
    name: str
    num_nodes: int
    num_values: int
    num_forward_nodes: int
    num_backward_nodes: int
    static_bytes: int
    input_bytes: int
    activation_bytes: int
    compute_time_s: float
    flops: int
    device: str | None
    no_remat_peak_bytes: int = Field(description="Peak of the eager schedule (static + dynamic).")
    created: bool = Field(default=False, description="True when this request stored it.")


class JobProgress(_Strict):
    """Where a running job stands: the best plan found so far, with its bound and gap."""

    stage: str
    elapsed_s: float = 0.0
    best: SolveResult | None = None
    lower_bound_s: float | None = None
    gap: float | None = None
    points_done: int | None = None
    points_total: int | None = None


class JobResponse(_Strict):
    """A job: its state, the progress of a running one, the result of a finished one."""

    id: str
    kind: Literal["solve", "frontier"]
    status: JobStatus
    graph_id: str
    request_key: str
    created_at: float
    updated_at: float
    attempts: int
    message: str = ""
    error: str | None = None
    progress: JobProgress | None = None
    result: SolveResult | FrontierResult | None = None


class JobList(_Strict):
    jobs: list[JobResponse]


class SolverDescription(_Strict):
    name: str
    kind: str
    exact: bool
    summary: str
    options: list[str]


class SolverList(_Strict):
    default: str
    solvers: list[SolverDescription]


class Health(_Strict):
    status: Literal["ok"]
    version: str
    workers: int
    busy_workers: int
    queued: int


class ErrorItem(BaseModel):
    """One problem with a request: ``loc`` is the path of the field at fault."""

    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: ``detail`` is a message, or a list of fields at fault (422)."""

    detail: str | list[ErrorItem]


def check_magnitudes(graph: Graph, at: tuple[str, ...] = ("body",)) -> list[ErrorItem]:
    """Numbers too large for any real step (see ``MAX_BYTES``), each with its field's path
    (under ``at``, the graph's own path in the request)."""
    errs: list[ErrorItem] = []

    def bad(loc: list[str | int], msg: str) -> None:
        errs.append(ErrorItem(loc=[*at, *loc], msg=msg, type="value_error.too_large"))

    if graph.static_bytes > MAX_BYTES:
        bad(["static_bytes"], f"static_bytes exceeds {MAX_BYTES}")
    for i, v in enumerate(graph.values):
        if v.size_bytes > MAX_BYTES:
            bad(["values", i, "size_bytes"], f"value {v.id!r}: size_bytes exceeds {MAX_BYTES}")
    for i, n in enumerate(graph.nodes):
        if n.workspace_bytes > MAX_BYTES:
            bad(["nodes", i, "workspace_bytes"], f"node {n.id!r}: workspace_bytes too large")
        if n.time_s > MAX_TIME_S:
            bad(["nodes", i, "time_s"], f"node {n.id!r}: time_s exceeds {MAX_TIME_S:g}")
        if n.flops > MAX_FLOPS:
            bad(["nodes", i, "flops"], f"node {n.id!r}: flops exceeds {MAX_FLOPS}")
        if len(errs) >= 10:
            break
    if graph.device is not None:
        d = graph.device
        nums: list[tuple[str, float]] = [
            ("memory_bandwidth_bytes_per_s", d.memory_bandwidth_bytes_per_s),
            ("host_bandwidth_bytes_per_s", d.host_bandwidth_bytes_per_s),
            *((f"peak_flops_per_s.{k}", x) for k, x in d.peak_flops_per_s.items()),
        ]
        for name, x in nums:
            if not (math.isfinite(x) and x > 0):
                bad(["device", name], f"device {name} must be a positive finite number")
    return errs
