"""An independent oracle for tiny graphs: exhaustive search over device states.

A state is (frontier, resident values) — the frontier is the next node to compute for the first
time, in graph order — plus, with ``ordered=True``, the position below which no node may be
recomputed before the frontier advances (Checkmate's stages: recomputations in graph order,
then the frontier). Moves: free a resident value (free of cost), recompute an earlier node whose
inputs are resident and that makes a value not resident, or compute the frontier node; every
compute must fit the budget (inputs, resident values, its new outputs and its workspace).
Dijkstra finds the least total compute time; the path is returned as a :class:`Plan`.

Nothing here shares code with the solvers: it reads the graph and counts bytes itself.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from remat.ir import Graph, Plan, Step


@dataclass(frozen=True)
class OracleResult:
    time_s: float
    plan: Plan
    states: int


class OracleGaveUp(Exception):
    pass


def oracle(
    graph: Graph, budget_bytes: int, *, ordered: bool = True, max_states: int = 400_000
) -> OracleResult | None:
    """Least-time plan within ``budget_bytes`` (None when none exists)."""
    nodes = graph.nodes
    n = len(nodes)
    static = {v.id for v in graph.values if graph.is_static(v.id)}
    inputs = {v.id for v in graph.values if v.kind == "input"}
    size = {v.id: v.size_bytes for v in graph.values}
    room = budget_bytes - graph.static_bytes - sum(size[v] for v in inputs)
    if room < 0:
        return None
    freeable = {
        v.id
        for v in graph.values
        if v.id not in static and v.id not in inputs and not graph.is_required(v.id)
    }
    need_end = {r for r in graph.required if r not in static and r not in inputs}
    dyn_in = [tuple(x for x in nd.inputs if x not in static and x not in inputs) for nd in nodes]
    dyn_out = [tuple(o for o in nd.outputs if o not in static) for nd in nodes]

    start = (0, 0, frozenset[str]())
    dist: dict[tuple[int, int, frozenset[str]], float] = {start: 0.0}
    parent: dict[tuple[int, int, frozenset[str]], tuple[tuple[int, int, frozenset[str]], Step]] = {}
    tie = itertools.count()
    heap: list[tuple[float, int, tuple[int, int, frozenset[str]]]] = [(0.0, next(tie), start)]
    done: set[tuple[int, int, frozenset[str]]] = set()
    while heap:
        d, _, st = heapq.heappop(heap)
        if st in done:
            continue
        done.add(st)
        if len(done) > max_states:
            raise OracleGaveUp(f"more than {max_states} states")
        t, j, res = st
        if t == n and need_end <= res:
            steps: list[Step] = []
            cur = st
            while cur in parent:
                cur, step = parent[cur]
                steps.append(step)
            return OracleResult(d, Plan(steps=tuple(reversed(steps))), len(done))
        used = sum(size[v] for v in res)

        def push(
            nst: tuple[int, int, frozenset[str]],
            nd: float,
            step: Step,
            st: tuple[int, int, frozenset[str]] = st,
        ) -> None:
            if nd < dist.get(nst, float("inf")) - 1e-18:
                dist[nst] = nd
                parent[nst] = (st, step)
                heapq.heappush(heap, (nd, next(tie), nst))

        for v in res:
            if v in freeable:
                push((t, j, res - {v}), d, Step(op="free", id=v))
        cands = list(range(j if ordered else 0, t))
        if t < n:
            cands.append(t)
        for k in cands:
            node = nodes[k]
            if k < t and (not node.recomputable or all(o in res for o in dyn_out[k])):
                continue
            if any(x not in res for x in dyn_in[k]):
                continue
            new = sum(size[o] for o in dyn_out[k] if o not in res)
            if used + new + node.workspace_bytes > room:
                continue
            nres = res | set(dyn_out[k])
            nst = (t + 1, 0, nres) if k == t else (t, k + 1 if ordered else 0, nres)
            push(nst, d + node.time_s, Step(op="compute", id=node.id))
    return None
