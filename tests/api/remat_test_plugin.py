"""Solvers for the service tests only, loaded by the test server with ``--plugin``.

``test-count`` logs every run (start and end) to a file; ``test-hog`` asks for a lot of memory.
``test-sleep`` reports an incumbent through ``progress``, takes ``sleep_s`` seconds (bounded by
its time limit) and then answers like ``checkpoint-all``: it makes a job that is reliably still running when a test cancels it or
kills the server. ``test-crash`` kills its own process, as a segfaulting native solver would;
``test-bug`` raises a ``ValueError`` of its own, as a solver with an indexing bug would.
Never imported by the test process itself, so the solver contract suite does not see them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from remat.ir import SolveResult, block_cuts, keep_plan
from remat.solver import Problem
from remat.solver.base import register


@register("test-sleep", kind="dag", summary="Test only: sleep, then keep block inputs")
def solve_sleep(
    problem: Problem,
    *,
    sleep_s: float = 1.0,
    progress: Callable[[SolveResult], None] | None = None,
) -> SolveResult:
    """Reports its answer as an incumbent (with a made-up bound of 90% of its time) first."""
    t0 = time.perf_counter()
    graph, time_limit_s = problem.graph, problem.time_limit_s
    plan = keep_plan(graph, {v for c in block_cuts(graph) for v in c.values})
    result = problem.result(plan, solver="test-sleep", started=t0)
    if progress is not None and result.total_time_s is not None:
        bound = 0.9 * result.total_time_s
        progress(result.model_copy(update={"lower_bound_s": bound, "gap": 1 / 0.9 - 1}))
    end = t0 + min(sleep_s, time_limit_s if time_limit_s is not None else sleep_s)
    while time.perf_counter() < end:
        time.sleep(0.05)
    return result


@register("test-crash", kind="baseline", summary="Test only: the worker process dies")
def solve_crash(problem: Problem) -> SolveResult:
    os._exit(13)


@register("test-bug", kind="baseline", summary="Test only: raise ValueError from inside")
def solve_bug(problem: Problem) -> SolveResult:
    raise ValueError("index 7 out of range in stage table")


@register("test-count", kind="baseline", summary="Test only: log each run, sleep, answer")
def solve_count(problem: Problem, *, sleep_s: float = 0.2) -> SolveResult:
    """Appends ``start BUDGET PID`` and ``end BUDGET PID`` lines to ``$REMAT_TEST_RUN_LOG``, so
    a test counts how often each job (told apart by its budget) ran, and where. A run whose
    server or worker died meanwhile (this process was orphaned) writes no ``end``: its answer
    can reach no one."""
    log = os.environ["REMAT_TEST_RUN_LOG"]
    graph, budget_bytes = problem.graph, problem.budget_bytes
    parent = os.getppid()
    with open(log, "a") as f:
        f.write(f"start {budget_bytes} {os.getpid()}\n")
    t0 = time.perf_counter()
    time.sleep(sleep_s)
    plan = keep_plan(graph, {v for c in block_cuts(graph) for v in c.values})
    result = problem.result(plan, solver="test-count", started=t0)
    if os.getppid() != parent:
        os._exit(0)
    with open(log, "a") as f:
        f.write(f"end {budget_bytes} {os.getpid()}\n")
    return result


@register("test-hog", kind="baseline", summary="Test only: allocate memory_bytes at once")
def solve_hog(problem: Problem, *, memory_bytes: int = 2**30) -> SolveResult:
    """Asks for ``memory_bytes`` of memory (as a solver with a runaway option would)."""
    block = bytearray(memory_bytes)
    t0 = time.perf_counter()
    plan = keep_plan(problem.graph, {v for c in block_cuts(problem.graph) for v in c.values})
    del block
    return problem.result(plan, solver="test-hog", started=t0)


@register("test-overrun", kind="baseline", summary="Test only: ignore the time limit")
def solve_overrun(problem: Problem, *, sleep_s: float = 20.0) -> SolveResult:
    """Sleeps ``sleep_s`` whatever its time limit, as a solver stuck in native code would."""
    t0 = time.perf_counter()
    time.sleep(sleep_s)
    plan = keep_plan(problem.graph, {v for c in block_cuts(problem.graph) for v in c.values})
    return problem.result(plan, solver="test-overrun", started=t0)
