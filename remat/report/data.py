"""The figures a report shows, computed from a graph and a plan with the simulator (no plotting).

Everything here is the simulator's reading of a plan: the device bytes during each step of the
plan and of the eager step, where the backward pass begins, which values hold the memory at the
peak and what each module's values do (kept, recomputed, offloaded).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from remat.ir import Graph, Plan, Simulation, eager_plan, simulate

TOP_LEVEL = "(top level)"
"""The module name shown for nodes outside any submodule (the loss, the model's own ops)."""
INPUT = "(input)"
"""The module name shown for the step's inputs, which no node produces."""


def module_of(graph: Graph, value_id: str) -> str:
    """The module whose node produced ``value_id``; inputs and top-level ops get a label."""
    p = graph.producer_of(value_id)
    if p is None:
        return INPUT
    return p.module or TOP_LEVEL


@dataclass(frozen=True)
class Series:
    """Device bytes (static + dynamic) during each step of one schedule."""

    label: str
    device_bytes: tuple[int, ...]
    backward_step: int | None
    """Index of the first step that computes a backward node (None: forward only)."""
    peak_step: int
    peak_bytes: int
    total_time_s: float


@dataclass(frozen=True)
class AliveValue:
    """One value holding device memory at the plan's peak."""

    value_id: str
    module: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    size_bytes: int


@dataclass(frozen=True)
class Peak:
    """What holds the memory at the plan's peak step."""

    step: int
    """Index in the plan's steps (-1 for an empty plan)."""
    node_id: str | None
    """The node running at the peak, when the peak is a compute step."""
    device_bytes: int
    static_bytes: int
    workspace_bytes: int
    values: tuple[AliveValue, ...]
    """Largest first."""

    def largest(self, n: int) -> tuple[AliveValue, ...]:
        return self.values[:n]

    def by_module(self) -> list[tuple[str, int, int]]:
        """``(module, number of values, bytes)`` alive at the peak, most bytes first."""
        count: Counter[str] = Counter()
        size: Counter[str] = Counter()
        for v in self.values:
            count[v.module] += 1
            size[v.module] += v.size_bytes
        return sorted(((m, count[m], size[m]) for m in size), key=lambda r: (-r[2], r[0]))


@dataclass(frozen=True)
class ModuleRow:
    """What a plan does with the values one module produces (static values excluded)."""

    module: str
    num_values: int
    size_bytes: int
    kept: int
    """Values computed once and not offloaded."""
    recomputed: int
    """Values computed more than once."""
    recomputations: int
    """Extra computations of those values, summed (a value computed three times counts 2)."""
    recomputed_bytes: int
    offloaded: int
    offloaded_bytes: int
    recompute_time_s: float
    """Time of the module's recomputed nodes (each extra run counted)."""


@dataclass(frozen=True)
class Timeline:
    """A plan's memory over its steps beside the eager step's, with the budget and the peak."""

    graph_name: str
    budget_bytes: int | None
    static_bytes: int
    eager: Series
    plan: Series
    peak: Peak

    @property
    def overhead(self) -> float:
        """Extra time of the plan over the eager step (0.1 = 10% slower)."""
        base = self.eager.total_time_s
        return self.plan.total_time_s / base - 1 if base > 0 else 0.0


def _backward_step(graph: Graph, plan: Plan) -> int | None:
    for i, s in enumerate(plan.steps):
        if s.op == "compute" and graph.node(s.id).phase == "backward":
            return i
    return None


def _series(graph: Graph, plan: Plan, sim: Simulation, label: str) -> Series:
    return Series(
        label=label,
        device_bytes=tuple(sim.static_bytes + b for b in sim.timeline_bytes),
        backward_step=_backward_step(graph, plan),
        peak_step=sim.peak_step,
        peak_bytes=sim.peak_bytes,
        total_time_s=sim.total_time_s,
    )


def peak_of(graph: Graph, plan: Plan, sim: Simulation | None = None) -> Peak:
    """The values alive at ``plan``'s peak, largest first (``sim``: its simulation, if known)."""
    sim = sim or simulate(graph, plan)
    step = sim.peak_step
    at = simulate(graph, plan, alive_at_step=step) if step >= 0 else sim
    values = []
    for vid in at.alive_value_ids:
        v = graph.value(vid)
        values.append(
            AliveValue(
                value_id=vid,
                module=module_of(graph, vid),
                kind=v.kind,
                shape=tuple(v.shape) if v.shape is not None else None,
                dtype=v.dtype,
                size_bytes=v.size_bytes,
            )
        )
    values.sort(key=lambda a: (-a.size_bytes, a.value_id))
    node_id = None
    if step >= 0 and plan.steps[step].op == "compute":
        node_id = plan.steps[step].id
    return Peak(
        step=step,
        node_id=node_id,
        device_bytes=sim.peak_bytes,
        static_bytes=sim.static_bytes,
        workspace_bytes=at.alive_workspace_bytes if step >= 0 else 0,
        values=tuple(values),
    )


def timeline(graph: Graph, plan: Plan, budget_bytes: int | None = None) -> Timeline:
    """The memory timeline of ``plan`` against the eager step of ``graph``.

    Raises
    ------
    InvalidPlanError
        When the plan does not run on the graph.
    """
    sim = simulate(graph, plan)
    ep = eager_plan(graph)
    return Timeline(
        graph_name=graph.name or "graph",
        budget_bytes=budget_bytes,
        static_bytes=graph.static_bytes,
        eager=_series(graph, ep, simulate(graph, ep), "eager (no remat)"),
        plan=_series(graph, plan, sim, "plan"),
        peak=peak_of(graph, plan, sim),
    )


def module_table(graph: Graph, plan: Plan) -> list[ModuleRow]:
    """Per module: how many of its values the plan keeps, recomputes (how often), offloads.

    Rows are sorted by the bytes of the module's values, largest first.
    """
    fates = plan.summary(graph)
    computes = plan.compute_counts()
    rows: dict[str, dict[str, float]] = {}
    for vid, fate in fates.items():
        m = module_of(graph, vid)
        r = rows.setdefault(m, defaultdict(float))
        size = graph.value(vid).size_bytes
        r["num_values"] += 1
        r["size_bytes"] += size
        if fate.times_offloaded:
            r["offloaded"] += 1
            r["offloaded_bytes"] += size
        elif fate.recomputed:
            r["recomputed"] += 1
            r["recomputations"] += fate.recomputed
            r["recomputed_bytes"] += size
        else:
            r["kept"] += 1
    for node in graph.nodes:
        extra = computes.get(node.id, 0) - 1
        if extra > 0:
            r = rows.setdefault(node.module or TOP_LEVEL, defaultdict(float))
            r["recompute_time_s"] += extra * node.time_s
    out = [
        ModuleRow(
            module=m,
            num_values=int(r["num_values"]),
            size_bytes=int(r["size_bytes"]),
            kept=int(r["kept"]),
            recomputed=int(r["recomputed"]),
            recomputations=int(r["recomputations"]),
            recomputed_bytes=int(r["recomputed_bytes"]),
            offloaded=int(r["offloaded"]),
            offloaded_bytes=int(r["offloaded_bytes"]),
            recompute_time_s=float(r["recompute_time_s"]),
        )
        for m, r in rows.items()
    ]
    out.sort(key=lambda r: (-r.size_bytes, r.module))
    return out
