"""The class of plans that ``remat.apply(model, result, mode="checkpoint")`` runs exactly.

That executor wraps blocks of the model (module subtrees: ``remat.ir.block_key`` of the module
paths, e.g. ``layers.3``) in non-reentrant ``torch.utils.checkpoint`` regions with a selective
policy: ops of the region whose outputs the plan keeps are saved (``MUST_SAVE``), the others are
recomputed. What PyTorch then does, and what :func:`checkpoint_plan` writes down as a plan:

* forward: every node once, in graph order; a value made by a recomputed node of a region is
  freed after its last forward use; the region's inputs (values from outside that its
  recomputed nodes read, and the block's tensor arguments, ``Value.held_by``) are held by the
  checkpoint until the region's backward is done;
* backward: the first backward node of a region that reads anything saved inside it (a value
  of the region, a region input or a parameter) triggers the region's recomputation, at once,
  before the first op of the autograd node it belongs to (``Node.autograd_node``: eager
  unpacks a node's saved tensors before its formula allocates anything): the region's
  recomputed nodes, in order, up to the last one that makes or reads a value the region's
  backward reads, as far as the graph tells (an op of a module whose backward reads the op's
  inputs or outputs). PyTorch stops the recomputation when that op saves its last tensor: an
  op saves its inputs before its kernel runs and its outputs after, so a last op whose
  outputs the backward does not read is not run again. Each recomputed value lives until its
  last use; saved values (cached by the policy) are not recomputed: the cache holds each
  until the recomputation takes it, or, past the point where it stops, until the region's
  backward is done.

A plan is *in the class* when it equals the plan of its own regions (:func:`regions_of`, then
:func:`checkpoint_plan`); :func:`project` maps any plan into the class, and :func:`fit` searches
the class for a plan under a budget (``remat.solve(..., executor="checkpoint")`` uses it),
so that the simulator's figures are what the checkpoint
executor does.

Limits, by construction: a region's recomputed values must stay inside it (read only by its
own forward and backward nodes; a value another module reads is saved), ops without a module
(the model's own ``forward``, the loss) are never recomputed, nothing is recomputed twice, and
offloading is not part of the class.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from remat.ir.cuts import block_key
from remat.ir.graph import Graph, Node
from remat.ir.plan import Plan, Step
from remat.ir.simulate import Simulation, simulate


@dataclass(frozen=True)
class Region:
    """One checkpointed block: its path, its forward nodes, and the nodes it saves."""

    path: str
    nodes: tuple[str, ...]
    """The block's forward nodes, in graph order."""
    save: frozenset[str]
    """Nodes whose outputs are kept (``MUST_SAVE``); every other node may be recomputed."""


def _autograd_node_start(nodes: tuple[Node, ...], i: int) -> int:
    """The index of the first op of the autograd node that backward op ``i`` is part of
    (consecutive ops with its ``autograd_node``; ``i`` itself when that is unknown)."""
    group = nodes[i].autograd_node
    if group is None:
        return i
    while i > 0 and nodes[i - 1].phase == "backward" and nodes[i - 1].autograd_node == group:
        i -= 1
    return i


def _bwd_block(graph: Graph) -> dict[str, str]:
    return {n.id: block_key(n.module) if n.module else "" for n in graph.nodes}


def blocks(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Forward nodes per block (module subtree), in graph order; the root ("") excluded."""
    out: dict[str, list[str]] = {}
    for n in graph.forward_nodes:
        if n.module:
            out.setdefault(block_key(n.module), []).append(n.id)
    return {k: tuple(v) for k, v in out.items()}


def forced_saves(graph: Graph, path: str, nodes: Iterable[str]) -> frozenset[str]:
    """Nodes of a region that must be saved: not recomputable (side effects), or with an output
    that something outside the region reads (its recomputation would make a second copy)."""
    block = _bwd_block(graph)
    members = set(nodes)
    out: set[str] = set()
    for nid in members:
        n = graph.node(nid)
        if not n.recomputable or any(graph.is_required(o) for o in n.outputs):
            out.add(nid)
            continue
        for o in n.outputs:
            for c in graph.consumers_of(o):
                inside = c.id in members if c.phase == "forward" else block[c.id] == path
                if not inside:
                    out.add(nid)
    return frozenset(out)


def region(graph: Graph, path: str, save: Iterable[str] = ()) -> Region:
    """The region of block ``path`` saving ``save`` (plus its forced saves)."""
    nodes = blocks(graph).get(path)
    if nodes is None:
        raise ValueError(f"no forward node of the graph belongs to block {path!r}")
    keep = (set(save) & set(nodes)) | forced_saves(graph, path, nodes)
    return Region(path, nodes, frozenset(keep))


def cached(graph: Graph, r: Region) -> frozenset[str]:
    """The saved nodes whose outputs the policy caches: those the backward pass reads (the
    others' outputs are freed after the forward and made again if the recomputation passes).

    An op that eager runs in place (``Node.eager_in_place``: dropout's ``div_`` on its noise)
    is not cached unless something outside the region reads it: the policy caches op outputs,
    and caching an in-place op would skip its write when the recomputation runs the ops
    before it again, so it runs again with them, from the storage's maker on."""
    bwd_reads = {x for n in graph.backward_nodes for x in n.inputs}
    forced = forced_saves(graph, r.path, r.nodes)
    return frozenset(
        nid
        for nid in r.save
        if any(o in bwd_reads for o in graph.node(nid).outputs)
        and (nid in forced or not graph.node(nid).eager_in_place)
    )


def admissible(graph: Graph, path: str) -> bool:
    """Whether block ``path`` can be a region: no op with side effects (batch norm updates
    its running statistics in place; the checkpoint would run it again), and no other block
    inside its module (``bert`` holds ``bert.encoder.layer.0``: wrapping it would checkpoint
    those too)."""
    all_blocks = blocks(graph)
    if any(other.startswith(path + ".") for other in all_blocks):
        return False
    return all(graph.node(nid).recomputable for nid in all_blocks.get(path, ()))


def checkpoint_plan(graph: Graph, regions: Iterable[Region]) -> Plan:
    """The plan that checkpoint regions execute (see the module docstring).

    Raises
    ------
    ValueError
        When a region is not :func:`admissible`.
    """
    given = list(regions)
    for r in given:
        if not admissible(graph, r.path):
            raise ValueError(
                f"block {r.path!r} cannot be a checkpoint region: it has ops with side effects "
                "(batch norm) or holds other blocks"
            )
    regs = [r for r in given if set(r.nodes) - r.save]
    nodes = graph.nodes
    block = _bwd_block(graph)
    keep_of = {r.path: cached(graph, r) for r in regs}
    region_of: dict[str, Region] = {}
    for r in regs:
        for nid in r.nodes:
            if nid not in keep_of[r.path]:
                region_of[nid] = r
    dropped = {o for nid in region_of for o in graph.node(nid).outputs}

    def freeable(v: str) -> bool:
        val = graph.value(v)
        return val.kind != "input" and not graph.is_static(v) and not graph.is_required(v)

    last_fwd: dict[str, int] = {}
    last_bwd: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for x in n.inputs:
            (last_fwd if n.phase == "forward" else last_bwd)[x] = i

    args_of: dict[str, list[str]] = {}  # block path -> the values its forward is given
    for val in graph.values:
        for path in val.held_by:
            args_of.setdefault(path, []).append(val.id)

    # Per region: the backward node that triggers its recomputation, the recomputed nodes, and
    # the end of its backward (when the checkpoint releases its inputs).
    trigger: dict[int, Region] = {}
    plan_of: dict[str, list[str]] = {}
    hold: dict[str, int] = {}
    pop_at: dict[str, int] = {}  # cached values that the recomputation takes from the cache
    popped: dict[str, list[str]] = {}
    for r in regs:
        members = set(r.nodes)
        made = {o for nid in r.nodes for o in graph.node(nid).outputs}
        bwd = [i for i, n in enumerate(nodes) if n.phase == "backward" and block[n.id] == r.path]
        reads = {x for i in bwd for x in nodes[i].inputs}
        packed = [
            i
            for i in bwd
            if any(
                graph.producer_of(x) is None or graph.producer_of(x).phase == "forward"  # type: ignore[union-attr]
                for x in nodes[i].inputs
            )
        ]
        needed = reads & {
            o for nid in region_of if region_of[nid] is r for o in graph.node(nid).outputs
        }
        if not packed or not needed:
            continue
        # An op saves tensors for its backward when a backward node of its own module reads
        # one of its inputs or outputs; the recomputation stops after the last such op.
        reads_by_module: dict[str, set[str]] = {}
        for i in bwd:
            reads_by_module.setdefault(nodes[i].module, set()).update(nodes[i].inputs)
        stop = max(
            (
                k
                for k, nid in enumerate(r.nodes)
                if (set(graph.node(nid).outputs) | set(graph.node(nid).inputs))
                & reads_by_module.get(graph.node(nid).module, set())
            ),
            default=-1,
        )
        if stop < 0:
            continue
        last = graph.node(r.nodes[stop])
        if not set(last.outputs) & reads_by_module.get(last.module, set()):
            # It saves only inputs, before its kernel runs: the recomputation stops there.
            stop -= 1
        todo = [nid for nid in r.nodes[: stop + 1] if nid not in keep_of[r.path]]
        trigger[_autograd_node_start(nodes, packed[0])] = r
        plan_of[r.path] = todo
        # The checkpoint's frame (region inputs, the policy's cache) lives until the last
        # backward node holding one of the region's saved tensors has run.
        end = packed[-1]
        for x in args_of.get(r.path, ()):
            # The frame holds the block's tensor arguments too, read by its ops or not.
            if freeable(x):
                hold[x] = max(hold.get(x, -1), end)
        for nid in todo:
            for x in graph.node(nid).inputs:
                src = graph.producer_of(x)
                if src is not None and src.id in members and x in made:
                    continue
                if freeable(x):
                    hold[x] = max(hold.get(x, -1), end)
        popped[r.path] = []
        for nid in r.nodes[: stop + 1]:
            # The policy's cache holds a cached output until the recomputation takes it.
            if nid in keep_of[r.path]:
                for o in graph.node(nid).outputs:
                    if freeable(o):
                        pop_at[o] = max(pop_at.get(o, -1), packed[0])
                        popped[r.path].append(o)
        for nid in r.nodes[stop + 1 :]:
            # A cached output that the early-stopped recomputation never reaches stays in the
            # policy's cache until the frame goes.
            if nid in keep_of[r.path]:
                for o in graph.node(nid).outputs:
                    if freeable(o):
                        hold[o] = max(hold.get(o, -1), end)

    steps: list[Step] = []
    resident: set[str] = set()

    def free(v: str) -> None:
        resident.discard(v)
        steps.append(Step(op="free", id=v))

    def live_after(v: str, i: int, *, recomputed: bool, taken: bool = False) -> bool:
        if graph.is_required(v) or last_fwd.get(v, -1) > i or hold.get(v, -1) > i:
            return True
        if not taken and pop_at.get(v, -1) >= i:
            return True
        if v in dropped and not recomputed:
            return False  # dropped after the forward: the recomputation makes it again
        return last_bwd.get(v, -1) > i

    for i, n in enumerate(nodes):
        if n.phase == "backward" and i in trigger:
            r = trigger[i]
            todo = plan_of[r.path]
            reads_left: dict[str, int] = {}
            for nid in todo:
                for x in graph.node(nid).inputs:
                    reads_left[x] = reads_left.get(x, 0) + 1
            for nid in todo:
                node = graph.node(nid)
                steps.append(Step(op="compute", id=nid))
                resident.update(o for o in node.outputs if freeable(o))
                for x in node.inputs:
                    reads_left[x] -= 1
                for v in (*node.inputs, *node.outputs):
                    done = v in resident and reads_left.get(v, 0) <= 0
                    if done and not live_after(v, i - 1, recomputed=True):
                        free(v)
            for v in popped[r.path]:
                if v in resident and not live_after(v, i - 1, recomputed=True, taken=True):
                    free(v)
        steps.append(Step(op="compute", id=n.id))
        resident.update(o for o in n.outputs if freeable(o))
        rec = n.phase == "backward"
        for v in (*n.inputs, *n.outputs):
            if v in resident and not live_after(v, i, recomputed=rec):
                free(v)
        for v in [h for h, at in hold.items() if at == i and h in resident]:
            if not live_after(v, i, recomputed=rec):
                free(v)
    return Plan(steps=tuple(steps))


def regions_of(graph: Graph, plan: Plan) -> list[Region]:
    """The regions a plan asks for: each block with a recomputed forward node, saving the nodes
    that the plan does not recompute (and the forced saves)."""
    counts = plan.compute_counts()
    out: list[Region] = []
    for path, nodes in blocks(graph).items():
        recomputed = {nid for nid in nodes if counts.get(nid, 0) > 1}
        if recomputed and admissible(graph, path):
            out.append(region(graph, path, set(nodes) - recomputed))
    return out


def project(graph: Graph, plan: Plan) -> Plan:
    """The plan of the class closest to ``plan``: the checkpoint plan of its regions."""
    return checkpoint_plan(graph, regions_of(graph, plan))


def _normal(plan: Plan) -> list[tuple[str, frozenset[str]]]:
    """Each compute with the set of frees that follow it (their order does not matter: memory
    is read at computes)."""
    out: list[tuple[str, set[str]]] = [("", set())]
    for s in plan.steps:
        if s.op == "compute":
            out.append((s.id, set()))
        else:
            out[-1][1].add(f"{s.op}:{s.id}")
    return [(c, frozenset(f)) for c, f in out]


def why_not(graph: Graph, plan: Plan) -> str | None:
    """None when ``plan`` is in the class, else the first difference, for an error message."""
    if any(s.op in ("offload", "prefetch") for s in plan.steps):
        return "it offloads values (the checkpoint executor does not offload)"
    mine, theirs = _normal(plan), _normal(project(graph, plan))
    for (a, fa), (b, fb) in zip(mine, theirs, strict=False):
        if a != b:
            return (
                f"it computes {a!r} where checkpoint regions compute {b!r} (a region is "
                "recomputed whole at its first use in the backward pass)"
            )
        if fa != fb:
            return (
                f"after computing {a!r} it releases {sorted(fa ^ fb)[:3]} differently from "
                "checkpoint regions"
            )
    if len(mine) != len(theirs):
        return f"it has {len(mine) - 1} computes, its checkpoint regions {len(theirs) - 1}"
    return None


def in_class(graph: Graph, plan: Plan) -> bool:
    """Whether the checkpoint executor runs ``plan`` as it is (same computes, same frees
    between them)."""
    return why_not(graph, plan) is None


@dataclass(frozen=True)
class Fit:
    """A plan of the class and its simulation."""

    plan: Plan
    simulation: Simulation
    regions: tuple[Region, ...]


def _densities(graph: Graph, r: Region) -> dict[str, float]:
    """Seconds of recomputation a node of region ``r`` saves per byte it holds when saved: its
    time over the bytes of its outputs that the backward pass reads (the ones the policy
    caches). Nodes whose outputs the backward does not read hold nothing when saved (``inf``)."""
    bwd_reads = graph.memo("checkpoint_class.bwd_reads", lambda: frozenset(
        x for n in graph.backward_nodes for x in n.inputs
    ))  # fmt: skip
    out: dict[str, float] = {}
    for nid in r.nodes:
        if nid in r.save:
            continue
        n = graph.node(nid)
        held = sum(graph.value(o).size_bytes for o in n.outputs if o in bwd_reads)
        out[nid] = math.inf if held == 0 else n.time_s / held
    return out


def fit(
    graph: Graph,
    budget_bytes: int,
    *,
    seeds: Iterable[Plan] = (),
    host_bandwidth_bytes_per_s: float | None = None,
    time_budget_s: float = 10.0,
) -> Fit:
    """The fastest plan of the class found within ``budget_bytes`` (or the smallest peak).

    Candidates, each judged by the simulator:

    1. the projections of ``seeds`` (other solvers' plans);
    2. a greedy search over whole regions: starting from no region, add the block whose
       region (every node recomputed that may be) lowers the simulated peak the most per
       second of recomputation, until the plan fits;
    3. selective regions: the nodes of every block ranked together by the recomputation time
       their saving spares per byte it holds (:func:`_densities`; in a tie, the later block
       first), and each plan saving a prefix of that ranking (a block none of whose values
       the backward reads is recomputed gets no region). The longest prefix that fits is
       found by bisection, then the few after it are tried, as peaks are not quite monotone
       in the prefix: the greedy knapsack by value density (as in selective activation
       checkpointing by op cost, Korthikanti et al. 2022), with the simulator as the judge.
       Then, block by block from the last (whose activations are held the shortest), its
       next densest node is saved too where the plan still fits and gets faster, until a
       pass changes nothing.

    Candidate 3 runs first: its bisection to the end (a simulation per halving), the rest
    within ``time_budget_s``; candidate 2 then stops when the budget is spent, provided a plan
    that fits is in hand (it always runs to a fit otherwise).
    """
    bw = host_bandwidth_bytes_per_s
    started = time.monotonic()

    def judge(regs: list[Region]) -> Fit:
        p = checkpoint_plan(graph, regs)
        return Fit(p, simulate(graph, p, host_bandwidth_bytes_per_s=bw), tuple(regs))

    def better(a: Fit, b: Fit | None) -> bool:
        if b is None:
            return True
        fa, fb = a.simulation.peak_bytes <= budget_bytes, b.simulation.peak_bytes <= budget_bytes
        if fa != fb:
            return fa
        if fa:
            return a.simulation.total_time_s < b.simulation.total_time_s
        return a.simulation.peak_bytes < b.simulation.peak_bytes

    best: Fit | None = None
    for s in seeds:
        cand = judge(regions_of(graph, s))
        if better(cand, best):
            best = cand
    chosen: list[Region] = []
    current = judge(chosen)
    if best is None or better(current, best):
        best = current
    if current.simulation.peak_bytes <= budget_bytes:
        return best  # eager fits: nothing is faster
    options: Mapping[str, Region] = {
        path: region(graph, path) for path in blocks(graph) if admissible(graph, path)
    }
    options = {p: r for p, r in options.items() if set(r.nodes) - r.save}
    found = _selective(graph, budget_bytes, judge, better, options, started + time_budget_s)
    if found is not None and better(found, best):
        best = found
    fits = best.simulation.peak_bytes <= budget_bytes
    deadline = started + time_budget_s
    while current.simulation.peak_bytes > budget_bytes and options:
        if fits and time.monotonic() > deadline:
            break  # a plan that fits is in hand; the greedy's next rounds are out of time
        scored: list[tuple[float, str, Fit]] = []
        for path, r in options.items():
            if fits and scored and time.monotonic() > deadline:
                break  # out of time: the round's best so far
            cand = judge([*chosen, r])
            gain = current.simulation.peak_bytes - cand.simulation.peak_bytes
            cost = max(cand.simulation.total_time_s - current.simulation.total_time_s, 1e-12)
            scored.append((gain / cost, path, cand))
        score, path, cand = max(scored, key=lambda t: t[0])
        if score <= 0:
            # No single block lowers the peak: take the one that recomputes the most.
            path, cand = min(
                ((p, f) for _, p, f in scored), key=lambda t: t[1].simulation.peak_bytes
            )
        chosen.append(options.pop(path))
        current = cand
        if better(current, best):
            best = current
    return best


def _selective(
    graph: Graph,
    budget_bytes: int,
    judge: Callable[[list[Region]], Fit],
    better: Callable[[Fit, Fit | None], bool],
    options: Mapping[str, Region],
    deadline: float,
) -> Fit | None:
    """Candidate 3 of :func:`fit`: save a prefix of every block's nodes ranked by density."""
    dens = {path: _densities(graph, r) for path, r in options.items()}
    paths = list(options)  # graph order (blocks() lists them by first forward node)
    ranked = sorted(
        (
            (-d, -k, -graph.node(nid).time_s, path, nid)
            for k, path in enumerate(paths)
            for nid, d in dens[path].items()
            if d != math.inf
        ),
    )  # densest first; in a tie, the later block first
    order = [(path, nid) for *_, path, nid in ranked]
    finite = {path: {nid for nid, d in dens[path].items() if d != math.inf} for path in paths}

    def judge_saved(saved: Mapping[str, set[str]]) -> Fit:
        regs = []
        for path in paths:
            if finite[path] and saved[path] >= finite[path]:
                continue  # every value its backward reads is kept: no region
            r = options[path]
            regs.append(Region(r.path, r.nodes, frozenset(r.save | saved[path])))
        return judge(regs)

    def prefix_of(n: int) -> dict[str, set[str]]:
        saved: dict[str, set[str]] = {path: set() for path in paths}
        for path, nid in order[:n]:
            saved[path].add(nid)
        return saved

    best_saved = prefix_of(0)
    best = judge_saved(best_saved)
    if best.simulation.peak_bytes > budget_bytes:
        return best
    lo, hi = 0, len(order)  # the longest prefix that fits, by bisection (peaks grow with it)
    while lo < hi:  # a few dozen simulations at most: always run to the end
        mid = (lo + hi + 1) // 2
        saved = prefix_of(mid)
        cand = judge_saved(saved)
        if cand.simulation.peak_bytes <= budget_bytes:
            lo = mid
            if better(cand, best):
                best, best_saved = cand, saved
        else:
            hi = mid - 1
    # peaks are not quite monotone in the prefix: a few longer ones may still fit
    for n in range(lo + 1, min(lo + 9, len(order) + 1)):
        if time.monotonic() > deadline:
            break
        saved = prefix_of(n)
        cand = judge_saved(saved)
        if better(cand, best):
            best, best_saved = cand, saved
    # then block by block, from the last (its activations are held the shortest), its next
    # densest node saved too while the plan still fits and gets faster
    own = {path: [nid for path_, nid in order if path_ == path] for path in paths}
    changed = True
    while changed:
        changed = False
        for path in reversed(paths):
            if time.monotonic() > deadline:
                return best
            rest = [nid for nid in own[path] if nid not in best_saved[path]]
            if not rest:
                continue
            trial = {**best_saved, path: best_saved[path] | {rest[0]}}
            cand = judge_saved(trial)
            if better(cand, best):
                best, best_saved, changed = cand, trial, True
    return best


__all__ = [
    "Fit",
    "Region",
    "admissible",
    "blocks",
    "cached",
    "checkpoint_plan",
    "fit",
    "forced_saves",
    "in_class",
    "project",
    "region",
    "regions_of",
    "why_not",
]
