"""Checkmate's model and plans: a plan of the model's class as a MIP start, and a 0/1 solution
read back as a plan with the model's own peak and time figures (the model itself is
:mod:`remat.solver.checkmate`).

References
----------
P. Jain, A. Jain, A. Nrusimha, A. Gholami, P. Abbeel, K. Keutzer, I. Stoica, J. E. Gonzalez.
"Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization." MLSys 2020.
"""

from __future__ import annotations

import numpy as np

from remat.ir import Plan, Step
from remat.solver.checkmate import CheckmateModel, Ref, blockers, is_var
from remat.solver.deadline import Deadline

# -- a plan as a MIP start ------------------------------------------------------------------


def start_from_plan(
    cm: CheckmateModel,
    plan: Plan,
    *,
    deadline: Deadline | None = None,
) -> dict[int, float] | None:
    """A MIP start (values of ``R`` and ``S``) from a plan of the model's class, or None
    when the plan is outside it (offloads, a recomputation the model does not allow, or
    keep decisions that the merged ``S`` variables cannot express).

    Linear in the plan's steps and the model's ``S`` entries (each stage's entries are
    read once, when the frontier reaches it). Raises :class:`Expired` when ``deadline``
    passes (checked every 1024 steps)."""
    g = cm.graph
    n = g.num_nodes
    R, by_stage = cm.vars.R, cm.vars.by_stage
    outs = cm.index.outs
    start: dict[int, float] = dict.fromkeys(R.values(), 0.0)
    s_val: dict[int, float] = {}
    resident: set[str] = set()
    frontier = 0
    snap_due = True

    def snapshot(t: int) -> bool:
        for v, ref in by_stage[t]:
            if not is_var(ref):
                continue
            want = 1.0 if v in resident else 0.0
            if s_val.setdefault(ref[0], want) != want:
                return False
        return True

    for i, step in enumerate(plan.steps):
        if deadline is not None and i % 1024 == 0:
            deadline.check("the MIP start from a plan")
        if step.op in ("offload", "prefetch"):
            return None
        if step.op == "free":
            resident.discard(step.id)
            continue
        k = g.node_position(step.id)
        if snap_due and frontier < n:
            if not snapshot(frontier):
                return None
            snap_due = False
        if k == frontier:
            frontier += 1
            snap_due = True
        elif k < frontier:
            c = R.get((frontier, k))
            if c is None:
                return None
            start[c] = 1.0
        else:
            return None
        resident.update(outs[k])
    if frontier != n:
        return None
    start.update(s_val)
    return start


# -- reading a solution back ----------------------------------------------------------------


def replay(cm: CheckmateModel, x: np.ndarray) -> tuple[Plan, int, float]:
    """The plan of a 0/1 solution, with the model's peak (total bytes) and time.

    Values are freed exactly where the model allows it (``F`` at its upper bound), which is
    what the memory constraints assume at most; the peak is computed with the model's own
    arithmetic (stage residency from ``S``, allocation ``R and not resident``, workspace
    while running), independently of the simulator.
    """
    g = cm.graph
    ix, V = cm.index, cm.vars
    n = g.num_nodes

    def val(r: Ref) -> int:
        return round(float(x[r[0]])) if is_var(r) else round(r[1])

    steps: list[Step] = []
    peak = 0
    time_s = 0.0
    for t in range(n):
        ev = [k for k in V.events[t] if val(V.r(t, k))]
        in_stage = set(ev)
        resident = {v for v, ref in V.by_stage[t] if val(ref)}
        cur = sum(ix.size[v] for v in resident)
        for k in ev:
            steps.append(Step(op="compute", id=g.nodes[k].id))
            time_s += g.nodes[k].time_s
            for w in ix.outs[k]:
                if w not in resident:
                    resident.add(w)
                    cur += ix.size[w]
            peak = max(peak, cur + g.nodes[k].workspace_bytes)
            for v in dict.fromkeys([*ix.ins[k], *ix.outs[k]]):
                if v in ix.required or v not in resident:
                    continue
                hard, soft, rp = blockers(V, ix, t, v, k, in_stage)
                if any(val(b) for b in hard) or (any(val(b) for b in soft) and not val(rp)):
                    continue
                resident.discard(v)
                cur -= ix.size[v]
                steps.append(Step(op="free", id=v))
    return Plan(steps=tuple(steps)), g.static_bytes + ix.input_bytes + peak, time_s
