"""Capture one training step as a functional joint FX graph, and map it to the IR by storage.

How the step is captured
------------------------
``aot_function`` over ``torch.func.functional_call(model, (params, buffers), inputs)`` with a
partition function that keeps the joint forward+backward graph. Parameters, buffers and inputs
are always fake tensors (``FakeTensorMode``), so nothing the size of the model is allocated.
The joint graph is functional: views stay views, in-place updates of buffers (batch norm
running statistics) become out-of-place ops whose results are returned as extra outputs.
Tensors a model builds inside ``forward`` (``torch.tensor(...)``, masks, plain tensor attributes)
become ``get_attr`` constants holding real tensors.

Two things are done to make the graph mirror the eager step that it replaces:

* the process-wide patches of :mod:`remat.tracer.patches` (dropout, upsampling and a few losses
  traced through their eager C++ composites, RNNs as cells), applied under one lock;
* each module's path is recorded on the forward nodes (``meta["nn_module_stack"]``) by global
  module hooks; backward nodes take the module of the forward op with the same ``seq_nr``.

Random draws are then put in eager's memory order and parameter gradients that autograd would
copy into their parameter's layout are copied in the graph (:mod:`remat.tracer.joint_passes`),
the joint graph is mapped to the IR by :func:`remat.tracer.fx_to_ir.joint_to_ir`, and where
eager's Python frames hold forward storages past their last use is measured on a fake replay
of the forward and recorded on the values (:mod:`remat.tracer.eager_frees`, CPU target).

Fidelity to the eager step
--------------------------
The IR's ``none`` plan reproduces the eager CPU step's memory (``remat.executor.measure``)
exactly on the example models and on library-style models (manual attention with in-place
residuals, ``nn.MultiheadAttention``, RMSNorm, upsampling, user checkpointing). What it takes:
the C++ composites above; each backward autograd node (ops sharing a ``seq_nr``) holds its
inputs and its formula's intermediates until its last op, as eager releases them when the node
returns (functionalized ``copy_`` excepted); CPU loss kernels that keep an input-sized storage
for their scalar (``mse_loss`` & co); ``AccumulateGrad``'s layout copies; Python locals held
until ``forward`` returns (``Value.eager_free_after``); transformers' mask decided from the
position ids as eager decides it. Known differences: an in-place op on an activation is
functionalized into a new storage, so the IR counts one extra tensor while that op runs; the
loss's incoming gradient (4 bytes) is held from the start; RNNs are traced as unrolled cells,
where eager CPU runs a fused kernel with its own saved workspace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from remat.tracer.eager_frees import (
    eager_block_args,
    eager_forward_frees,
    eager_in_place_nodes,
    fold_eager_frees,
    replay_forward,
)
from remat.tracer.errors import TraceError
from remat.tracer.fx_to_ir import IrMapping, JointSignature, joint_to_ir
from remat.tracer.joint_passes import (
    bernoulli_in_memory_order,
    gradients_in_parameter_layout,
    held_until_backward,
    strip_returned,
)
from remat.tracer.patches import (
    capture_patches,
)
from remat.tracer.shadow import Shadows, seed_batch, shadowing

__all__ = ["Capture", "LossFn", "TraceError", "capture"]

LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class ModelOutput:
    """Where the step's output tensor sits in what the model returns (a captured step that
    ends at the model's output, the loss being the caller's)."""

    spec: pytree.TreeSpec
    leaves: list[Any]
    """The structure's leaves, None at :attr:`index`."""
    index: int

    returned: tuple[int, ...] = ()
    """Indices of the other tensor leaves that the step returns too (``return_outputs``)."""

    def rebuild(self, tensor: torch.Tensor, others: Sequence[torch.Tensor] = ()) -> Any:
        """The model's output with ``tensor`` in its place and ``others`` at
        :attr:`returned` (the other leaves as captured)."""
        leaves = list(self.leaves)
        leaves[self.index] = tensor
        for i, t in zip(self.returned, others, strict=True):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)


@dataclass
class Capture(IrMapping):
    """One captured training step: the FX joint graph and its IR graph, with the maps between.

    Attributes
    ----------
    joint
        The functional joint forward+backward ``GraphModule``. Call it as
        ``joint(primals, tangents)`` with ``primals = [*params, *buffers, *flat_inputs]`` (in the
        orders below) and ``tangents = [ones_like(loss)]``; it returns
        ``[*updated_buffers, loss, *grads]`` with one grad per primal (None where no gradient).
    graph
        The IR graph (costed by :func:`remat.tracer.trace`; ``capture`` fills in FLOPs and
        leaves ``time_s`` at 0).
    param_names, buffer_names
        Qualified names of the model's parameters (tied ones once) and buffers, in primal order.
    num_inputs
        Number of flattened example-input tensors (after params and buffers in the primals).
    input_spec
        ``pytree`` spec of ``example_inputs``; non-tensor leaves are in ``input_constants``.
    node_fx
        IR node id -> the FX node that it runs.
    value_fx
        IR value id -> the FX node (or ``getitem`` of a tuple output) whose result is the base
        tensor of that storage.
    value_aliases
        IR value id -> every FX node whose tensor lives in that storage (the base first, then
        views and aliases, graph order).
    fx_value
        FX node name -> IR value id of the storage its tensor lives in (tensor-valued nodes).
    param_values, buffer_values, input_values
        Parameter / buffer name -> IR value id; input values in flat-input order.
    tangent_value
        IR value id of the loss's incoming gradient.
    loss_value
        IR value id of the loss.
    grad_values
        Parameter name -> IR value id of its gradient (parameters with ``requires_grad``).
    buffer_updates
        Buffer name -> IR value id of its updated value (buffers the step mutates).
    output_roles
        One entry per joint output: ``("buffer", name)``, ``("loss", "")``, ``("grad", name)`` or
        ``("none", "")``.
    require_real
        Whether the capture was asked to check that the model's tensors are real (not on the
        meta device); it traced on fake tensors either way.
    target
        ``"cpu"`` or ``"cuda"``: whose eager step the graph mirrors (see :func:`capture`).
    """

    # The IR graph and its maps to the FX graph are IrMapping's fields (graph ... output_roles).
    joint: torch.fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    num_inputs: int
    input_spec: pytree.TreeSpec
    input_constants: dict[int, Any]
    require_real: bool
    requires_grad: dict[str, bool] = field(default_factory=dict)
    target: str = "cpu"
    returned: ModelOutput | None = None
    """Where the model returns its own loss inside a structure (a transformers
    ``ModelOutput`` with ``"loss"``, no ``loss_fn``): that structure, which ``forward`` then
    returns with the loss in place and its other tensors None (the plan frees them as eager
    would once the loss is made; eval and ``no_grad`` calls run the unmodified forward), or,
    captured with ``return_outputs=True``, its other tensors too (:attr:`returned_fx`)."""
    returned_fx: list[torch.fx.Node] = field(default_factory=list)
    """With ``return_outputs``: the FX node of each of :attr:`returned`'s other tensors (in
    ``returned.returned`` order). Their storages are inputs of every node that reads
    :attr:`tangent_value` in the IR graph, so that any plan holds them until the backward
    part begins (the forward returns them)."""
    output: ModelOutput | None = None
    """None when the step ends at a scalar loss (the tangent is ``ones``); else the step ends
    at the model's output (its value is :attr:`loss_value`, its incoming gradient
    :attr:`tangent_value`, shaped like it) and this says how to rebuild what ``forward``
    returns."""

    def run(self, primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> list[Any]:
        """Run the joint graph; one result per :attr:`output_roles` entry (None where none)."""
        out = self.joint(primals, tangents)
        return list(pytree.tree_leaves(out, is_leaf=lambda x: x is None))

    def primals(self, model: nn.Module, example_inputs: Any) -> list[torch.Tensor]:
        """The joint graph's primal arguments for ``model`` and ``example_inputs`` (real)."""
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        flat, _ = pytree.tree_flatten(_as_args(example_inputs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        return (
            [params[n] for n in self.param_names]
            + [buffers[n] for n in self.buffer_names]
            + tensors
        )

    @classmethod
    def of(
        cls,
        joint: torch.fx.GraphModule,
        mapping: IrMapping,
        signature: JointSignature,
        *,
        input_spec: pytree.TreeSpec,
        input_constants: dict[int, Any],
        require_real: bool = False,
        target: str = "cpu",
    ) -> Capture:
        """A capture from a joint graph, its :class:`IrMapping` and its signature."""
        return cls(
            joint=joint,
            **{f.name: getattr(mapping, f.name) for f in fields(mapping)},
            param_names=list(signature.param_names),
            buffer_names=list(signature.buffer_names),
            num_inputs=signature.num_inputs,
            input_spec=input_spec,
            input_constants=input_constants,
            require_real=require_real,
            requires_grad=dict(signature.requires_grad),
            target=target,
        )


# -- capture ----------------------------------------------------------------------------------


def _as_args(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments: a tensor, a tuple/list (positional) or a dict
    (keyword arguments, as Hugging Face models take them)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    raise TypeError(
        "example_inputs must be a tensor, a tuple/list of the model's positional arguments or "
        f"a dict of its keyword arguments, got {type(example_inputs).__name__}"
    )


class _ModuleTracker:
    """Global module hooks that keep a stack of module paths and put it on new FX nodes."""

    def __init__(self, model: nn.Module) -> None:
        self.paths: dict[int, str] = {}
        for name, mod in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(mod), name)
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def _publish(self) -> None:
        fx_traceback.current_meta["nn_module_stack"] = {p: (p, "") for p in self.stack if p}

    def _pre(self, mod: nn.Module, args: Any) -> None:
        path = self.paths.get(id(mod))
        if path is not None:
            self.stack.append(path)
            self._publish()

    def _post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self.paths.get(id(mod)) is not None and self.stack:
            self.stack.pop()
            self._publish()

    def __enter__(self) -> _ModuleTracker:
        reg = nn.modules.module
        self.handles = [
            reg.register_module_forward_pre_hook(self._pre),
            reg.register_module_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.stack.clear()


class _OpRecorder(TorchFunctionMode):
    """Remembers the torch function that raised last, and in which module, for error messages;
    computes the real values of data-independent tensors alongside (:mod:`remat.tracer.shadow`)."""

    def __init__(self, modules: _ModuleTracker, *, fused_attention: bool = False) -> None:
        super().__init__()
        self.modules = modules
        self.fused_attention = fused_attention
        self.failed: tuple[str, str, BaseException] | None = None
        self.shadows = Shadows()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        try:
            if self.fused_attention and func is torch.nn.functional.scaled_dot_product_attention:
                return _fused_attention(*args, **(kwargs or {}))
            return self.shadows.call(func, tuple(args), dict(kwargs or {}))
        except Exception as exc:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            mod = getattr(func, "__module__", None)
            if mod and mod.startswith("torch") and "." not in name:
                name = f"{mod}.{name}"
            self.failed = (str(name), self.modules.current(), exc)
            raise


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as a fused kernel (output and logsumexp saved, no
    attention matrix), which is what CUDA runs, dropout included; the CPU picks the unfused
    math path when dropout is on. Used for ``target="cuda"``."""
    if enable_gqa:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True
        )
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


def _to_fake(mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor like ``t``. Meta and accelerator tensors become CPU ones: kernels are
    chosen as on the CPU, and fake CUDA tensors abort a CPU-only build in backward."""
    if t.device.type != "cpu":
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    return mode.from_tensor(t.detach())


def capture(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    require_real: bool = False,
    target: str = "cpu",
    return_outputs: bool = False,
) -> Capture:
    """Capture one training step of ``model`` as a joint FX graph and its IR graph.

    Parameters
    ----------
    model
        Any ``nn.Module``. It is not modified (its parameters are swapped in functionally).
    example_inputs
        A tensor or a tuple of the model's positional arguments.
    loss_fn
        ``loss_fn(output) -> scalar``. When None, the model's output is the loss if it is a
        scalar, or its ``"loss"`` entry if it is a mapping holding a scalar there (a
        transformers ``ModelOutput`` given ``labels``: :attr:`Capture.returned`); otherwise
        (a tensor, or a structure such as a ``ModelOutput`` holding one tensor) the loss is
        the caller's: the step ends at that output and its backward takes
        the output's gradient (:attr:`Capture.output`; ``remat.apply``'s forward returns the
        output and autograd brings the gradient of the caller's loss).
    require_real
        The capture always runs on fake tensors (as ``aot_function`` does), so no memory the
        size of the model is allocated; ``require_real=True`` checks that the model's tensors
        are real (not on the meta device), as ``cost="measure"`` needs, and is recorded.
    target
        ``"cpu"`` (default): the graph is the eager CPU step (its memory matches
        :func:`remat.executor.measure` on the CPU; it runs on the CPU with the eager gradients).
        ``"cuda"``: ops are chosen as CUDA eager runs them, for planning a GPU from a CPU:
        dropout saves a 1-byte mask (``native_dropout``) instead of CPU's float noise, and
        attention is a fused kernel that saves its output and logsumexp, never the attention
        matrix (the CPU runs the unfused math path when attention has dropout). Such a graph is
        for planning; it need not run on the CPU.
    return_outputs
        For a model that returns its own loss in a structure (:attr:`Capture.returned`): the
        step returns the structure's other tensors too (a transformers model's logits), so
        the graph holds their storages until the backward part begins
        (:attr:`Capture.returned_fx`). Off by default: the plan may then free them at their
        last use inside the loss, as the training loop never reads them.

    Raises
    ------
    TraceError
        When the model cannot be traced; the message names the op and the module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if target not in ("cpu", "cuda"):
        raise ValueError(f"target must be 'cpu' or 'cuda', got {target!r}")
    args = _as_args(example_inputs)
    flat_args, input_spec = pytree.tree_flatten(args)
    tensor_pos = [i for i, x in enumerate(flat_args) if isinstance(x, torch.Tensor)]
    input_constants = {i: x for i, x in enumerate(flat_args) if not isinstance(x, torch.Tensor)}
    if require_real:
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.device.type == "meta":
                raise TraceError(
                    f"require_real=True needs real tensors, but {name!r} is on the meta device"
                )

    named_params = list(model.named_parameters())
    named_buffers = list(model.named_buffers())
    param_names = [n for n, _ in named_params]
    buffer_names = [n for n, _ in named_buffers]
    P, B = len(named_params), len(named_buffers)
    requires_grad = {n: bool(p.requires_grad) for n, p in named_params}

    captured: dict[str, Any] = {}

    def partition_fn(joint: torch.fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        from torch._functorch.partitioners import default_partition

        captured["joint"] = joint
        captured["num_fwd_outputs"] = kw.get("num_fwd_outputs")
        return default_partition(joint, joint_inputs, **kw)

    def step(*flat: torch.Tensor) -> torch.Tensor:
        params = dict(zip(param_names, flat[:P], strict=True))
        buffers = dict(zip(buffer_names, flat[P : P + B], strict=True))
        leaves = list(flat_args)
        for pos, t in zip(tensor_pos, flat[P + B :], strict=True):
            leaves[pos] = t
        call_args, call_kwargs = pytree.tree_unflatten(leaves, input_spec)
        seed_batch(recorder.shadows, call_kwargs, args[1])
        out = torch.func.functional_call(
            model, (params, buffers), tuple(call_args), dict(call_kwargs)
        )
        loss = loss_fn(out) if loss_fn is not None else _own_loss(out, captured)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            if return_outputs and captured.get("returned") is not None:
                # Detached: the joint graph gets them as forward outputs without a tangent.
                leaves = pytree.tree_leaves(out)
                others = captured["returned"].returned
                return (loss, *(leaves[i].detach() for i in others))
            return loss
        if loss_fn is None:
            # The loss is the caller's: the step ends at the model's output, whose gradient
            # is the backward's input.
            tensor, captured["output"] = _the_output(out)
            return tensor
        raise TraceError(
            "loss_fn must return a scalar tensor, got "
            + (
                f"shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
        )

    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode

    def identity(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        from torch._functorch.aot_autograd import make_boxed_func

        return make_boxed_func(gm.forward)

    modules = _ModuleTracker(model)
    recorder = _OpRecorder(modules, fused_attention=target == "cuda")
    # aot_function traces on fake tensors in any case (it makes its own FakeTensorMode for real
    # inputs, one that rejects the real tensors a model closes over); ours accepts them.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with (
            capture_patches(target=target),
            mode,
            fx_traceback.preserve_node_meta(),
            modules,
            recorder,
            shadowing(recorder.shadows),
        ):
            prim: list[torch.Tensor] = []
            sources = [p for _, p in named_params] + [b for _, b in named_buffers]
            sources += [flat_args[i] for i in tensor_pos]
            for src in sources:
                prim.append(_to_fake(mode, src))
            for t, (_, p) in zip(prim[:P], named_params, strict=True):
                t.requires_grad_(p.requires_grad)
            versions = [t._version for t in prim]
            compiled = aot_function(
                step, fw_compiler=identity, bw_compiler=identity, partition_fn=partition_fn
            )
            loss = compiled(*prim)
            mutated = [i for i, t in enumerate(prim) if t._version != versions[i]]
            del loss
    except TraceError:
        raise
    except Exception as exc:
        if recorder.failed is not None:
            op, module, inner = recorder.failed
            where = f"module {module!r}" if module else "the top-level forward"
            raise TraceError(
                f"cannot trace op {op} in {where}: {type(inner).__name__}: {inner}",
                op=op,
                module=module,
            ) from exc
        raise TraceError(
            f"cannot trace the model: {type(exc).__name__}: {exc}", module=modules.current()
        ) from exc
    if "joint" not in captured:
        raise TraceError(
            "no backward graph was captured: does the loss depend on any parameter "
            "with requires_grad?"
        )

    bad = [i for i in mutated if not (P <= i < P + B)]
    if bad:
        names = [param_names[i] if i < P else f"input {i - P - B}" for i in bad]
        raise TraceError(f"the step mutates {', '.join(names)} in place; only buffers may be")
    joint: torch.fx.GraphModule = captured["joint"]
    num_fwd = captured["num_fwd_outputs"]
    returned_fx: list[torch.fx.Node] = []
    returned = captured.get("returned")
    if return_outputs and returned is not None and returned.returned:
        returned_fx = strip_returned(joint, len(mutated) + 1, len(returned.returned))
        num_fwd -= len(returned_fx)
    if num_fwd != len(mutated) + 1:
        raise TraceError(
            f"unexpected joint graph: {num_fwd} forward outputs for {len(mutated)} mutated "
            "buffers and one loss (does the loss alias an intermediate tensor?)"
        )
    bernoulli_in_memory_order(joint)
    gradients_in_parameter_layout(joint, param_names)
    signature = JointSignature(
        model_name=type(model).__name__,
        param_names=tuple(param_names),
        buffer_names=tuple(buffer_names),
        num_inputs=len(tensor_pos),
        requires_grad=requires_grad,
        mutated_buffers=tuple(buffer_names[i - P] for i in mutated),
    )
    mapping = joint_to_ir(joint, signature)
    if returned_fx:
        held = [mapping.fx_value[n.name] for n in returned_fx]
        mapping = dataclasses.replace(
            mapping, graph=held_until_backward(mapping.graph, mapping.tangent_value, held)
        )
    if target == "cpu":
        with capture_patches(target=target):
            log = replay_forward(model, args[0], args[1], loss_fn)
        if log is not None:
            frees = eager_forward_frees(
                log, joint, mapping.graph, mapping.node_fx, mapping.fx_value
            )
            in_place = eager_in_place_nodes(log, joint, mapping.node_fx)
            held = eager_block_args(log, joint, mapping.graph, mapping.fx_value)
            graph = fold_eager_frees(mapping.graph, frees, in_place, held)
            mapping = dataclasses.replace(mapping, graph=graph)
    cap = Capture.of(
        joint,
        mapping,
        signature,
        input_spec=input_spec,
        input_constants=input_constants,
        require_real=require_real,
        target=target,
    )
    cap.output = captured.get("output")
    cap.returned = returned
    if returned is not None and not returned_fx:
        cap.returned = dataclasses.replace(returned, returned=())
    cap.returned_fx = returned_fx
    return cap


def _own_loss(out: Any, captured: dict[str, Any]) -> Any:
    """The loss a model returns inside its output, as transformers models do when given
    ``labels`` (a ``ModelOutput`` whose ``"loss"`` entry is a scalar, read by ``Trainer`` as
    ``outputs["loss"]``); else the output itself. Where the output holds its own loss, what
    ``forward`` returns around it is kept in ``captured["returned"]``."""
    if not isinstance(out, Mapping):
        return out
    loss = out.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return out
    leaves, spec = pytree.tree_flatten(out)
    (index,) = [i for i, x in enumerate(leaves) if x is loss]
    # Only plain values survive; the capture's tensors (and objects holding them) are fake.
    kept = [x if isinstance(x, (bool, int, float, str)) else None for x in leaves]
    others = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x is not loss)
    captured["returned"] = ModelOutput(spec=spec, leaves=kept, index=index, returned=others)
    return loss


def _the_output(out: Any) -> tuple[torch.Tensor, ModelOutput]:
    """The one tensor of a model's output (a tensor, or a structure such as a transformers
    ``ModelOutput`` holding one tensor), and where it sits in that structure."""
    leaves, spec = pytree.tree_flatten(out)
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(where) != 1:
        raise TraceError(
            "the model's output must be its scalar loss, a tensor or a structure holding one "
            f"tensor (whose gradient the backward then takes); it holds {len(where)} tensors "
            f"({type(out).__name__}). Pass loss_fn to pick or compute the loss"
        )
    tensor = leaves[where[0]]
    if not tensor.requires_grad or not tensor.dtype.is_floating_point:
        raise TraceError(
            "the model's output does not depend on any parameter with requires_grad (or is "
            "not floating point): there is nothing to differentiate"
        )
    others = [None if i == where[0] else x for i, x in enumerate(leaves)]
    return tensor, ModelOutput(spec=spec, leaves=others, index=where[0])
