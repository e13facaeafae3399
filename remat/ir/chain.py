"""The chain view of a graph, for the chain solvers (rotor, revolve, POFO), and the way back.

A *chain* splits the forward pass at cuts (:mod:`remat.ir.cuts`) into stages ``0..L-1``: stage
``i`` reads the values of cut ``i`` (the graph's inputs for ``i = 0``) and its forward nodes
produce the values of cut ``i + 1``; its backward nodes are the backward nodes that read its
saved values. The forward pass is the forward sweep (:func:`~remat.ir.cuts.sweep_positions`):
a backward-phase node that a later forward node depends on is one of its stage's forward nodes,
since a chain schedule runs every stage's backward after all forwards. Each :class:`Stage`
carries the figures the dynamic programs need (forward and backward time, input bytes,
all-activation bytes, temporary bytes).

A chain schedule is a list of :class:`ChainOp` (run a stage's forward or backward, offload or
prefetch a stage's saved values). :func:`expand` turns it into an op-level :class:`Plan` with
:func:`plan_from_steps`, which inserts every ``free`` as early as possible, so the simulator
judges a chain schedule like any other plan.

Examples
--------
>>> from remat.ir import synthetic, simulate
>>> g = synthetic.chain(4)
>>> ch = chain_view(g)
>>> ch.num_stages > 1
True
>>> ops = [ChainOp("forward", i) for i in range(ch.num_stages)]
>>> ops += [ChainOp("backward", i) for i in reversed(range(ch.num_stages))]
>>> simulate(g, expand(ch, ops)).num_recomputes
0
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from remat.ir.cuts import Cut, articulation_cuts, block_cuts, sweep_positions
from remat.ir.errors import InvalidPlanError
from remat.ir.graph import Graph
from remat.ir.plan import Plan, Step, step_maker

CutKind = Literal["auto", "articulation", "blocks"]
ChainOpKind = Literal["forward", "backward", "offload", "prefetch", "rerun"]


@dataclass(frozen=True)
class Stage:
    """One stage of a chain. Bytes are exact; times in seconds.

    Attributes
    ----------
    forward_nodes, backward_nodes
        Node ids in graph order.
    input_values
        The cut the stage reads (values made by earlier stages); empty for stage 0.
    saved_values
        Values its forward nodes make that backward nodes read (what "forward with all
        activations" keeps).
    forward_time_s, backward_time_s
        Sums of node times (forward: recomputable nodes only, what a re-run costs).
    input_bytes
        Bytes of ``input_values`` (rotor's ``x_{i-1}``).
    all_bytes
        Bytes of ``saved_values`` (rotor's ``x̄_i``).
    forward_temp_bytes
        Peak bytes of the stage's own values (neither its input nor its output cut) while its
        forward runs without keeping anything, workspace included.
    forward_all_temp_bytes
        The same beyond ``all_bytes`` while its forward keeps its saved values.
    backward_temp_bytes
        Peak bytes of the values its backward nodes make, workspace included.
    """

    index: int
    forward_nodes: tuple[str, ...]
    backward_nodes: tuple[str, ...]
    input_values: tuple[str, ...]
    saved_values: tuple[str, ...]
    forward_time_s: float
    backward_time_s: float
    input_bytes: int
    all_bytes: int
    forward_temp_bytes: int
    forward_all_temp_bytes: int
    backward_temp_bytes: int


def _transient(graph: Graph, positions: list[int], counted: set[str], skip: set[str]) -> int:
    """Peak bytes of the ``counted`` values the nodes at ``positions`` make, each alive from its
    node to its last reader among them (values in ``skip`` are accounted elsewhere), plus the
    running node's workspace."""
    size = graph.size_map()
    last: dict[str, int] = {}
    for k, i in enumerate(positions):
        for x in graph.nodes[i].inputs:
            last[x] = k
    live: dict[str, int] = {}
    peak = 0
    for k, i in enumerate(positions):
        node = graph.nodes[i]
        for o in node.outputs:
            if o in counted and o not in skip:
                live[o] = size[o]
        peak = max(peak, sum(live.values()) + node.workspace_bytes)
        for v in list(live):
            if last.get(v, -1) <= k:
                del live[v]
    return peak


@dataclass(frozen=True)
class Chain:
    """A graph seen as a chain of stages (see the module docstring)."""

    graph: Graph
    stages: tuple[Stage, ...]
    cut_kind: str
    first_forward_time_s: float
    """Time of the one full forward pass (non-recomputable nodes included)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def is_homogeneous(self) -> bool:
        """All stages but the first and last have equal sizes and times (revolve's model)."""
        mid = self.stages[1:-1] or self.stages
        ref = mid[0]
        return all(
            s.input_bytes == ref.input_bytes
            and s.all_bytes == ref.all_bytes
            and abs(s.forward_time_s - ref.forward_time_s) <= 1e-9 * max(ref.forward_time_s, 1e-30)
            for s in mid
        )


@dataclass(frozen=True)
class ChainOp:
    """One step of a chain schedule: ``forward`` / ``backward`` of stage ``stage``,
    ``offload`` / ``prefetch`` of its saved values, or ``rerun`` of some of its forward nodes
    (``nodes``, in graph order: the values a partial save dropped, made again for its
    backward)."""

    kind: ChainOpKind
    stage: int
    nodes: tuple[str, ...] = ()


def _select_cuts(graph: Graph, kind: CutKind) -> tuple[list[Cut], str]:
    if kind == "articulation":
        return articulation_cuts(graph), "articulation"
    if kind == "blocks":
        return block_cuts(graph), "blocks"
    art = articulation_cuts(graph)
    blocks = block_cuts(graph)
    if len(art) >= max(2, len(blocks) // 2):
        return art, "articulation"
    return blocks, "blocks"


def chain_view(
    graph: Graph, *, cuts: CutKind = "auto", max_stages: int | None = None, every: int = 1
) -> Chain:
    """The chain of ``graph``: stages between cuts of the forward pass.

    Parameters
    ----------
    graph
        Any training-step graph. A graph without a usable cut is one stage.
    cuts
        ``"articulation"`` (cuts crossed by one value: a true chain), ``"blocks"`` (ends of
        the model's blocks, which may be crossed by several values) or ``"auto"`` (articulation
        cuts when there are at least half as many as block cuts, else block cuts).
    max_stages
        Merge neighbouring stages (keeping evenly spaced cuts) down to this many.
    every
        Keep only every ``every``-th cut (before ``max_stages`` applies): stages merged in
        groups of ``every``, so that a chain of repeated layers stays one of repeated stages.
    """
    if max_stages is not None and max_stages < 1:
        raise ValueError(f"max_stages must be >= 1, got {max_stages}")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    chosen, kind = _select_cuts(graph, cuts)
    chosen = chosen[every - 1 :: every]
    if max_stages is not None and len(chosen) + 1 > max_stages:
        k = max_stages - 1
        step = len(chosen) / max(k, 1)
        chosen = [chosen[min(len(chosen) - 1, round((j + 1) * step) - 1)] for j in range(k)]
        chosen = list({c.position: c for c in chosen}.values())
    return chain_of_cuts(graph, chosen, kind)


def chain_of_cuts(graph: Graph, chosen: Sequence[Cut], kind: str) -> Chain:
    """The chain of ``graph`` with stages between the given cuts (any forward cuts, e.g.
    :func:`remat.ir.cuts.forward_cuts` picked by a solver); ``kind`` is recorded."""
    nodes = graph.nodes
    size = graph.size_map()
    static = graph.static_ids()
    bounds = sorted(c.position for c in chosen)
    sweep = sweep_positions(graph)
    in_sweep = set(sweep)
    stage_of: dict[int, int] = {}
    s = 0
    for i in sweep:
        while s < len(bounds) and i > bounds[s]:
            s += 1
        stage_of[i] = s
    # a graph without a forward pass is one stage of backward nodes (none without nodes)
    num = (max(stage_of.values()) + 1) if stage_of else min(1, len(nodes))
    produced_in: dict[str, int] = {}
    for i, st in stage_of.items():
        for o in nodes[i].outputs:
            produced_in[o] = st
    # A value's home stage: where the last forward reader is (a cut value belongs to the stage
    # that reads it, as rotor's x_{i-1} belongs to stage i).
    home: dict[str, int] = dict(produced_in)
    for i, st in stage_of.items():
        for x in nodes[i].inputs:
            if x in home:
                home[x] = max(home[x], st)
    # Backward nodes: the latest home of the forward values they read, never later than the
    # stage of the backward node before them (backward runs stages in decreasing order).
    bwd_stage: dict[int, int] = {}
    cur = num - 1
    for i, n in enumerate(nodes):
        if i in in_sweep:
            continue
        reads = [home[x] for x in n.inputs if x in home]
        if reads:
            cur = min(cur, max(reads))
        bwd_stage[i] = max(cur, 0)
    cut_values = {c.position: c for c in chosen}
    # each stage's nodes in graph order, grouped in one pass (not one scan per stage)
    fwd_of: list[list[int]] = [[] for _ in range(num)]
    for i, st in stage_of.items():
        fwd_of[st].append(i)
    bwd_of: list[list[int]] = [[] for _ in range(num)]
    for i, st in bwd_stage.items():
        bwd_of[st].append(i)
    pos_of_stage_end = {st: fwd_of[st][-1] for st in range(num) if fwd_of[st]}
    bwd_readers = {
        v: any(r not in in_sweep for r in graph.consumer_positions(v)) for v in produced_in
    }
    required = {v for v in produced_in if graph.is_required(v)}
    stages: list[Stage] = []
    for st in range(num):
        fwd = fwd_of[st]
        bwd = bwd_of[st]
        inp: tuple[str, ...] = ()
        if st > 0:
            c = cut_values.get(pos_of_stage_end[st - 1])
            inp = c.values if c is not None else ()
        out_cut: set[str] = set()
        if st < num - 1:
            c = cut_values.get(pos_of_stage_end[st])
            out_cut = set(c.values) if c is not None else set()
        saved = [
            o
            for i in fwd
            for o in nodes[i].outputs
            if o in produced_in and o not in static and home[o] == st and bwd_readers[o]
        ]
        inner = {
            o
            for i in fwd
            for o in nodes[i].outputs
            if o not in static and o not in out_cut and o not in required
        }
        saved_set = set(saved)
        stages.append(
            Stage(
                index=st,
                forward_nodes=tuple(nodes[i].id for i in fwd),
                backward_nodes=tuple(nodes[i].id for i in bwd),
                input_values=tuple(inp),
                saved_values=tuple(saved),
                forward_time_s=sum(nodes[i].time_s for i in fwd if nodes[i].recomputable),
                backward_time_s=sum(nodes[i].time_s for i in bwd),
                input_bytes=sum(size[v] for v in inp),
                all_bytes=sum(size[v] for v in saved),
                forward_temp_bytes=_transient(graph, fwd, inner, set()),
                forward_all_temp_bytes=_transient(graph, fwd, inner - saved_set, saved_set),
                backward_temp_bytes=_transient(
                    graph,
                    bwd,
                    {o for i in bwd for o in nodes[i].outputs if o not in static},
                    # gradients that leave the stage are rotor's δ_{i-1}, counted apart
                    {
                        o
                        for i in bwd
                        for o in nodes[i].outputs
                        if any(bwd_stage.get(r, st) != st for r in graph.consumer_positions(o))
                    },
                ),
            )
        )
    first = sum(nodes[i].time_s for i in sweep)
    return Chain(graph=graph, stages=tuple(stages), cut_kind=kind, first_forward_time_s=first)


def expand(chain: Chain, ops: Iterable[ChainOp]) -> Plan:
    """The op-level plan of a chain schedule.

    ``forward`` runs the stage's forward nodes in graph order (the first time all of them;
    afterwards only those that can run again and whose outputs are not required);
    ``backward`` runs its backward nodes; ``offload`` moves the stage's saved values that are
    on the device and not read before the next ``prefetch`` of the stage to the host;
    ``prefetch`` brings them back. Frees are inserted by :func:`plan_from_steps`.

    Raises
    ------
    InvalidPlanError
        When the schedule reads a value that no earlier step made (e.g. a backward before any
        forward of its stage).
    """
    g = chain.graph
    step = step_maker(g)
    node_of = g.node_map()
    static_or_required = g.static_ids() | set(g.required)
    done: set[str] = set()
    steps: list[Step] = []
    offloaded: dict[int, list[str]] = {}
    for op in ops:
        st = chain.stages[op.stage]
        if op.kind == "forward":
            for nid in st.forward_nodes:
                node = node_of[nid]
                if nid in done and (
                    not node.recomputable or all(o in static_or_required for o in node.outputs)
                ):
                    continue
                done.add(nid)
                steps.append(step("compute", nid))
        elif op.kind == "backward":
            steps.extend(step("compute", nid) for nid in st.backward_nodes)
        elif op.kind == "rerun":
            steps.extend(step("compute", nid) for nid in op.nodes)
        elif op.kind == "offload":
            vals = [v for v in st.saved_values if not g.is_required(v)]
            offloaded[op.stage] = vals
            steps.extend(step("offload", v) for v in vals)
        else:
            steps.extend(step("prefetch", v) for v in offloaded.pop(op.stage, []))
    return plan_from_steps(g, steps)


def plan_from_steps(graph: Graph, steps: Sequence[Step]) -> Plan:
    """Insert ``free`` steps as early as possible into computes, offloads and prefetches.

    Each computed (or prefetched) copy of a value lives until its last read before the next
    compute of its producer or its next prefetch; a copy that ends in an ``offload`` is not
    freed (the copy stream releases it). An ``offload`` of a value that is not on the device,
    or that is read again before it is made or prefetched again, is dropped (the value stays on
    the device), and so is a ``prefetch`` of a value that is not on the host. Inputs, static
    and required values are never freed.

    Raises
    ------
    InvalidPlanError
        When a compute reads a value that no earlier step made.
    """
    static = graph.static_ids()
    keep_forever = static | set(graph.required) | {v.id for v in graph.values if v.kind == "input"}
    node_of = graph.node_map()
    step = step_maker(graph)
    # Index reads and creations of each value.
    reads: dict[str, list[int]] = {}
    makes: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        if s.op == "compute":
            node = node_of[s.id]
            for x in node.inputs:
                reads.setdefault(x, []).append(i)
            for o in node.outputs:
                makes.setdefault(o, []).append(i)
        elif s.op == "prefetch":
            makes.setdefault(s.id, []).append(i)

    def first_after(lst: list[int] | None, j: int) -> int | None:
        if not lst:
            return None
        k = bisect.bisect_right(lst, j)
        return lst[k] if k < len(lst) else None

    # Pass 1: keep the offloads and prefetches that make sense.
    kept: list[Step] = []
    where: dict[str, str] = {}
    for i, s in enumerate(steps):
        v = s.id
        if s.op == "compute":
            for o in node_of[v].outputs:
                where[o] = "device"
        elif s.op == "offload":
            if v in keep_forever or where.get(v) != "device":
                continue
            nr = first_after(reads.get(v), i)
            nm = first_after(makes.get(v), i)
            if nr is not None and (nm is None or nm > nr):
                continue
            where[v] = "host"
        elif s.op == "prefetch":
            if where.get(v) != "host":
                continue
            where[v] = "device"
        kept.append(s)
    # Pass 2, backwards: how each copy ends (last read -> free after it; offload -> nothing).
    last_use: dict[str, tuple[int, bool]] = {}  # value -> (index, ends in offload)
    frees_after: dict[int, list[str]] = {}

    def close(v: str, made_at: int) -> None:
        end = last_use.pop(v, None)
        if end is None:
            frees_after.setdefault(made_at, []).append(v)
        elif not end[1]:
            frees_after.setdefault(end[0], []).append(v)

    for i in range(len(kept) - 1, -1, -1):
        s = kept[i]
        if s.op == "compute":
            node = node_of[s.id]
            for o in node.outputs:
                if o not in keep_forever:
                    close(o, i)
            for x in node.inputs:
                if x not in keep_forever:
                    last_use.setdefault(x, (i, False))
        elif s.op == "prefetch":
            close(s.id, i)
        elif s.op == "offload":
            last_use.setdefault(s.id, (i, True))
    # Pass 3: emit, checking that every read is satisfied.
    out: list[Step] = []
    resident = {v.id for v in graph.values if v.kind == "input"}
    for i, s in enumerate(kept):
        if s.op == "compute":
            node = node_of[s.id]
            for x in node.inputs:
                if x not in resident and x not in static:
                    raise InvalidPlanError(
                        f"compute {s.id!r} reads value {x!r}, which no earlier step made"
                    )
            resident.update(node.outputs)
        elif s.op == "offload":
            resident.discard(s.id)
        elif s.op == "prefetch":
            resident.add(s.id)
        out.append(s)
        for v in frees_after.get(i, ()):
            if v in resident:
                resident.discard(v)
                out.append(step("free", v))
    return Plan(steps=tuple(out))
