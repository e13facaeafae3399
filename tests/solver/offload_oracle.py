"""An exhaustive search over offloading on tiny graphs, independent of remat.solver.offload.

For each recompute-only plan of a family (the exhaustive oracle's optimal plans at every
budget from the eager peak down, so every amount of recomputation the oracle would choose),
every way to move values to the host: per value, at most one of its gaps between two
consecutive touches (its producing compute or a read, with no free or recompute between),
the offload right after the gap's first step and the prefetch either right after the offload
or right before the read. Every combination is simulated; the fastest within the budget and
the host budget wins. Exhaustive over that class (not over every plan that offloads: copies
placed elsewhere, or a value offloaded twice, are not tried).
"""

from __future__ import annotations

import itertools

from oracle import oracle

from remat.ir import Graph, Plan, Step, eager_plan, simulate


def _choices(graph: Graph, plan: Plan) -> dict[str, list[tuple[int, int, int]]]:
    """Per value: its gaps as (offload after step a, prefetch before step p, read step b)."""
    static = {v.id for v in graph.values if graph.is_static(v.id)}
    inputs = {v.id for v in graph.values if v.kind == "input"}
    node = {n.id: n for n in graph.nodes}
    last: dict[str, int] = {}
    out: dict[str, list[tuple[int, int, int]]] = {}
    for i, s in enumerate(plan.steps):
        if s.op == "free":
            last.pop(s.id, None)
            continue
        n = node[s.id]
        for x in n.inputs:
            if x in last and i > last[x] + 1:
                a = last[x]
                out.setdefault(x, []).extend([(a, a + 1, i), (a, i, i)])
            if x in last:
                last[x] = i
        for o in n.outputs:
            if o not in static and o not in inputs:
                last[o] = i
    return out


def _insert(plan: Plan, picks: list[tuple[str, tuple[int, int, int]]]) -> Plan:
    after: dict[int, list[Step]] = {}
    before: dict[int, list[Step]] = {}
    for v, (a, p, _) in picks:
        after.setdefault(a, []).append(Step(op="offload", id=v))
        before.setdefault(p, []).append(Step(op="prefetch", id=v))
    steps: list[Step] = []
    for i, s in enumerate(plan.steps):
        steps += before.get(i, [])
        steps.append(s)
        steps += after.get(i, [])
    return Plan(steps=tuple(steps))


def offload_oracle(graph: Graph, budget_bytes: int, *, max_combos: int = 20_000) -> float | None:
    """The least simulated time within ``budget_bytes`` over the class above (None: none)."""
    plans = [eager_plan(graph)]
    peak = simulate(graph, plans[0]).peak_bytes
    seen: set[tuple[Step, ...]] = {plans[0].steps}
    m = peak
    while m >= budget_bytes:
        r = oracle(graph, m, ordered=False)
        if r is None:
            break
        if r.plan.steps not in seen:
            seen.add(r.plan.steps)
            plans.append(r.plan)
        m = simulate(graph, r.plan).peak_bytes - 1
    host = graph.link.host_memory_bytes
    best: float | None = None
    for plan in plans:
        choices = _choices(graph, plan)
        values = sorted(choices)
        options = [[None, *choices[v]] for v in values]
        for n, combo in enumerate(itertools.product(*options)):
            if n >= max_combos:
                break
            picks = [(v, c) for v, c in zip(values, combo, strict=True) if c is not None]
            s = simulate(graph, _insert(plan, picks))
            if s.peak_bytes <= budget_bytes and (host is None or s.host_peak_bytes <= host):
                best = s.total_time_s if best is None else min(best, s.total_time_s)
    return best
