"""Plans every part of remat needs: the eager schedule, and a schedule from a set of kept values.

``eager_plan`` is what PyTorch does without remat: every node once, in graph order, each value
freed right after its last use. ``keep_plan`` is checkpointing in its general form (Chen et al.
2016 on a DAG): the forward pass keeps only the values in ``keep`` (and what later forward
nodes still read), and the backward pass recomputes a dropped value, from the nearest values
still on the device, the first time a backward node needs it; a recomputed value then lives
until its last backward use. The baselines and the chain solvers' expansions build on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from remat.ir.errors import InvalidPlanError
from remat.ir.graph import STATIC_KINDS, Graph
from remat.ir.plan import Plan, Step, step_maker


def eager_plan(graph: Graph) -> Plan:
    """Every node once in graph order; each dynamic value freed right after its last reader,
    or after the node named by its ``eager_free_after`` when that runs later (where plain
    eager PyTorch holds it longer, see :class:`remat.ir.Value`).

    A value nobody reads (and that is not required) is freed right after it is computed.
    Inputs, static values and required values are never freed.
    """
    last_use: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for x in n.inputs:
            last_use[x] = i
    frees_after: dict[int, list[str]] = {}
    for v in graph.values:
        if not _freeable(graph, v.id):
            continue
        p = graph.producer_position(v.id)
        if p is None:
            continue
        at = max(p, last_use.get(v.id, p))
        if v.eager_free_after is not None:
            at = max(at, graph.node_position(v.eager_free_after))
        frees_after.setdefault(at, []).append(v.id)
    steps: list[Step] = []
    step = step_maker(graph)
    for i, n in enumerate(graph.nodes):
        steps.append(step("compute", n.id))
        steps.extend(step("free", f) for f in frees_after.get(i, ()))
    return Plan(steps=tuple(steps))


def _freeable(graph: Graph, value_id: str) -> bool:
    v = graph.value(value_id)
    return v.kind != "input" and not graph.is_static(value_id) and not graph.is_required(value_id)


def keep_plan(graph: Graph, keep: Iterable[str]) -> Plan:
    """Checkpointing from a keep set: drop forward values not in ``keep``, recompute on demand.

    Parameters
    ----------
    graph
        The step.
    keep
        Forward values to keep from their computation until their last backward use. Outputs
        of non-recomputable nodes, and of backward nodes that a forward node reads, are always
        kept (only forward nodes are recomputed here). Passing every forward value gives the
        eager plan, except that each value is freed at its last use (``eager_free_after`` is
        the eager plan's alone).

    Raises
    ------
    InvalidPlanError
        When a dropped value cannot be recomputed (a backward node reads a value whose producer
        is not a forward node).
    """
    nodes = graph.nodes
    keep_set = set(keep)
    freeable, fwd_last, bwd_readers, fixed = graph.memo(
        "plan_builders.keep_plan", lambda: _keep_plan_facts(graph)
    )
    keep_set.update(fixed)
    required = graph.required_set()
    step = step_maker(graph)

    def last_bwd(v: str) -> int:
        lst = bwd_readers.get(v)
        return lst[-1] if lst else -1

    # Outputs of non-recomputable nodes (batch norm) and backward-made values a forward node
    # reads cannot be made again: hold each one while a forward value that may have to be
    # recomputed from it is still read by the backward pass.
    # ext[x]: the last backward position at which a recomputation may read x (conservative).
    ext: dict[str, int] = {}
    for n in reversed(nodes) if fixed & freeable else ():  # nothing to hold: skip the pass
        if n.phase != "forward" and not any(o in fixed for o in n.outputs):
            continue
        for o in n.outputs:
            reach = -1
            for k in graph.consumer_positions(o):
                c = nodes[k]
                if c.phase != "forward" or not c.recomputable:
                    continue
                for oo in c.outputs:
                    need = ext.get(oo, -1)
                    if oo not in keep_set:
                        need = max(need, last_bwd(oo))
                    reach = max(reach, need)
            ext[o] = reach
    hold = {
        o: max(last_bwd(o), ext.get(o, -1))
        for n in nodes
        for o in n.outputs
        if o in fixed and o in freeable
    }

    steps: list[Step] = []
    resident: set[str] = set()  # freeable values on the device

    def free(v: str) -> None:
        resident.discard(v)
        steps.append(step("free", v))

    def needed_later(v: str, pos: int) -> bool:
        """Read directly by a node after position ``pos`` (in the unmodified order), or held
        for a recomputation (see ``hold``)."""
        return (
            v in required or fwd_last.get(v, -1) > pos or last_bwd(v) > pos or hold.get(v, -1) > pos
        )

    for i, n in enumerate(nodes):
        if n.phase == "forward":
            steps.append(step("compute", n.id))
            resident.update(o for o in n.outputs if o in freeable)
            for v in (*n.inputs, *n.outputs):
                if v not in resident:
                    continue
                if fwd_last.get(v, -1) > i or v in required:
                    continue
                if v in keep_set and max(last_bwd(v), hold.get(v, -1)) > i:
                    continue
                free(v)
            continue

        # Backward node: bring back what it reads, then run it.
        missing = [x for x in n.inputs if (x not in resident and x in freeable)]
        if missing:
            _recompute(graph, missing, resident, steps, i, needed_later, freeable)
        steps.append(step("compute", n.id))
        resident.update(o for o in n.outputs if o in freeable)
        for v in (*n.inputs, *n.outputs):
            if v in resident and not needed_later(v, i):
                free(v)
        for v in [h for h in hold if h in resident and hold[h] == i]:
            if not needed_later(v, i):
                free(v)  # held for recomputations that are now all done
    return Plan(steps=tuple(steps))


def _keep_plan_facts(
    graph: Graph,
) -> tuple[frozenset[str], dict[str, int], dict[str, list[int]], frozenset[str]]:
    """What :func:`keep_plan` reads whatever the keep set (computed once per graph): the
    freeable values, each value's last forward reader, its backward readers (ascending) and
    the values it cannot make again, always kept: outputs of non-recomputable nodes, and of
    backward nodes that a forward node reads (a graph may list a backward node before such a
    reader; recomputation runs forward nodes only)."""
    required = graph.required_set()
    freeable = frozenset(
        v.id
        for v in graph.values
        if v.kind != "input"
        and v.kind not in STATIC_KINDS
        and v.id not in required  # a required gradient is static, any other required is kept
    )
    fwd_last: dict[str, int] = {}  # last forward reader
    bwd_readers: dict[str, list[int]] = {}  # backward readers, ascending
    for i, n in enumerate(graph.nodes):
        for x in n.inputs:
            if n.phase == "forward":
                fwd_last[x] = i
            else:
                lst = bwd_readers.setdefault(x, [])
                if not lst or lst[-1] != i:
                    lst.append(i)
    fixed = frozenset(
        o
        for n in graph.nodes
        for o in n.outputs
        if not n.recomputable or (n.phase != "forward" and o in fwd_last)
    )
    return freeable, fwd_last, bwd_readers, fixed


def _recompute(
    graph: Graph,
    missing: list[str],
    resident: set[str],
    steps: list[Step],
    pos: int,
    needed_later: Callable[[str, int], bool],
    freeable: frozenset[str],
) -> None:
    """Recompute ``missing`` values from what is resident, in graph order, freeing as it goes."""
    todo: set[int] = set()
    stack = list(missing)
    while stack:
        v = stack.pop()
        p = graph.producer_position(v)
        if p is None:
            raise InvalidPlanError(f"value {v!r} is needed but has no producer to recompute it")
        node = graph.nodes[p]
        if node.phase != "forward" or not node.recomputable:
            raise InvalidPlanError(
                f"value {v!r} was dropped but its producer {node.id!r} cannot be recomputed"
            )
        if p in todo:
            continue
        todo.add(p)
        stack.extend(x for x in node.inputs if (x not in resident and x in freeable))
    step = step_maker(graph)
    order = sorted(todo)
    # Remaining reads of each value inside this batch.
    batch_reads: dict[str, int] = {}
    for p in order:
        for x in graph.nodes[p].inputs:
            batch_reads[x] = batch_reads.get(x, 0) + 1
    for p in order:
        node = graph.nodes[p]
        steps.append(step("compute", node.id))
        for o in node.outputs:
            if o in freeable:
                resident.add(o)
        for x in node.inputs:
            batch_reads[x] -= 1
        for v in (*node.inputs, *node.outputs):
            if v not in resident:
                continue
            if batch_reads.get(v, 0) > 0:
                continue
            # Still wanted by the backward node about to run (pos) or a later one?
            if needed_later(v, pos - 1):
                continue
            resident.discard(v)
            steps.append(step("free", v))
