"""``remat.apply(model, result, mode="checkpoint")``: the model's own modules in checkpoint regions.

An ordinary eager training loop (optimizer, ``torch.autocast``, ``DistributedDataParallel``) keeps
working: the model's own modules run, with a non-reentrant ``torch.utils.checkpoint`` region
around each block (``remat.ir.block_key`` of the module path: ``blocks.3``, ``layers.0``) in
which the plan recomputes something, and a selective-checkpoint policy per ATen op: ops whose
result the plan keeps for the backward pass are saved (``MUST_SAVE``), the others are
recomputed. Ops are matched to the graph's nodes by their order inside the block and their name
(in-place and functional forms of an op match). Random ops recompute with the generator state
of their first run (``checkpoint`` preserves it), so dropout masks are the same. A region whose
module writes into its input in place (``nn.Dropout(inplace=True)``) gets a copy of it, since
the checkpoint holds the input to recompute from.

A block the plan offloads instead of recomputing runs its own ``forward`` with its saved
tensors moved to host memory and brought back as its backward begins
(:mod:`remat.executor.offload_blocks`).

Only plans of the checkpoint class run (:mod:`remat.ir.checkpoint_class`: what such regions
and offloaded blocks do, written as a plan, so the simulator predicts this executor exactly;
``remat.solve(..., executor="checkpoint")`` solves for it). Any other plan is refused with the
difference, pointing to the op-level ``remat.apply(model, result)``, which runs every plan.
:func:`module_plan` still describes how an arbitrary plan maps to module-level regions.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from remat.executor.hostmem import HostMemory
from remat.executor.offload_blocks import OffloadBlock, offload_block, offloading
from remat.executor.op_match import OpMatcher
from remat.executor.opexec import ExecutorError, capture_for, plan_to_run
from remat.ir import Graph, InvalidPlanError, Plan, SolveResult, simulate
from remat.ir.cuts import block_key

_OP_OOP = "use remat.compile_step(model, example_inputs, loss_fn, result) (the op-level executor)"


class ModuleLevelWarning(UserWarning):
    """A plan was approximated at module level; the op-level executor runs it exactly."""


@dataclass(frozen=True)
class Region:
    """One checkpointed block: its module path and the forward nodes the plan recomputes."""

    path: str
    nodes: tuple[str, ...]
    """Forward node ids of the block, in graph order."""
    save: frozenset[str]
    """Nodes whose outputs are saved for the backward pass (not recomputed)."""
    recompute: frozenset[str]
    span: tuple[int, int] | None = None
    """For a run of children of the ``nn.Sequential`` at ``path``: ``[start, stop)``."""


@dataclass
class ModulePlan:
    """A plan expressed at module level (see the module docstring)."""

    regions: list[Region]
    offload: frozenset[str]
    """Value ids to offload when saved for the backward pass."""
    graph: Graph = field(repr=False)
    approximations: list[str] = field(default_factory=list)
    """What of the plan could not be expressed at module level (see :func:`module_plan`)."""
    offloaded: tuple[OffloadBlock, ...] = ()
    """Blocks whose saved tensors go to host memory (:mod:`remat.executor.offload_blocks`)."""
    hosts: dict[torch.device, HostMemory] = field(default_factory=dict, repr=False)
    """The host memory of the offloaded blocks, per device (bytes held, moved)."""


def module_plan(
    graph: Graph,
    plan: Plan,
    *,
    strict: bool = False,
    sequences: dict[str, list[str]] | None = None,
) -> ModulePlan:
    """Translate ``plan`` into checkpoint regions and offloads (see the module docstring).

    Parameters
    ----------
    strict
        Raise when a part of the plan cannot be expressed at module level. When False (the
        default) that part is approximated (a value recomputed outside any submodule is kept, a
        value recomputed twice is recomputed once, an offload inside a checkpointed block is
        dropped), each approximation is listed in ``ModulePlan.approximations``, and a
        :class:`ModuleLevelWarning` says so.
    sequences
        ``nn.Sequential`` containers of the model: path -> its children's paths, in order.
        Consecutive children may then form one region (:func:`apply` passes them).

    Raises
    ------
    ExecutorError
        With ``strict``, when the plan cannot be expressed at module level; always when the plan
        does not belong to ``graph``.
    """
    from remat.ir import InvalidPlanError

    try:
        simulate(graph, plan)
    except InvalidPlanError as exc:
        raise ExecutorError(f"the plan does not fit the graph {graph.name!r}: {exc}") from exc
    notes: list[str] = []

    def cannot(msg: str) -> None:
        if strict:
            raise ExecutorError(f"{msg}: {_OP_OOP}")
        notes.append(msg)

    counts = plan.compute_counts()
    fwd = graph.forward_nodes
    for n in graph.nodes:
        if n.phase == "forward" and counts.get(n.id, 0) > 2:
            cannot(
                f"the plan computes node {n.id!r} ({n.op}) {counts[n.id]} times; module-level "
                "checkpointing recomputes a block once"
            )
        if n.phase == "backward" and counts.get(n.id, 0) > 1:
            cannot(f"the plan recomputes backward node {n.id!r}")
    by_block: dict[str, list[str]] = {}
    for n in fwd:
        by_block.setdefault(block_key(n.module) if n.module else "", []).append(n.id)
    recomputed = {n.id for n in fwd if counts.get(n.id, 0) > 1}
    bwd_reads = {x for n in graph.backward_nodes for x in n.inputs}

    def useful(ids: list[str]) -> bool:
        """Whether checkpointing these nodes frees something: a checkpoint region frees only
        what its ops save for backward inside it; a value handed to later ops stays alive
        through them."""
        members = set(ids)
        for i in ids:
            if i not in recomputed:
                continue
            for o in graph.node(i).outputs:
                leaves = any(
                    c.phase == "forward" and c.id not in members for c in graph.consumers_of(o)
                )
                if o in bwd_reads and not leaves:
                    return True
        return False

    def region(path: str, ids: list[str], span: tuple[int, int] | None = None) -> Region:
        save = {
            i
            for i in ids
            if i not in recomputed
            and (
                not graph.node(i).recomputable or any(o in bwd_reads for o in graph.node(i).outputs)
            )
        }
        rec = frozenset(i for i in ids if i in recomputed)
        return Region(path, tuple(ids), frozenset(save), rec, span)

    # Blocks that are children of an nn.Sequential may be grouped into one region (a run of
    # consecutive children, as torch.utils.checkpoint.checkpoint_sequential does) when a block
    # alone would free nothing: an MLP's Linear and ReLU modules, for instance.
    seq_of: dict[str, tuple[str, int]] = {}
    for parent, children in (sequences or {}).items():
        for k, child in enumerate(children):
            seq_of[child] = (parent, k)
    regions: list[Region] = []
    pending: dict[str, list[tuple[int, str, list[str]]]] = {}
    for path, ids in by_block.items():
        rec = [i for i in ids if i in recomputed]
        if path == "":
            if rec:
                cannot(
                    f"the plan recomputes {len(rec)} ops of the model's own forward or of the "
                    f"loss (outside any submodule, e.g. {rec[0]!r}, {graph.node(rec[0]).op}); "
                    "there is no module to checkpoint, so they are kept"
                )
            continue
        if path in seq_of:
            parent, k = seq_of[path]
            pending.setdefault(parent, []).append((k, path, ids))
            continue
        if not rec:
            continue
        if useful(ids):
            regions.append(region(path, ids))
        else:
            notes.append(
                f"block {path!r}: its recomputed values leave the block, checkpointing it "
                "would free nothing, so it is not wrapped"
            )
    for parent, blocks in pending.items():
        blocks.sort()
        run: list[tuple[int, str, list[str]]] = []

        def close(run: list[tuple[int, str, list[str]]], parent: str = parent) -> None:
            if not run:
                return
            ids = [i for _, _, b in run for i in b]
            if useful(ids):
                a, b = run[0][0], run[-1][0] + 1
                regions.append(
                    region(run[0][1], ids) if b - a == 1 else region(parent, ids, (a, b))
                )
            else:
                notes.append(
                    f"blocks {run[0][1]!r}..{run[-1][1]!r}: their recomputed values leave them, "
                    "checkpointing would free nothing, so they are not wrapped"
                )

        for k, path, ids in blocks:
            has_rec = any(i in recomputed for i in ids)
            contiguous = bool(run) and run[-1][0] == k - 1
            if run and (not has_rec or not contiguous or useful([i for *_, b in run for i in b])):
                close(run)
                run = []
            if has_rec:
                run.append((k, path, ids))
        close(run)
    offload = {s.id for s in plan.steps if s.op == "offload"}
    in_region = {i for r in regions for i in r.nodes}
    for v in sorted(offload):
        p = graph.producer_of(v)
        if p is not None and p.id in in_region:
            cannot(
                f"the plan offloads {v!r}, made inside the checkpointed block "
                f"{block_key(p.module)!r}, where saved-tensor hooks do not reach; it is kept"
            )
            offload.discard(v)
    if notes:
        warnings.warn(
            "remat.apply approximates the plan at module level: "
            + "; ".join(notes)
            + f". For the exact plan, {_OP_OOP}.",
            ModuleLevelWarning,
            stacklevel=3,
        )
    return ModulePlan(regions, frozenset(offload), graph, notes)


def _written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an in-place op writes to."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        x = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(x, torch.Tensor):
            out.append(x)
    return out


def _policy_for(graph: Graph, region: Region) -> Callable[[], Any]:
    """A ``context_fn`` for ``checkpoint``: a fresh selective policy for each forward call.

    Saved (cached) results must not change under the recomputation: an in-place op that writes
    into a saved storage (``relu_`` after batch norm, ``out += identity``) is saved too, so that
    the recomputation skips it as well and reads the final contents, as the first run did.
    """

    def context_fn() -> Any:
        matcher = OpMatcher(graph, region.nodes)
        cached: set[int] = set()

        def save(out: Any) -> CheckpointPolicy:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    cached.add(id(t.untyped_storage()))
            return CheckpointPolicy.MUST_SAVE

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            node = matcher.match(func)
            if func._schema.is_mutable and any(
                id(t.untyped_storage()) in cached for t in _written_args(func, args, kwargs)
            ):
                return save(ctx.op_output)
            if (
                node is not None
                and node in region.save
                and graph.node(node).recomputable
                and not func._schema.is_mutable
            ):
                return save(ctx.op_output)
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)

    return context_fn


def _is_cache(x: Any) -> bool:
    """A transformers key/value cache (``DynamicCache`` and its kin): its ``update`` appends."""
    t = type(x)
    return (
        t.__module__.startswith("transformers.") and "Cache" in t.__name__ and hasattr(x, "update")
    )


def _refuse_caches(forward: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> None:
    """A region whose call carries a cache cannot be replayed: recomputing it would append to
    the cache again, and torch.utils.checkpoint fails at the first backward ("... encountered
    during backward but not found in storage"). Refused at the call, before any backward."""
    for name, x in [*enumerate(args), *kwargs.items()]:
        if _is_cache(x):
            raise ExecutorError(
                f"{getattr(forward, '__qualname__', 'a checkpointed block')} is called with a "
                f"key/value cache (argument {name!r}: {type(x).__name__}), which a checkpoint "
                "region cannot replay. Train with the cache off: model.config.use_cache = False "
                "or use_cache=False in the call (transformers' gradient_checkpointing_enable() "
                "turns it off too), or run the plan op by op: remat.apply(model, result)"
            )


def _checkpointed(
    forward: Callable[..., Any], context_fn: Callable[[], Any], buffers: list[torch.Tensor]
) -> Callable[..., Any]:
    """``forward`` in a non-reentrant checkpoint region. The buffers the block updates in place
    (batch-norm running statistics) are restored after its recomputation, so that the step
    updates them once, as the eager step does."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        _refuse_caches(forward, args, kwargs)
        calls = [0]

        def once(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1 or not buffers:
                return forward(*a, **k)
            with torch.no_grad(), _disable_current_modes():
                saved = [b.clone() for b in buffers]
            try:
                return forward(*a, **k)
            finally:
                with torch.no_grad(), _disable_current_modes():
                    for b, s in zip(buffers, saved, strict=True):
                        b.copy_(s)

        return checkpoint(once, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def _cloning_inputs(forward: Callable[..., Any]) -> Callable[..., Any]:
    """For a region whose module writes into its input (``nn.Dropout(inplace=True)``): the
    checkpoint holds the input to recompute from, so the in-place op inside the region gets a
    copy. The graph (functionalized) counts that copy already: its output is a new value."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        return forward(*args, **kwargs)

    return run


@dataclass
class _Applied:
    plan: ModulePlan
    originals: dict[str, Any]


def apply_checkpoint(
    model: nn.Module,
    result: SolveResult | Plan,
    graph: Graph | None = None,
    *,
    example_inputs: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> nn.Module:
    """Rewrite ``model`` in place so that its eager training step runs ``result``'s plan.

    Parameters
    ----------
    model
        The model the plan was solved for. Parameter names and the state dict are unchanged.
    result
        A :class:`~remat.ir.SolveResult` (or a :class:`~remat.ir.Plan`).
    graph
        The graph the plan was solved on (``remat.trace(model, inputs, loss_fn)``). When None,
        ``example_inputs`` (and ``loss_fn``) are traced again to get it.

    Returns
    -------
    nn.Module
        ``model`` itself. :func:`remove` undoes the rewrite.

    Raises
    ------
    ExecutorError
        When no graph is given, the plan is not of it, or the plan is not of the checkpoint
        class (the message says how to solve for that class or run it op by op).
    """
    plan = plan_to_run(result)
    if graph is None:
        if example_inputs is None:
            raise ExecutorError(
                "remat.apply needs the traced graph the plan was solved on: pass graph= "
                "(remat.trace(model, inputs, loss_fn)) or example_inputs= and loss_fn="
            )
        graph = capture_for(model, example_inputs, loss_fn, plan=plan).graph
    if getattr(model, "_remat_applied", None) is not None:
        remove(model)
    mplan = regions_plan(graph, checked_plan(graph, plan))
    model._remat_applied = _Applied(mplan, install(model, mplan))  # type: ignore[assignment]
    return model


def checked_plan(graph: Graph, result: SolveResult | Plan) -> Plan:
    """``result``'s plan, refused unless it is a valid plan of ``graph`` in the checkpoint
    class (the message says how to solve for that class or run it op by op)."""
    from remat.ir import checkpoint_class

    plan = plan_to_run(result)
    try:
        simulate(graph, plan)
    except InvalidPlanError as exc:
        raise ExecutorError(f"the plan does not fit the graph {graph.name!r}: {exc}") from exc
    why = checkpoint_class.why_not(graph, plan)
    if why is not None:
        raise ExecutorError(
            "remat.apply(mode='checkpoint') runs only plans of its class, and this one is not: "
            f"{why}. Solve for it with remat.solve(graph, budget, executor='checkpoint'), or "
            "run this plan with remat.apply(model, result) (op-level, any plan)"
        )
    return plan


def regions_plan(graph: Graph, plan: Plan) -> ModulePlan:
    """The checkpoint regions that run ``plan`` (of the checkpoint class: :func:`checked_plan`)."""
    from remat.ir import checkpoint_class

    regions = []
    for r in checkpoint_class.regions_of(graph, plan):
        keep = checkpoint_class.cached(graph, r)
        regions.append(Region(r.path, r.nodes, keep, frozenset(r.nodes) - keep))
    offloaded = tuple(offload_block(graph, p) for p in checkpoint_class.offloads_of(graph, plan))
    return ModulePlan(regions, frozenset(), graph, offloaded=offloaded)


def install(model: nn.Module, mplan: ModulePlan) -> dict[str, Any]:
    """Wrap each region's block ``forward`` in its checkpoint, and each offloaded block's in
    its saved-tensor hooks; the blocks' own ``forward`` attributes before (None: the
    class's), for :func:`uninstall`."""
    originals: dict[str, Any] = {}

    def block(path: str) -> nn.Module:
        try:
            mod = model.get_submodule(path)
        except AttributeError as exc:
            uninstall(model, originals)
            raise ExecutorError(
                f"the plan's block {path!r} is not a submodule of this model: was the "
                f"graph traced from it? ({exc})"
            ) from exc
        originals[path] = mod.__dict__.get("forward")
        return mod

    for region in mplan.regions:
        mod = block(region.path)
        fwd = _cloning_inputs(mod.forward) if getattr(mod, "inplace", False) else mod.forward
        mod.forward = _checkpointed(fwd, _policy_for(mplan.graph, region), list(mod.buffers()))
    for off in mplan.offloaded:
        mod = block(off.path)
        mod.forward = offloading(mod.forward, mplan.graph, off, mplan.hosts)
    return originals


def uninstall(model: nn.Module, originals: dict[str, Any]) -> None:
    """Undo :func:`install`."""
    for path, original in originals.items():
        mod = model.get_submodule(path) if path else model
        if original is None:
            mod.__dict__.pop("forward", None)
        else:
            mod.forward = original


def remove(model: nn.Module) -> nn.Module:
    """Undo ``remat.apply`` (either mode): the model's modules run their own ``forward`` again."""
    applied = getattr(model, "_remat_applied", None)
    if applied is None:
        return model
    take_off = getattr(applied, "take_off", None)
    if take_off is not None:  # per-call checkpoint regions (remat.executor.checkpoint_calls)
        take_off(model)
    if not isinstance(applied, _Applied):  # a replaced model forward (op level, or per call)
        original = applied.original_forward
        if original is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = original
        del model._remat_applied
        return model
    uninstall(model, applied.originals)
    del model._remat_applied
    return model


def applied_plan(model: nn.Module) -> ModulePlan | None:
    """The module-level plan applied to ``model``, if any."""
    applied = getattr(model, "_remat_applied", None)
    plan = getattr(applied, "plan", None)
    return plan if isinstance(plan, ModulePlan) else None


__all__ = [
    "ModuleLevelWarning",
    "ModulePlan",
    "Region",
    "applied_plan",
    "apply_checkpoint",
    "checked_plan",
    "install",
    "module_plan",
    "regions_plan",
    "remove",
    "uninstall",
]
