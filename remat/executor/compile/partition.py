"""The schedules AOT autograd's partitioner can express, and remat's search among them.

The class
---------
A partition of a joint graph is a *saved set*: the forward values stored for the backward
graph. The forward graph computes what the forward outputs need; the backward graph recomputes,
from the saved values and the inputs, every other forward value it reads, each at most once,
placed just before its first use (torch's ``reordering_to_mimic_autograd_engine`` orders the
backward graph that way); every tensor is freed after its last use. :class:`PartitionModel`
turns a saved set into that IR plan (:meth:`PartitionModel.plan`), and the simulator judges it.

The search
----------
:func:`search_partition` minimises the simulated step time under a budget in bytes:

1. save everything the backward reads (no recomputation): optimal when it fits;
2. otherwise a greedy descent on the simulator: among the saved values alive at the simulated
   peak (the largest first), drop the one with the best peak reduction per second of added
   recomputation, until the peak fits; then add back, one by one, dropped values whose saving
   still fits and shortens the step;
3. the same descent from the saved set of a remat solver's plan on the IR graph (values that
   plan keeps from their forward computation to the backward), when a seed is given.

The best plan of these within the budget is returned with the simulator's figures; no
optimality is claimed (the class has no exact solver here). References: the partitioner's
"saved values" formulation is AOT autograd's (torch.compile, Ansel et al. 2024); the greedy
descent on measured peak and recompute cost follows Chen et al. 2016's budget-driven greedy and
Checkmate's (Jain et al. 2020) view that a schedule is judged by its simulated peak.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from remat.ir import Graph, Plan, Simulation, simulate
from remat.ir.plan import Step


@dataclass(frozen=True)
class Partition:
    """A saved set and the IR plan of the compiled step it gives, with its figures."""

    saved: frozenset[str]
    """Forward activations saved for the backward (inputs and parameters are always there)."""
    recomputed: tuple[str, ...]
    """Forward nodes the backward recomputes, in backward order."""
    backward_order: tuple[str, ...]
    """IR node ids in backward order (recomputations included)."""
    plan: Plan
    simulation: Simulation
    extra_bytes: int = 0
    """Saved random-generator states of recomputed random ops (not IR values), held from the
    forward to the backward and counted in full at the peak (an upper bound)."""

    @property
    def peak_bytes(self) -> int:
        return self.simulation.peak_bytes + self.extra_bytes

    @property
    def total_time_s(self) -> float:
        return self.simulation.total_time_s


class PartitionModel:
    """Facts about one IR joint graph computed once, and saved set -> plan.

    Parameters
    ----------
    graph
        The IR graph of the joint graph (forward nodes first, see
        :func:`remat.executor.compile.joint.joint_to_ir`).
    rng_state_bytes
        Bytes a recomputed random op saves (its generator state).
    """

    def __init__(self, graph: Graph, *, rng_state_bytes: int = 0) -> None:
        self.graph = graph
        self.rng_state_bytes = rng_state_bytes
        self.position = {n.id: i for i, n in enumerate(graph.nodes)}
        self.producer: dict[str, str] = {}
        for n in graph.nodes:
            for o in n.outputs:
                self.producer[o] = n.id
        self.node = {n.id: n for n in graph.nodes}
        self.forward = [n.id for n in graph.nodes if n.phase == "forward"]
        fw = set(self.forward)
        self.always = {
            v.id for v in graph.values if v.id not in self.producer or graph.is_static(v.id)
        }
        self.required = set(graph.required)
        # Backward nodes the gradients need (dead ones are dropped by the split).
        needed: set[str] = set()
        stack = [
            p for v in graph.required if (p := self.producer.get(v)) is not None and p not in fw
        ]
        while stack:
            nid = stack.pop()
            if nid in needed or nid in fw:
                continue
            needed.add(nid)
            for x in self.node[nid].inputs:
                p = self.producer.get(x)
                if p is not None and p not in fw:
                    stack.append(p)
        self.backward = [n.id for n in graph.nodes if n.id in needed]
        self.forward_values = {o for nid in self.forward for o in self.node[nid].outputs}
        self.pinned = {
            o
            for nid in self.forward
            if not self.node[nid].recomputable
            for o in self.node[nid].outputs
        }
        self.read_by_backward = sorted(
            {x for nid in self.backward for x in self.node[nid].inputs if x in self.forward_values},
            key=lambda v: self.position[self.producer[v]],
        )
        self.size = {v.id: v.size_bytes for v in graph.values}

    # -- saved set -> backward order -> plan ----------------------------------------------

    def backward_order(self, saved: Iterable[str]) -> tuple[list[str], set[str]]:
        """Backward node order for ``saved`` (recomputed forward nodes placed just before
        their first use, in forward order) and the saved values the backward actually reads."""
        initial = (set(saved) | self.pinned) & self.forward_values
        avail = initial | self.always
        done: set[str] = set()
        order: list[str] = []
        read_saved: set[str] = set()
        for nid in self.backward:
            missing: set[str] = set()
            stack = [nid]
            while stack:
                cur = stack.pop()
                for x in self.node[cur].inputs:
                    if x in avail:
                        if x in initial:
                            read_saved.add(x)
                        continue
                    p = self.producer.get(x)
                    if p is None or p in done or p in missing or p == nid:
                        continue
                    missing.add(p)
                    stack.append(p)
            for p in sorted(missing, key=self.position.__getitem__):
                order.append(p)
                done.add(p)
                avail.update(self.node[p].outputs)
            order.append(nid)
            done.add(nid)
            avail.update(self.node[nid].outputs)
        return order, read_saved

    def plan_for_orders(
        self, forward: Sequence[str], backward: Sequence[str], saved: Iterable[str] = ()
    ) -> Plan:
        """The plan that runs ``forward`` then ``backward`` (node ids; a forward node in the
        backward is a recomputation) and frees each value after its last read.

        A saved value keeps its forward copy until its last backward read, even when the
        backward recomputes its producer for another output (the split passes the saved
        tensor to the backward graph; the recomputed copy is not read).
        """
        keep_fw = set(saved)
        seq = [*forward, *backward]
        n_fw = len(forward)
        # An instance of a value made at position p lives until its last read before the
        # next computation of its producer that makes it anew.
        last_read: dict[tuple[str, int], int] = {}
        made_at: dict[str, int] = {}
        makes: list[list[str]] = []
        for i, nid in enumerate(seq):
            for x in self.node[nid].inputs:
                last_read[(x, made_at.get(x, -1))] = i
            new = [
                o
                for o in self.node[nid].outputs
                if not (i >= n_fw and o in keep_fw and o in made_at)
            ]
            for o in new:
                made_at[o] = i
            makes.append(new)
        keep = self.required | self.always
        frees: dict[int, list[str]] = {}
        for i, new in enumerate(makes):
            for o in new:
                if o not in keep:
                    frees.setdefault(last_read.get((o, i), i), []).append(o)
        steps: list[Step] = []
        live: set[str] = set()
        for i, nid in enumerate(seq):
            steps.append(Step(op="compute", id=nid))
            live.update(self.node[nid].outputs)
            for v in frees.get(i, ()):
                if v in live:
                    steps.append(Step(op="free", id=v))
                    live.discard(v)
        return Plan(steps=tuple(steps))

    def partition(self, saved: Iterable[str]) -> Partition:
        """The partition for a saved set, with the simulator's figures."""
        wanted = set(saved) & self.forward_values
        order, read = self.backward_order(wanted)
        plan = self.plan_for_orders(self.forward, order, read)
        sim = simulate(self.graph, plan)
        fw = set(self.forward)
        recomputed = tuple(n for n in order if n in fw)
        return Partition(
            saved=frozenset(read | (wanted & self.pinned)),
            recomputed=recomputed,
            backward_order=tuple(order),
            plan=plan,
            simulation=sim,
            extra_bytes=self.rng_state_bytes * sum(self.node[n].rng for n in recomputed),
        )

    def live_at_peak(self, part: Partition) -> set[str]:
        """Values on the device at the simulated peak step."""
        live: set[str] = set()
        for i, step in enumerate(part.plan.steps):
            if step.op == "compute":
                live.update(self.node[step.id].outputs)
            elif step.op == "free":
                live.discard(step.id)
            if i == part.simulation.peak_step:
                break
        return live

    def saved_from_plan(self, plan: Plan) -> set[str]:
        """Forward values that ``plan`` keeps from their forward computation into the
        backward (computed once, never freed before a backward node reads them)."""
        fw = set(self.forward)
        on: set[str] = set()
        freed: set[str] = set()
        kept: set[str] = set()
        for step in plan.steps:
            if step.op == "compute":
                node = self.node[step.id]
                if node.id not in fw:
                    kept.update(x for x in node.inputs if x in on and x not in freed)
                for o in node.outputs:
                    if o in freed:
                        continue
                    on.add(o)
            elif step.op in ("free", "offload"):
                if step.id in on:
                    freed.add(step.id)
                on.discard(step.id)
        return kept & self.forward_values


def search_partition(
    model: PartitionModel,
    budget_bytes: int,
    *,
    seeds: Sequence[Iterable[str]] = (),
    time_limit_s: float = 30.0,
    candidates_per_step: int = 8,
    droppable: Iterable[str] | None = None,
) -> tuple[Partition, Partition]:
    """Search the class for the fastest partition within ``budget_bytes``.

    ``droppable`` restricts the values that may be recomputed (the others the backward reads
    stay saved): the knapsack hook's candidates.

    Returns
    -------
    (best, lowest)
        ``best``: the fastest partition found within the budget, or the lowest-peak one when
        none fits; ``lowest``: the lowest-peak partition seen (for infeasibility reports).
    """
    deadline = time.monotonic() + time_limit_s
    full = model.partition(model.read_by_backward)
    if full.peak_bytes <= budget_bytes:
        return full, full
    found: list[Partition] = [full]
    # Starts: everything the backward reads; the outputs of compute-bound ops only (cheap
    # pointwise ops recomputed, as torch's partitioner prefers); nothing (all recomputed);
    # then the given seeds.
    every = set(model.read_by_backward)
    free = every if droppable is None else set(droppable) & every
    fixed = every - free
    starts = [every, _compute_bound(model), set()]
    starts += [set(s) for s in seeds]
    starts = [fixed | (s & free) for s in starts]
    for start in starts:
        part = model.partition(start)
        found.append(part)
        part = _descend(model, part, budget_bytes, deadline, candidates_per_step, found, free)
        if part.peak_bytes <= budget_bytes:
            part = _add_back(model, part, budget_bytes, deadline, found, free)
        found.append(part)
        if time.monotonic() > deadline:
            break
    fitting = [p for p in found if p.peak_bytes <= budget_bytes]
    lowest = min(found, key=lambda p: (p.peak_bytes, p.total_time_s))
    if fitting:
        return min(fitting, key=lambda p: (p.total_time_s, p.peak_bytes)), lowest
    return lowest, lowest


def _compute_bound(model: PartitionModel) -> set[str]:
    """Values the backward reads whose producer takes longer than moving its inputs and
    outputs would (flops dominate: matmuls, attention), i.e. the ones worth keeping."""
    out: set[str] = set()
    for v in model.read_by_backward:
        node = model.node[model.producer[v]]
        if node.flops > 8 * sum(model.size.get(x, 0) for x in (*node.inputs, *node.outputs)):
            out.add(v)
    return out


def _descend(
    model: PartitionModel,
    part: Partition,
    budget_bytes: int,
    deadline: float,
    k: int,
    found: list[Partition],
    free: set[str],
) -> Partition:
    """Drop saved values alive at the peak until the peak fits (greedy, simulator-judged)."""
    tried_dead: set[str] = set()
    while part.peak_bytes > budget_bytes and time.monotonic() < deadline:
        live = model.live_at_peak(part)
        cands = sorted(
            (
                v
                for v in part.saved & free
                if v in live and v not in model.pinned and v not in tried_dead
            ),
            key=lambda v: -model.size[v],
        )[:k]
        if not cands:
            break
        best: tuple[float, Partition] | None = None
        for v in cands:
            trial = model.partition(part.saved - {v})
            found.append(trial)
            gain = part.peak_bytes - trial.peak_bytes
            if gain <= 0:
                tried_dead.add(v)
                continue
            cost = max(trial.total_time_s - part.total_time_s, 1e-12)
            score = gain / cost
            if best is None or score > best[0]:
                best = (score, trial)
        if best is None:
            # No single drop lowers the peak: drop the largest candidate and go on (the peak
            # may move to where the next drop helps).
            v = cands[0]
            trial = model.partition(part.saved - {v})
            found.append(trial)
            tried_dead.add(v)
            if trial.peak_bytes > part.peak_bytes:
                continue
            part = trial
            continue
        part = best[1]
    return part


def _add_back(
    model: PartitionModel,
    part: Partition,
    budget_bytes: int,
    deadline: float,
    found: list[Partition],
    free: set[str],
) -> Partition:
    """Save again dropped values (most recompute time first) while the peak still fits."""
    dropped = [v for v in model.read_by_backward if v not in part.saved and v in free]
    dropped.sort(key=lambda v: -model.node[model.producer[v]].time_s)
    for v in dropped:
        if time.monotonic() > deadline:
            break
        trial = model.partition(part.saved | {v})
        found.append(trial)
        if trial.peak_bytes <= budget_bytes and trial.total_time_s < part.total_time_s:
            part = trial
    return part
