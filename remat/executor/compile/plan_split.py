"""An op-level plan -> forward and backward FX graphs: below the partitioner's class.

AOT autograd's partitioners (and :mod:`~remat.executor.compile.split`) express one class of
schedules: a saved set, every other forward value recomputed once, just before its first
backward use. A remat op-level plan (:class:`~remat.ir.Plan` on the joint graph's IR) can
recompute a value several times, at the points it chooses, and free it in between; at low
budgets only such plans fit. :func:`split_plan` builds the two graphs that run such a plan.

* The plan's computations are cut at its first backward node: what comes before is the forward
  graph, the rest the backward graph (every forward node must run before that point, since
  AOT autograd runs the forward graph to its end before the backward starts).
* Each computation is a fresh copy of its joint FX node, its arguments mapped to the newest copy
  of each value; views, ``getitem`` and other nodes that make no storage are copied where a
  computation reads them (once per set of argument copies).
* Every tensor dies after its last use in its graph (FX frees it there; AOT autograd's boxed
  backward frees each saved tensor after its last use), so the plan's frees are the frees of
  :func:`emitted_plan`: each copy freed after its last read. The forward graph returns the
  copies the backward reads before it recomputes them: the values the plan keeps across the
  boundary, and the inputs it reads.
* A random op that runs more than once replays the first run's random numbers: the first run is
  ``run_and_save_rng_state`` (the generator's state saved, as
  ``torch._functorch.partitioners.functionalize_rng_ops`` does for the class), every rerun
  ``run_with_rng_state`` on that state, which the forward hands to the backward when needed.

No common-subexpression pass runs on the graphs after a partition function returns them with
``aot_eager``; inductor may fuse and reorder (its code is replayed for the figures).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from remat.executor.compile.fuse import FUSED
from remat.executor.compile.joint import JointIR
from remat.executor.compile.partition import PartitionModel
from remat.ir import InvalidPlanError, Plan, Simulation, simulate

__all__ = [
    "EmittedFigures",
    "PlanOrders",
    "PlanSplit",
    "emitted_figures",
    "emitted_plan",
    "plan_orders",
    "split_plan",
]


@dataclass(frozen=True)
class PlanOrders:
    """A plan's computations, cut where the backward graph starts."""

    forward: tuple[str, ...]
    backward: tuple[str, ...]


@dataclass
class PlanSplit:
    """The forward and backward graph modules that run an op-level plan."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    orders: PlanOrders
    saved_nodes: list[str]
    """FX names of the tensors the forward hands to the backward (random states not included)."""
    rng_saved: list[str]
    """Random ops whose generator state the forward hands to the backward."""
    rng_replayed: list[str]
    """Random ops that run more than once (each rerun replays the first run's numbers)."""
    copies: dict[str, int] = field(default_factory=dict)
    """IR node id -> how many copies of its FX node the two graphs hold."""


def plan_orders(jir: JointIR, plan: Plan) -> PlanOrders:
    """Cut ``plan``'s computations at its first backward node.

    Raises
    ------
    InvalidPlanError
        When the plan offloads or prefetches (no copy stream here), or runs a forward node
        only after the backward has started (the forward graph must finish first).
    """
    phase = {n.id: n.phase for n in jir.graph.nodes}
    computes: list[str] = []
    for step in plan.steps:
        if step.op in ("offload", "prefetch"):
            raise InvalidPlanError(f"the plan {step.op}s {step.id!r}; only recomputation runs")
        if step.op == "compute":
            computes.append(step.id)
    cut = next((i for i, nid in enumerate(computes) if phase[nid] == "backward"), len(computes))
    forward, backward = computes[:cut], computes[cut:]
    missing = set(jir.forward_node_ids()) - set(forward)
    if missing:
        first = min(missing, key=[n.id for n in jir.graph.nodes].index)
        raise InvalidPlanError(
            f"forward node {first!r} runs first after the backward has started ({len(missing)} "
            "such); a compiled forward graph ends before its backward begins"
        )
    return PlanOrders(forward=tuple(forward), backward=tuple(backward))


def emitted_plan(model: PartitionModel, orders: PlanOrders) -> Plan:
    """The plan the two graphs run: ``orders``' computations, each copy of a value freed
    after its last read (a recomputation makes every output anew)."""
    return model.plan_for_orders(orders.forward, orders.backward)


class _Emitter:
    """Copies joint FX nodes into one new graph, each argument mapped to its newest copy."""

    def __init__(self, graph: torch.fx.Graph, ir_fx: set[torch.fx.Node]) -> None:
        self.graph = graph
        self.ir_fx = ir_fx
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.derived: dict[tuple[Any, ...], torch.fx.Node] = {}
        self.states: dict[str, torch.fx.Node] = {}
        """IR node id -> the generator state its first run saved (in this graph)."""

    def resolve(self, a: torch.fx.Node) -> torch.fx.Node:
        got = self.env.get(a)
        if got is not None:
            return got
        if a.op == "placeholder" or a in self.ir_fx:
            raise InvalidPlanError(f"the plan reads {a.name!r} before it is computed")
        args = tuple(self.resolve(x) for x in a.all_input_nodes)
        key = (a, *args)
        made = self.derived.get(key)
        if made is None:
            made = self.graph.node_copy(a, self.resolve)
            self.derived[key] = made
        return made

    def emit(
        self,
        nid: str,
        fx: torch.fx.Node,
        state: torch.fx.Node | None,
        save: bool,
        folded: tuple[torch.fx.Node, ...] = (),
    ) -> None:
        """Copy ``fx`` (IR node ``nid``'s FX node), after fresh copies of the ops ``folded``
        into it (marked :data:`~remat.executor.compile.fuse.FUSED`); a random op that runs
        again saves its generator state (``save``), a rerun replays ``state``."""
        for part in folded:
            made = self.graph.node_copy(part, self.resolve)
            made.meta[SOURCE] = part.name
            made.meta[FUSED] = True
            self.env[part] = made
        if state is None and not save:
            new = self.graph.node_copy(fx, self.resolve)
        else:
            from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

            target: Any = fx.target
            args = pytree.tree_map_only(torch.fx.Node, self.resolve, fx.args)
            kwargs = pytree.tree_map_only(torch.fx.Node, self.resolve, fx.kwargs)
            if state is None:
                call = self.graph.call_function(
                    run_and_save_rng_state, (target, *args), dict(kwargs)
                )
                saved = self.graph.call_function(operator.getitem, (call, 0))
                saved.meta["val"] = _sample_rng_state()
                self.states[nid] = saved
                new = self.graph.call_function(operator.getitem, (call, 1))
            else:
                new = self.graph.call_function(
                    run_with_rng_state, (state, target, *args), dict(kwargs)
                )
            new.meta = dict(fx.meta)
        new.meta[SOURCE] = fx.name
        self.env[fx] = new
        for user in fx.users:
            if user.target is operator.getitem and user.args[0] is fx:
                g = self.graph.call_function(operator.getitem, (new, user.args[1]))
                g.meta = dict(user.meta)
                self.env[user] = g


SOURCE = "remat_source"
"""Meta key of every computation's copy: the joint FX node it copies."""


def _sample_rng_state() -> torch.Tensor:
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode()
    if mode is None:
        return torch.get_rng_state()
    with mode:
        return mode.from_tensor(torch.get_rng_state())


def split_plan(jir: JointIR, orders: PlanOrders, *, num_fwd_outputs: int) -> PlanSplit:
    """The forward and backward graphs that run ``orders`` (see the module docstring).

    Raises
    ------
    InvalidPlanError
        When the joint graph has symbolic sizes, mutations outside the IR's nodes, or seed
        inputs, or when the orders read a value before it is computed.
    """
    from torch._functorch import partitioners as P
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    joint = jir.joint
    if jir.symbolic:
        raise InvalidPlanError("op-level plans run on graphs of static sizes only")
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    if any("seed" in n.name or "base_offset" in n.name for n in placeholders):
        raise InvalidPlanError("the joint graph has random seed inputs")
    ir_fx = set(jir.node_fx.values()) | {fx for part in jir.fused.values() for fx in part}
    for n in joint.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op == "call_function" and n not in ir_fx and getattr(schema, "is_mutable", False):
            raise InvalidPlanError(f"{n.name} mutates a tensor outside the plan's nodes")
    fwd_outputs, bwd_outputs, fwd_descs, bwd_descs = P._extract_fwd_bwd_outputs(
        joint, num_fwd_outputs=num_fwd_outputs
    )
    node_of = {n.id: n for n in jir.graph.nodes}
    runs: dict[str, int] = {}
    for nid in (*orders.forward, *orders.backward):
        runs[nid] = runs.get(nid, 0) + 1
    replayed = [nid for nid, k in runs.items() if k > 1 and node_of[nid].rng]
    fx_of = jir.node_fx

    # The forward graph.
    fg = torch.fx.Graph()
    fe = _Emitter(fg, ir_fx)
    for ph in jir.primals:
        new = fg.placeholder(ph.name)
        new.meta = ph.meta
        fe.env[ph] = new
    for nid in orders.forward:
        rng = nid in replayed
        fe.emit(nid, fx_of[nid], fe.states.get(nid) if rng else None, rng, jir.fused.get(nid, ()))

    # The backward graph, emitted against a stand-in for every tensor of the forward (those
    # it reads become its saved inputs), and a state input for each random op rerun here.
    bg = torch.fx.Graph()
    be = _Emitter(bg, ir_fx)
    stand_in: dict[torch.fx.Node, torch.fx.Node] = {}
    for src in fe.env:
        if isinstance(src.meta.get("val"), torch.Tensor):
            ph = bg.placeholder(src.name)
            ph.meta = src.meta
            be.env[src] = stand_in[src] = ph
    for tg in jir.tangents:
        ph = bg.placeholder(tg.name)
        ph.meta = tg.meta
        be.env[tg] = ph
    rng_in: dict[str, torch.fx.Node] = {}
    for nid in orders.backward:
        state = None
        if nid in replayed:
            state = be.states.get(nid)
            if state is None and nid in fe.states:
                state = rng_in.get(nid)
                if state is None:
                    state = rng_in[nid] = bg.placeholder(f"rng_state_{fx_of[nid].name}")
                    state.meta["val"] = fe.states[nid].meta["val"]
        be.emit(nid, fx_of[nid], state, nid in replayed, jir.fused.get(nid, ()))
    bw_out = [be.resolve(o) if isinstance(o, torch.fx.Node) else o for o in bwd_outputs]
    out_b = bg.output(tuple(bw_out))
    out_b.meta["desc"] = list(bwd_descs)

    # What the forward hands over: the stand-ins the backward read, in joint order (those
    # torch stashes without a version check last, as its own split orders them).
    order = {n: i for i, n in enumerate(joint.graph.nodes)}
    saved = sorted((s for s, ph in stand_in.items() if ph.users), key=order.__getitem__)
    saved.sort(key=lambda s: bool(s.meta.get("saved_tensor_with_no_vc_check", False)))
    rng_saved = [nid for nid in orders.forward if nid in rng_in]
    fw_out = [fe.resolve(o) if isinstance(o, torch.fx.Node) else o for o in fwd_outputs]
    fw_out += [fe.env[s] for s in saved] + [fe.states[nid] for nid in rng_saved]
    out_f = fg.output(tuple(fw_out))
    out_f.meta["desc"] = list(fwd_descs) + [
        SavedForBackwardsAOTOutput(i) for i in range(len(saved) + len(rng_saved))
    ]
    # Backward placeholders: saved tensors, random states, then tangents.
    bw_inputs = [stand_in[s] for s in saved] + [rng_in[nid] for nid in rng_saved]
    bw_inputs += [be.env[tg] for tg in jir.tangents]
    for ph in [p for p in bg.nodes if p.op == "placeholder" and not p.users]:
        if ph not in bw_inputs:
            bg.erase_node(ph)
    anchor = next(n for n in bg.nodes if n.op != "placeholder")
    for ph in bw_inputs:
        anchor.prepend(ph)
    for n in bg.nodes:
        if n.op in ("call_function", "get_attr"):
            n.meta["autograd_backward"] = True
    fg.lint()
    bg.lint()
    return PlanSplit(
        forward=torch.fx.GraphModule(joint, fg),
        backward=torch.fx.GraphModule(joint, bg),
        orders=orders,
        saved_nodes=[s.name for s in saved],
        rng_saved=[fx_of[nid].name for nid in rng_saved],
        rng_replayed=[fx_of[nid].name for nid in replayed],
        copies=runs,
    )


@dataclass(frozen=True)
class EmittedFigures:
    """The simulator's figures of the step the two graphs run, random states included."""

    plan: Plan
    simulation: Simulation
    peak_bytes: int
    """Static bytes plus the dynamic peak, each random op's saved state counted from its
    first run to its last rerun."""


def emitted_figures(
    model: PartitionModel, orders: PlanOrders, *, rng_state_bytes: int
) -> EmittedFigures:
    """Simulate :func:`emitted_plan` and add the saved generator states where they live."""
    plan = emitted_plan(model, orders)
    sim = simulate(model.graph, plan)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, step in enumerate(plan.steps):
        if step.op == "compute" and model.node[step.id].rng:
            first.setdefault(step.id, i)
            last[step.id] = i
    held = [0] * (len(plan.steps) + 1)
    for nid, a in first.items():
        if last[nid] > a:  # run more than once: a state is saved at the first run
            held[a] += rng_state_bytes
            held[last[nid] + 1] -= rng_state_bytes
    extra = 0
    dynamic = sim.peak_dynamic_bytes if not sim.timeline_bytes else 0
    for i, during in enumerate(sim.timeline_bytes):
        extra += held[i]
        dynamic = max(dynamic, during + extra)
    dynamic = max(dynamic, sum(model.size[v] for v in model.inputs))
    return EmittedFigures(plan=plan, simulation=sim, peak_bytes=sim.static_bytes + dynamic)
