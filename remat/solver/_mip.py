"""A small sparse MILP container with two back ends: HiGHS (through ``highspy``) and CBC
(through pulp).

The Checkmate model is built once as columns and rows of plain numbers, then handed to the
solver that was asked for. Using ``highspy`` directly keeps model building fast for ~10^5
variables and gives the MIP dual bound, which pulp does not expose.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from remat.ir import SolverUnavailableError

_banner_lock = threading.Lock()
_banner_done = False


def _new_highs(highspy: Any) -> Any:
    """A ``highspy.Highs``, without the two-line banner its C++ constructor writes to the
    process's standard output the first time (before any option can turn output off): remat's
    own output (the command line's tables, ``--json``) stays its own."""
    global _banner_done
    with _banner_lock:
        if _banner_done:
            return highspy.Highs()
        _banner_done = True
        sys.stdout.flush()
        try:
            saved = os.dup(1)
        except OSError:  # no standard output to guard
            return highspy.Highs()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            return highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)


Backend = Literal["highs", "cbc"]
IncumbentCallback = Callable[[float, float | None], None]
MipStatus = Literal["optimal", "feasible", "infeasible", "timeout", "error"]


@dataclass(frozen=True)
class MipSolution:
    """What a back end found. ``values`` is None when it found no solution."""

    status: MipStatus
    values: np.ndarray | None
    objective: float | None
    bound: float | None
    """A proven lower bound on the optimum (the LP value for a relaxation)."""
    solve_time_s: float
    message: str = ""


@dataclass
class SparseModel:
    """Minimise ``cost @ x + offset`` subject to ``row_lo <= A x <= row_hi`` and bounds."""

    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    offset: float = 0.0
    row_start: list[int] = field(default_factory=lambda: [0])
    row_index: list[int] = field(default_factory=list)
    row_value: list[float] = field(default_factory=list)
    row_lo: list[float] = field(default_factory=list)
    row_hi: list[float] = field(default_factory=list)

    @property
    def num_cols(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.row_lo)

    @property
    def num_integer(self) -> int:
        return sum(self.integer)

    def add_col(
        self, name: str, lo: float, hi: float, *, integer: bool = False, cost: float = 0.0
    ) -> int:
        self.lower.append(lo)
        self.upper.append(hi)
        self.cost.append(cost)
        self.integer.append(integer)
        self.names.append(name)
        return len(self.lower) - 1

    def add_row(self, terms: Iterable[tuple[int, float]], lo: float, hi: float) -> None:
        """Add ``lo <= sum(coef * x[col]) <= hi``; repeated columns are summed."""
        acc: dict[int, float] = {}
        for c, a in terms:
            acc[c] = acc.get(c, 0.0) + a
        for c, a in acc.items():
            if a != 0.0:
                self.row_index.append(c)
                self.row_value.append(a)
        self.row_start.append(len(self.row_index))
        self.row_lo.append(lo)
        self.row_hi.append(hi)

    # -- back ends ----------------------------------------------------------------------------

    def solve(
        self,
        *,
        backend: Backend = "highs",
        relax: bool = False,
        time_limit_s: float | None = None,
        threads: int | None = None,
        rel_gap: float = 1e-6,
        start: dict[int, float] | None = None,
        on_incumbent: IncumbentCallback | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> MipSolution:
        """Solve; ``start`` (column -> value, possibly partial) is a MIP start for HiGHS,
        which completes a partial one itself. With HiGHS, ``on_incumbent(objective, bound)``
        is called for each improving solution (model units, offset included) and ``stop()``
        is polled while the MIP runs: True interrupts it (the best solution so far is kept)."""
        if backend == "highs":
            return self._solve_highs(
                relax, time_limit_s, threads, rel_gap, start, on_incumbent, stop
            )
        if backend == "cbc":
            return self._solve_cbc(relax, time_limit_s, threads, rel_gap)
        raise ValueError(f"solver: unknown MILP back end {backend!r} (use 'highs' or 'cbc')")

    def _solve_highs(
        self,
        relax: bool,
        time_limit_s: float | None,
        threads: int | None,
        rel_gap: float,
        start: dict[int, float] | None = None,
        on_incumbent: IncumbentCallback | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> MipSolution:
        try:
            import highspy
        except ImportError as exc:  # pragma: no cover - highspy is a dependency
            raise SolverUnavailableError("the HiGHS back end needs highspy") from exc
        t0 = time.perf_counter()
        h = _new_highs(highspy)
        h.setOptionValue("output_flag", False)
        if time_limit_s is not None:
            h.setOptionValue("time_limit", float(max(time_limit_s, 0.01)))
        if threads is not None:
            h.setOptionValue("threads", int(threads))
        h.setOptionValue("mip_rel_gap", rel_gap)
        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_ = self.num_cols
        lp.num_row_ = self.num_rows
        lp.col_cost_ = np.asarray(self.cost, dtype=np.float64)
        lp.col_lower_ = np.asarray(self.lower, dtype=np.float64)
        lp.col_upper_ = np.asarray(self.upper, dtype=np.float64)
        lp.row_lower_ = np.asarray([-inf if math.isinf(x) else x for x in self.row_lo])
        lp.row_upper_ = np.asarray([inf if math.isinf(x) else x for x in self.row_hi])
        lp.offset_ = self.offset
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.asarray(self.row_start, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(self.row_index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(self.row_value, dtype=np.float64)
        if not relax and any(self.integer):
            lp.integrality_ = [
                highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                for b in self.integer
            ]
        h.passModel(lp)
        if on_incumbent is not None and not relax:

            def improving(e: object) -> None:
                try:  # a report must never break the solve
                    out = e.data_out  # type: ignore[attr-defined]
                    obj, b = float(out.objective_function_value), float(out.mip_dual_bound)
                    if math.isfinite(obj):
                        on_incumbent(obj, b if math.isfinite(b) else None)
                except Exception:  # pragma: no cover - defensive
                    pass

            h.cbMipImprovingSolution.subscribe(improving)
        if stop is not None and not relax:

            def interrupt(e: object) -> None:
                if stop():
                    e.data_in.user_interrupt = True  # type: ignore[attr-defined]

            h.cbMipInterrupt.subscribe(interrupt)
        if start and not relax:
            idx = np.fromiter(start.keys(), dtype=np.int32, count=len(start))
            val = np.fromiter(start.values(), dtype=np.float64, count=len(start))
            h.setSolution(len(start), idx, val)
        h.run()
        ms = h.getModelStatus()
        info = h.getInfo()
        elapsed = time.perf_counter() - t0
        S = highspy.HighsModelStatus
        has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
        values = np.asarray(h.getSolution().col_value, dtype=np.float64) if has_sol else None
        obj = float(info.objective_function_value) if has_sol else None
        is_mip = not relax and any(self.integer)
        bound: float | None
        if is_mip:
            b = float(info.mip_dual_bound)
            bound = b if math.isfinite(b) else None
        else:
            bound = obj if ms == S.kOptimal else None
        if ms == S.kOptimal:
            return MipSolution("optimal", values, obj, bound if bound is not None else obj, elapsed)
        if ms == S.kInfeasible:
            return MipSolution("infeasible", None, None, None, elapsed, "the model is infeasible")
        if ms in (S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit, S.kInterrupt):
            st: MipStatus = "feasible" if values is not None else "timeout"
            return MipSolution(st, values, obj, bound, elapsed, h.modelStatusToString(ms))
        return MipSolution("error", values, obj, bound, elapsed, h.modelStatusToString(ms))

    def _solve_cbc(
        self, relax: bool, time_limit_s: float | None, threads: int | None, rel_gap: float
    ) -> MipSolution:
        import pulp

        t0 = time.perf_counter()
        prob = pulp.LpProblem("remat", pulp.LpMinimize)
        xs = [
            pulp.LpVariable(
                f"x{i}",
                lowBound=None if math.isinf(self.lower[i]) else self.lower[i],
                upBound=None if math.isinf(self.upper[i]) else self.upper[i],
                cat=pulp.LpInteger if (self.integer[i] and not relax) else pulp.LpContinuous,
            )
            for i in range(self.num_cols)
        ]
        prob += pulp.lpSum(c * xs[i] for i, c in enumerate(self.cost) if c) + self.offset
        for r in range(self.num_rows):
            a, b = self.row_start[r], self.row_start[r + 1]
            expr = pulp.lpSum(self.row_value[k] * xs[self.row_index[k]] for k in range(a, b))
            lo, hi = self.row_lo[r], self.row_hi[r]
            if lo == hi:
                prob += expr == lo
            else:
                if not math.isinf(lo):
                    prob += expr >= lo
                if not math.isinf(hi):
                    prob += expr <= hi
        solver = pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, threads=threads, gapRel=rel_gap
        )
        prob.solve(solver)
        elapsed = time.perf_counter() - t0
        # pulp trap: LpStatus says "Optimal" at a time limit; sol_status tells (1 proven,
        # 2 feasible only).
        if prob.status == pulp.LpStatusInfeasible:
            return MipSolution("infeasible", None, None, None, elapsed, "the model is infeasible")
        if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            values = np.asarray([x.varValue or 0.0 for x in xs], dtype=np.float64)
            obj = float(pulp.value(prob.objective))
            if prob.sol_status == pulp.LpSolutionOptimal:
                return MipSolution("optimal", values, obj, obj, elapsed)
            return MipSolution("feasible", values, obj, None, elapsed, "CBC stopped early")
        return MipSolution("timeout", None, None, None, elapsed, pulp.LpStatus[prob.status])
