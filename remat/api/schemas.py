"""Request and response bodies of the service, named for their role.

Only pydantic and the torch-free core are imported here, so :mod:`remat.client` can use these
types without FastAPI.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from remat.ir import Graph, PlanFigures, SolveResult

# A budget as the API takes it: exactly the forms its schema states, so that a client (or a
# fuzzer) that follows the schema is never refused for the form of its budget.
# A quantity (remat.ir.parse_budget's forms): with a unit; bare, whole bytes (not "1", which
# could mean one byte or the whole peak); or a bare fraction below 1 ("0.5", ".5"). Spaces are
# JSON's four: regular expressions disagree on what else \s means.
_WS = r"[ \t\n\r]*"
_UNIT = r"(?:[bB]|[kKmMgG][bB]|[kKmMgG][iI][bB])"
_QUANTITY = (
    _WS
    + r"(?:[0-9]{1,9}(?:\.[0-9]{1,6})?"
    + _WS
    + _UNIT
    + r"|(?!0*1(?![0-9.]))[0-9]{1,9}(?:\.0{1,6})?|0{0,9}\.[0-9]{1,6})"
    + _WS
)
_PERCENT = (
    _WS
    + r"(?:100(?:\.0{1,6})?|(?!0*(?:\.0*)?"
    + _WS
    + r"%)[0-9]{1,2}(?:\.[0-9]{1,6})?)"
    + _WS
    + "%"
    + _WS
)
BUDGET_PATTERN = f"^(?:{_QUANTITY}|{_PERCENT})$"
_BUDGET_RX = re.compile(BUDGET_PATTERN)
_BUDGET_DOC = (
    "Total device bytes (an integer), a quantity such as '12GiB' (B, kB, MB, GB, KiB, MiB, "
    "GiB), a percentage in (0, 100] such as '70%', or a fraction in (0, 1] of the no-remat "
    "dynamic peak (plus static bytes). A whole-number float other than 1.0 (4096.0) is bytes."
)


def _budget_form(v: int | float | str) -> int | float | str:
    # One check after the union, so an error names the field itself (not a union member).
    if isinstance(v, float) and v.is_integer() and v != 1.0:
        # JSON Schema counts a whole-number float as an integer, so 4096.0 is bytes, as the
        # schema says; 1.0 matches both forms and stays the fraction (all of the peak).
        v = int(v)
    if isinstance(v, int) and not 0 <= v <= 2**60:
        raise ValueError(f"budget: {v} bytes is outside [0, 2**60]")
    if isinstance(v, float) and not 0 < v <= 1:
        raise ValueError(f"budget: a fraction must be in (0, 1], got {v!r}")
    if isinstance(v, str) and (len(v) > 40 or not _BUDGET_RX.match(v)):
        raise ValueError(f"budget: not a quantity ('12GiB') or a percentage ('70%'): {v!r}")
    return v


BudgetSpec = Annotated[
    StrictInt | StrictFloat | StrictStr,
    AfterValidator(_budget_form),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 2**60},
                {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                {"type": "string", "pattern": BUDGET_PATTERN, "maxLength": 40},
            ],
            "description": _BUDGET_DOC,
        }
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
    model_config = ConfigDict(extra="forbid", frozen=True, regex_engine="python-re")


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
        # Absent, not null: the schema says an object or an id (and exactly one of them). (An
        # "after" check: a "before" one would make strict JSON parsing refuse arrays as tuples.)
        for key in ("graph", "graph_id"):
            if key in self.model_fields_set and getattr(self, key) is None:
                raise ValueError(f"'{key}': leave it out instead of sending null")
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
    """Where a running job stands: the solver's latest report (its phase, the incumbent's
    overhead and peak, the bound and the gap: :class:`remat.ir.Progress`), or a first cheap
    plan (``best``) before the solver reports."""

    stage: str
    elapsed_s: float = 0.0
    best: SolveResult | None = None
    solver: str | None = None
    phase: str | None = None
    time_limit_s: float | None = None
    incumbent_overhead: float | None = None
    incumbent_peak_bytes: int | None = None
    lower_bound_s: float | None = None
    gap: float | None = None
    message: str | None = None
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
    status: Literal["ok", "unavailable"]
    store: Literal["ok", "unavailable"] = "ok"
    message: str = ""
    version: str
    workers: int
    busy_workers: int
    queued: int


class ErrorItem(BaseModel):
    """One problem with a request: ``loc`` is the path of the field at fault."""

    loc: list[str | int]
    msg: str
    type: str


def check_magnitudes(graph: Graph, at: tuple[str, ...] = ("body",)) -> list[ErrorItem]:
    """Numbers out of the range the service accepts (negative, or too large for any real step:
    see ``MAX_BYTES``), each with its field's path (under ``at``, the graph's own path in the
    request). The OpenAPI document states the same bounds."""
    errs: list[ErrorItem] = []

    def bad(loc: list[str | int], msg: str) -> None:
        errs.append(ErrorItem(loc=[*at, *loc], msg=msg, type="value_error.out_of_range"))

    def check(loc: list[str | int], what: str, x: float, top: float) -> None:
        if not (math.isfinite(x) and 0 <= x <= top):
            bad(loc, f"{what} must be in [0, {top:g}], got {x!r}")

    check(["static_bytes"], "static_bytes", graph.static_bytes, MAX_BYTES)
    for i, v in enumerate(graph.values):
        check(["values", i, "size_bytes"], f"value {v.id!r}: size_bytes", v.size_bytes, MAX_BYTES)
        if len(errs) >= 10:
            return errs
    for i, n in enumerate(graph.nodes):
        name = f"node {n.id!r}"
        ws = n.workspace_bytes
        check(["nodes", i, "workspace_bytes"], f"{name}: workspace_bytes", ws, MAX_BYTES)
        check(["nodes", i, "time_s"], f"{name}: time_s", n.time_s, MAX_TIME_S)
        check(["nodes", i, "flops"], f"{name}: flops", n.flops, MAX_FLOPS)
        if len(errs) >= 10:
            return errs
    if graph.device is not None:
        d = graph.device
        nums: list[tuple[str, float]] = [
            ("memory_bandwidth_bytes_per_s", d.memory_bandwidth_bytes_per_s),
            ("host_bandwidth_bytes_per_s", d.host_bandwidth_bytes_per_s),
            *((f"peak_flops_per_s.{k}", x) for k, x in d.peak_flops_per_s.items()),
        ]
        if d.host_link is not None:
            nums += [
                ("host_link.device_to_host_bytes_per_s", d.host_link.device_to_host_bytes_per_s),
                ("host_link.host_to_device_bytes_per_s", d.host_link.host_to_device_bytes_per_s),
            ]
            link, loc = d.host_link, ["device", "host_link"]
            check([*loc, "latency_s"], "device host_link.latency_s", link.latency_s, MAX_TIME_S)
            if link.host_memory_bytes is not None:
                what = "device host_link.host_memory_bytes"
                check([*loc, "host_memory_bytes"], what, link.host_memory_bytes, MAX_BYTES)
        for name, x in nums:
            if not (math.isfinite(x) and 0 < x <= 1e30):
                bad(["device", name], f"device {name} must be a positive finite number")
    return errs
