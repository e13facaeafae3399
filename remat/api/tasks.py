"""The work a solver worker process does: parse, resolve the budget, solve, report.

These functions run in the worker processes of :mod:`remat.api.pool`, never on the server's
event loop. A task is a plain dict (it crosses a pipe); the answer is the result's JSON text, or
``{"error": {"loc": [...], "msg": ..., "type": ...}}`` for a problem with the request that only
shows once the graph is in hand (a budget fraction, an option the solver rejects).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from remat import solver as solvers
from remat.api.schemas import SolverList
from remat.ir import Graph, RematError, SolverBugError, resolve_budget
from remat.ir.result import Progress as SolveProgress
from remat.ir.result import SolveResult, best_result

DEFAULT_FRONTIER = ["100%", "80%", "60%", "50%", "40%", "30%", "20%", "10%"]

Progress = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Answer:
    """A task's result JSON, and whether the store may answer the same request with it."""

    text: str
    cacheable: bool


class TaskError(Exception):
    """A request problem found in the worker; ``loc`` names the field."""

    def __init__(self, loc: list[str | int], msg: str, type_: str = "value_error") -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg
        self.type = type_


class SolverBug(Exception):
    """A solver raised an error of its own after its options were accepted: the service answers
    500 (a job fails) naming the solver and the error, as for a solver whose process died."""

    def __init__(self, solver: str, exc: Exception) -> None:
        super().__init__(f"solver {solver!r} raised {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _request_errors() -> Iterator[None]:
    """Errors of the request itself (an unknown solver, options it refuses): 422 naming the
    field."""
    try:
        yield
    except RematError as exc:
        raise TaskError(["body", "solver"], str(exc), "solver_error") from None
    except ValueError as exc:
        raise TaskError(["body", "options"], str(exc)) from None


@contextlib.contextmanager
def _solver_errors(solver: str) -> Iterator[None]:
    """Errors while a solver runs on checked options: its own errors stay 422 on the solver,
    but a ``ValueError`` is the solver's bug, not the client's: a failed solve (500), never a
    422 on the options."""
    try:
        yield
    except SolverBugError as exc:  # a plan the simulator rejects: the solver's, not the client's
        raise SolverBug(solver, exc) from exc
    except RematError as exc:
        raise TaskError(["body", "solver"], str(exc), "solver_error") from None
    except ValueError as exc:
        raise SolverBug(solver, exc) from exc


_GRAPHS: OrderedDict[str, Graph] = OrderedDict()
_GRAPHS_KEPT = 4


def _graph(task: dict[str, Any]) -> Graph:
    # A worker often solves the same stored graph again (another budget, a frontier): keep the
    # last few parsed, keyed by content hash, since parsing a large graph costs more than some
    # solves. Tasks without a ``graph_id`` are parsed every time.
    gid = task.get("graph_id")
    if gid is not None and gid in _GRAPHS:
        _GRAPHS.move_to_end(gid)
        return _GRAPHS[gid]
    graph = Graph.from_json(task["graph"])
    if gid is not None:
        _GRAPHS[gid] = graph
        while len(_GRAPHS) > _GRAPHS_KEPT:
            _GRAPHS.popitem(last=False)
    return graph


def _resolve(graph: Graph, spec: Any, loc: list[str | int]) -> int:
    try:
        return resolve_budget(graph, spec)
    except ValueError as exc:
        raise TaskError(loc, str(exc)) from None


def solver_list() -> SolverList:
    """The registry as clients see it (``GET /v1/solvers``, ``remat solvers``): each solver's
    kind, exactness, summary and the options a client may set."""
    return SolverList.model_validate(solvers.solver_listing())


def _solve(
    graph: Graph, budget_bytes: int, task: dict[str, Any], progress: Progress | None = None
) -> SolveResult:
    options = dict(task["options"])
    if progress is not None and solvers.PROGRESS_OPTION in solvers.info(task["solver"]).options:
        started = time.perf_counter()

        def report(r: SolveResult) -> None:
            progress(
                {
                    "stage": "solving",
                    "elapsed_s": time.perf_counter() - started,
                    "best": r.model_dump(mode="json"),
                    "lower_bound_s": r.lower_bound_s,
                    "gap": r.gap,
                }
            )

        options[solvers.PROGRESS_OPTION] = report
    on_progress = None
    if progress is not None:

        def on_progress(p: SolveProgress) -> None:
            # What the solver reports through the problem's callback (incumbent, bound, gap)
            # becomes the job's progress as it is: the same figures as a terminal's bar.
            progress({"stage": "solving", **p.model_dump(mode="json", exclude_none=True)})

    if graph.sharding is not None and graph.sharding.strategy == "fsdp2":
        # One rank's FSDP2 step: solvers.solve plans it in the checkpoint class (the executor
        # that runs under fully_shard), judged with the parameter-window rule.
        with _request_errors():
            solvers.info(task["solver"]).check_options(options)
        with _solver_errors(task["solver"]):
            return solvers.solve(
                graph,
                budget_bytes,
                solver=task["solver"],
                time_limit_s=task["time_limit_s"],
                progress=on_progress,
                **options,
            )
    with _request_errors():
        # The problem is built here rather than by solvers.solve: a solver's own ``progress``
        # option (above) and the problem's callback are two different things.
        si = solvers.info(task["solver"])
        checked = si.check_options(options)
        problem = solvers.Problem.build(
            graph, budget_bytes, time_limit_s=task["time_limit_s"], on_progress=on_progress
        )
    with _solver_errors(task["solver"]):
        return si.solve(problem, checked)


def _incumbent(graph: Graph, budget_bytes: int, progress: Progress, started: float) -> None:
    # A cheap first answer for a job, so that "best plan so far" is there while a slow exact
    # solver works: the better of no-remat and checkpoint-all.
    best = best_result(solvers.get(n)(graph, budget_bytes) for n in ("none", "checkpoint-all"))
    assert best is not None
    progress(
        {
            "stage": "solving",
            "elapsed_s": time.perf_counter() - started,
            "best": best.model_dump(mode="json"),
        }
    )


def run_solve(task: dict[str, Any], progress: Progress | None = None) -> Answer:
    """Solve ``task`` (graph JSON, budget, solver, time limit, options)."""
    started = time.perf_counter()
    graph = _graph(task)
    budget_bytes = _resolve(graph, task["budget"], ["body", "budget"])
    if progress is not None:
        if solvers.info(task["solver"]).kind != "baseline":
            _incumbent(graph, budget_bytes, progress, started)
        else:
            progress({"stage": "solving", "elapsed_s": time.perf_counter() - started})
    result = _solve(graph, budget_bytes, task, progress)
    return Answer(result.model_dump_json(), cacheable=result.status != "timeout")


def run_frontier(task: dict[str, Any], progress: Progress | None = None) -> Answer:
    """Solve ``task`` at each of its budgets (a :class:`~remat.api.schemas.FrontierResult`)."""
    from remat.api.schemas import FrontierPoint, FrontierResult

    started = time.perf_counter()
    graph = _graph(task)
    specs = task["budgets"] or DEFAULT_FRONTIER
    budgets = [_resolve(graph, s, ["body", "budgets", i]) for i, s in enumerate(specs)]

    def on_point(done: int) -> None:  # distinct budgets answered so far
        if progress is not None:
            progress(
                {
                    "stage": "solving",
                    "elapsed_s": time.perf_counter() - started,
                    "points_done": done,
                    "points_total": len(set(budgets)),
                }
            )

    with _request_errors():
        solvers.info(task["solver"]).check_options(dict(task["options"]))
    with _solver_errors(task["solver"]):
        fr = solvers.frontier(
            graph,
            budgets,
            solver=task["solver"],
            time_limit_s=task["time_limit_s"],
            on_point=on_point,
            **task["options"],
        )
    points = [FrontierPoint.of(spec, r) for spec, r in zip(specs, fr.results, strict=True)]
    timed_out = any(p.status == "timeout" for p in points)
    text = FrontierResult(
        solver=task["solver"],
        baseline_time_s=fr.baseline_time_s,
        eager_peak_bytes=fr.eager_peak_bytes,
        static_bytes=graph.static_bytes,
        points=points,
    ).model_dump_json()
    return Answer(text, cacheable=not timed_out)


RUNNERS: dict[str, Callable[[dict[str, Any], Progress | None], Answer]] = {
    "solve": run_solve,
    "frontier": run_frontier,
}


def run_task(task: dict[str, Any], progress: Progress | None = None) -> dict[str, Any]:
    """Run one task: ``{"ok": json_text, "cacheable": bool}`` or ``{"error": {...}}`` naming
    the field. ``cacheable`` is False for an answer that another try may improve (a solver
    that ran out of time)."""
    if task["kind"] == "parse":
        from remat.api.parse import parse_body

        return parse_body(task["body_kind"], task["body"], task["max_nodes"], task["max_values"])
    try:
        answer = RUNNERS[task["kind"]](task, progress)
        return {"ok": answer.text, "cacheable": answer.cacheable}
    except TaskError as exc:
        return {"error": {"loc": exc.loc, "msg": exc.msg, "type": exc.type}}
    except SolverBug as exc:
        return {"crash": str(exc)}
    except (RematError, ValueError) as exc:
        return {"error": {"loc": ["body"], "msg": str(exc), "type": type(exc).__name__}}
