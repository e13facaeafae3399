"""The schedules AOT autograd's partitioner can express, and remat's search among them.

The class
---------
A partition of a joint graph is a *saved set*: the forward values stored for the backward
graph. The forward graph computes what the forward outputs need; the backward graph recomputes,
from the saved values and the inputs, every other forward value it reads, each at most once,
placed just before its first use (torch's ``reordering_to_mimic_autograd_engine`` orders the
backward graph that way); every tensor is freed after its last use. :class:`PartitionModel`
turns a saved set into that IR plan (:meth:`PartitionModel.plan`), and the simulator judges it.

The search among saved sets is :func:`remat.executor.compile.search.search_partition`; it
judges candidates with :meth:`PartitionModel.figures`, the simulator's peak and time computed
without building a plan (equal to :func:`remat.ir.simulate` on :meth:`PartitionModel.plan`,
tested), and the chosen one with the simulator itself. The "saved values" formulation is AOT
autograd's (torch.compile, Ansel et al. 2024).
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Figures:
    """The simulator's figures of a saved set, computed without a plan (the search's judge)."""

    saved: frozenset[str]
    """The saved set as the split makes it: the requested values the backward reads."""
    peak_bytes: int
    """Static bytes, the dynamic peak and the recomputed random ops' generator states."""
    total_time_s: float
    recomputed: tuple[str, ...]
    live_at_peak: frozenset[str]
    """Non-static values on the device at the peak step."""


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
        self.static = {v.id for v in graph.values if graph.is_static(v.id)}
        self.inputs = {v.id for v in graph.values if v.kind == "input"}
        self.keep = self.required | self.always
        self.candidates = sorted(
            self.forward_values - self.pinned - self.static,
            key=lambda v: self.position[self.producer[v]],
        )
        """Forward values the search may save or not."""

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

    def figures(self, saved: Iterable[str]) -> Figures:
        """:meth:`partition`'s peak and time for ``saved``, without building the plan: the
        same frees as :meth:`plan_for_orders` and the same accounting as the simulator (no
        offloads here, so the step's time is the sum of its nodes' times)."""
        wanted = set(saved) & self.forward_values
        order, keep_fw = self.backward_order(wanted)
        seq = [*self.forward, *order]
        n_fw = len(self.forward)
        node = self.node
        last_read: dict[tuple[str, int], int] = {}
        made_at: dict[str, int] = {}
        makes: list[list[str]] = []
        for i, nid in enumerate(seq):
            for x in node[nid].inputs:
                last_read[(x, made_at.get(x, -1))] = i
            new = [
                o for o in node[nid].outputs if not (i >= n_fw and o in keep_fw and o in made_at)
            ]
            for o in new:
                made_at[o] = i
            makes.append(new)
        frees: dict[int, list[str]] = {}
        for i, new in enumerate(makes):
            for o in new:
                if o not in self.keep:
                    frees.setdefault(last_read.get((o, i), i), []).append(o)
        size, static = self.size, self.static
        on = set(self.inputs)
        cur = sum(size[v] for v in on)
        peak, live_peak = cur, frozenset(on)
        time_s = 0.0
        for i, nid in enumerate(seq):
            n = node[nid]
            time_s += n.time_s
            new_bytes = 0
            for o in n.outputs:
                if o not in static and o not in on:
                    new_bytes += size[o]
                    on.add(o)
            cur += new_bytes
            if cur + n.workspace_bytes > peak:
                peak, live_peak = cur + n.workspace_bytes, frozenset(on)
            for v in frees.get(i, ()):
                if v in on:
                    on.discard(v)
                    cur -= size[v]
        fw = set(self.forward)
        recomputed = tuple(x for x in order if x in fw)
        extra = self.rng_state_bytes * sum(node[x].rng for x in recomputed)
        return Figures(
            saved=frozenset(keep_fw | (wanted & self.pinned)),
            peak_bytes=self.graph.static_bytes + peak + extra,
            total_time_s=time_s,
            recomputed=recomputed,
            live_at_peak=live_peak,
        )

    def floor_bytes(self) -> int:
        """A proven lower bound of :meth:`figures`' peak over every saved set of the class.

        * The forward runs in its fixed order whatever is saved; a saved value only lives
          longer than it would unsaved. So no saved set's peak is below the forward's with
          nothing saved (every value freed after its last forward read).
        * Each backward node needs its inputs and outputs on the device at once, while the
          graph's inputs and the step's outputs (the loss) are held.

        The larger of the two (with the static bytes) bounds the class from below; the true
        floor can be higher (recomputation in the class keeps a recomputed value until its
        last backward use).
        """
        size, static, node = self.size, self.static, self.node
        held = set(self.inputs) - static
        last: dict[str, int] = {}
        for i, nid in enumerate(self.forward):
            for x in node[nid].inputs:
                last[x] = i
        frees: dict[int, list[str]] = {}
        for i, nid in enumerate(self.forward):
            for o in node[nid].outputs:
                if o not in self.keep:
                    frees.setdefault(last.get(o, i), []).append(o)
        on = set(held)
        cur = sum(size[v] for v in on)
        forward_peak = cur
        for i, nid in enumerate(self.forward):
            n = node[nid]
            for o in n.outputs:
                if o not in static and o not in on:
                    on.add(o)
                    cur += size[o]
            forward_peak = max(forward_peak, cur + n.workspace_bytes)
            for v in frees.get(i, ()):
                if v in on:
                    on.discard(v)
                    cur -= size[v]
        outputs = (self.required & self.forward_values) - static
        backward_peak = 0
        for nid in self.backward:
            n = node[nid]
            live = (held | outputs | set(n.inputs) | set(n.outputs)) - static
            backward_peak = max(backward_peak, sum(size[v] for v in live) + n.workspace_bytes)
        return self.graph.static_bytes + max(forward_peak, backward_peak)

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
