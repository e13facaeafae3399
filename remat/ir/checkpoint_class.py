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
(the model's own ``forward``, the loss) are never recomputed, and nothing is recomputed twice.

Offloaded blocks. A block that is not a region may instead be *offloaded*: the executor runs
its forward under ``torch.autograd.graph.saved_tensors_hooks`` that move the tensors its
autograd nodes save to host memory, and brings them back when the block's backward begins
(a hook on the gradient of the block's output). :func:`offloadable` says which values move:
activations the block makes that no other block reads (a value another block's backward
reads stays on the device, held by that block's autograd nodes, and one another block's
forward reads may be held by that block's checkpoint). As a
plan: each is offloaded once plain eager would have freed it in the forward (after its last
forward reader, or its ``eager_free_after`` node), and all are prefetched, in the order the
backward reads them, just before the block's first backward node (ahead of the all-gathers
FSDP2 issues at that point: the executor's hook is registered on the output before FSDP2's),
then freed after their last backward reader. The copies overlap compute on a GPU (one copy
stream per direction, :mod:`remat.executor.hostmem`); the first backward op of the block waits
for the first prefetch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from remat.ir.cuts import block_key
from remat.ir.graph import Graph, Node
from remat.ir.plan import Plan, Step


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


def _holds_blocks(graph: Graph, path: str) -> bool:
    def holders() -> frozenset[str]:
        paths = list(blocks(graph))
        return frozenset(p for p in paths if any(o.startswith(p + ".") for o in paths))

    return path in graph.memo("checkpoint_class.holders", holders)


def admissible(graph: Graph, path: str) -> bool:
    """Whether block ``path`` can be a region: no op with side effects (batch norm updates
    its running statistics in place; the checkpoint would run it again), and no other block
    inside its module (``bert`` holds ``bert.encoder.layer.0``: wrapping it would checkpoint
    those too)."""
    if _holds_blocks(graph, path):
        return False
    return all(graph.node(nid).recomputable for nid in blocks(graph).get(path, ()))


@dataclass(frozen=True)
class _OffloadFacts:
    """Per block: the values an offloaded block moves, where each is offloaded, and where the
    block's prefetches go."""

    values: Mapping[str, tuple[str, ...]]
    offload_after: Mapping[str, int]
    """Value -> index of the node after which it is offloaded."""
    prefetch_at: Mapping[str, int]
    """Block -> index of the node its prefetches go before."""
    prefetch_order: Mapping[str, tuple[str, ...]]
    """Block -> its values in the order its backward first reads them."""


def _offload_facts(graph: Graph) -> _OffloadFacts:
    nodes = graph.nodes
    block = _bwd_block(graph)
    pos = {n.id: i for i, n in enumerate(nodes)}
    first_bwd: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.phase == "backward" and block[n.id] and block[n.id] not in first_bwd:
            first_bwd[block[n.id]] = i
    prefetch_at: dict[str, int] = {}
    for path, i in first_bwd.items():
        i = _autograd_node_start(nodes, i)
        # FSDP2 issues its all-gathers from its own pre-backward hook on the same output,
        # registered after remat's: the prefetches come first.
        while i > 0 and nodes[i - 1].id.startswith("fsdp.all_gather.backward:"):
            i -= 1
        prefetch_at[path] = i
    first_read: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.phase == "backward":
            for x in n.inputs:
                first_read.setdefault(x, i)
    values: dict[str, list[str]] = {}
    offload_after: dict[str, int] = {}
    for path, members in blocks(graph).items():
        for nid in members:
            for o in graph.node(nid).outputs:
                val = graph.value(o)
                if val.kind != "activation" or graph.is_required(o) or graph.is_static(o):
                    continue
                readers = graph.consumers_of(o)
                bwd = [c for c in readers if c.phase == "backward"]
                if not bwd or any(block[c.id] != path for c in bwd):
                    continue
                if any(block[c.id] not in (path, "") for c in readers if c.phase == "forward"):
                    continue  # another block's forward reads it: a region there would hold it
                at = max([pos[nid], *(pos[c.id] for c in readers if c.phase == "forward")])
                if val.eager_free_after is not None:
                    if graph.node(val.eager_free_after).phase != "forward":
                        continue  # eager holds it into the backward: offloading frees nothing
                    at = max(at, pos[val.eager_free_after])
                if path not in prefetch_at or at >= prefetch_at[path]:
                    continue
                values.setdefault(path, []).append(o)
                offload_after[o] = at
    return _OffloadFacts(
        {p: tuple(v) for p, v in values.items()},
        offload_after,
        prefetch_at,
        {p: tuple(sorted(v, key=first_read.__getitem__)) for p, v in values.items()},
    )


def _facts(graph: Graph) -> _OffloadFacts:
    return graph.memo("checkpoint_class.offload", lambda: _offload_facts(graph))


def offloadable(graph: Graph, path: str) -> tuple[str, ...]:
    """The values block ``path`` moves to host memory when it is offloaded (see the module
    docstring), in the order they are made; empty when it has none."""
    return _facts(graph).values.get(path, ())


def prefetch_order(graph: Graph, path: str) -> tuple[str, ...]:
    """:func:`offloadable`'s values of block ``path`` in the order its backward first reads
    them: the order its prefetches are issued in."""
    return _facts(graph).prefetch_order.get(path, ())


def checkpoint_plan(graph: Graph, regions: Iterable[Region], offload: Iterable[str] = ()) -> Plan:
    """The plan that checkpoint regions (and offloaded blocks) execute (see the module
    docstring).

    Parameters
    ----------
    graph
        The step.
    regions
        The checkpoint regions.
    offload
        Paths of blocks whose saved tensors go to host memory (:func:`offloadable`); a block
        with nothing to offload adds nothing.

    Raises
    ------
    ValueError
        When a region is not :func:`admissible`, an offloaded block holds other blocks, or a
        block is both a region that recomputes something and offloaded.
    """
    given = list(regions)
    for r in given:
        if not admissible(graph, r.path):
            raise ValueError(
                f"block {r.path!r} cannot be a checkpoint region: it has ops with side effects "
                "(batch norm) or holds other blocks"
            )
    regs = [r for r in given if set(r.nodes) - r.save]
    off_blocks = sorted(set(offload))
    for path in off_blocks:
        if _holds_blocks(graph, path):
            raise ValueError(
                f"block {path!r} cannot be offloaded: it holds other blocks, whose saved "
                "tensors its hooks would see too"
            )
    both = sorted({r.path for r in regs} & set(off_blocks))
    if both:
        raise ValueError(
            f"block {both[0]!r} cannot be both a checkpoint region and offloaded: a region's "
            "saved tensors are the checkpoint's"
        )
    facts = _facts(graph)
    offload_after: dict[int, list[str]] = {}
    prefetch_before: dict[int, list[str]] = {}
    for path in off_blocks:
        for v in facts.values.get(path, ()):
            offload_after.setdefault(facts.offload_after[v], []).append(v)
        if path in facts.prefetch_order:
            prefetch_before.setdefault(facts.prefetch_at[path], []).extend(
                facts.prefetch_order[path]
            )
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
        for v in prefetch_before.get(i, ()):
            steps.append(Step(op="prefetch", id=v))
            resident.add(v)
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
        for v in offload_after.get(i, ()):
            steps.append(Step(op="offload", id=v))
            resident.discard(v)
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


def offloads_of(graph: Graph, plan: Plan) -> list[str]:
    """The blocks a plan offloads: those not recomputed (no region) that it moves any of the
    :func:`offloadable` values of to host memory."""
    moved = {s.id for s in plan.steps if s.op == "offload"}
    if not moved:
        return []
    recomputing = {r.path for r in regions_of(graph, plan)}
    return [
        path
        for path in blocks(graph)
        if path not in recomputing
        and not _holds_blocks(graph, path)
        and moved & set(offloadable(graph, path))
    ]


def project(graph: Graph, plan: Plan) -> Plan:
    """The plan of the class closest to ``plan``: the checkpoint plan of its regions and of
    the blocks it offloads from."""
    return checkpoint_plan(graph, regions_of(graph, plan), offloads_of(graph, plan))


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
    mine, theirs = _normal(plan), _normal(project(graph, plan))
    for (a, fa), (b, fb) in zip(mine, theirs, strict=False):
        if a != b:
            return (
                f"it computes {a!r} where checkpoint regions compute {b!r} (a region is "
                "recomputed whole at its first use in the backward pass)"
            )
        copies = sorted(x for x in fa ^ fb if not x.startswith("free:"))
        if copies:
            return (
                f"after computing {a!r} it offloads or prefetches differently ({copies[:3]}): "
                "the checkpoint executor offloads only whole blocks' saved tensors, each once "
                "eager frees it in the forward, all prefetched as the block's backward begins"
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


__all__ = [
    "Region",
    "admissible",
    "blocks",
    "cached",
    "checkpoint_plan",
    "forced_saves",
    "in_class",
    "offloadable",
    "offloads_of",
    "prefetch_order",
    "project",
    "region",
    "regions_of",
    "why_not",
]
