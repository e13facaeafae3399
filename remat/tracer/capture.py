"""Capture one training step as a functional joint FX graph, and map it to the IR by storage.

How the step is captured
------------------------
``aot_function`` over ``torch.func.functional_call(model, (params, buffers), inputs)`` with a
partition function that keeps the joint forward+backward graph. Parameters, buffers and inputs
are fake tensors (``FakeTensorMode``) unless ``fake=False``, so nothing the size of the model is
allocated. The joint graph is functional: views stay views, in-place updates of buffers (batch
norm running statistics) become out-of-place ops whose results are returned as extra outputs.
Tensors a model builds inside ``forward`` (``torch.tensor(...)``, masks, plain tensor attributes)
become ``get_attr`` constants holding real tensors.

Two things are done to make the graph mirror the eager step that it replaces:

* ``aten.dropout`` (and upsampling) are traced through their C++ composites, as eager CPU
  runs them, instead of torch's Python decompositions (``native_dropout``, index arithmetic),
  so that the saved tensors and the random numbers drawn are those of the eager step. RNNs
  are decomposed into cells (torch's decomposition, with mkldnn off while tracing): the fused
  CPU kernel (``mkldnn_rnn_layer``) has no usable fake implementation of its saved workspace,
  and its joint graph cannot run.
* each module's path is recorded on the forward nodes (``meta["nn_module_stack"]``) by global
  module hooks; backward nodes take the module of the forward op with the same ``seq_nr``.

Fidelity to the eager step
--------------------------
The IR's ``none`` plan reproduces the eager CPU step's memory (``remat.executor.measure``)
exactly on the example models and on library-style models (manual attention with in-place
residuals, ``nn.MultiheadAttention``, RMSNorm, upsampling, user checkpointing). What it takes:
the C++ composites above; each backward autograd node (ops sharing a ``seq_nr``) holds its
inputs and its formula's intermediates until its last op, as eager releases them when the node
returns (functionalized ``copy_`` excepted); CPU loss kernels that keep an input-sized storage
for their scalar (``mse_loss`` & co). Known differences: an in-place op on an activation is
functionalized into a new storage, so the IR counts one extra tensor while that op runs; a
Python local still bound after its last use keeps its tensor alive in eager until ``forward``
returns, while the IR frees it at its last use; RNNs are traced as unrolled cells, where eager
CPU runs a fused kernel with its own saved workspace.

Storage mapping
---------------
Every tensor in the joint graph lives in a storage; each storage is one IR :class:`Value`
(``size_bytes`` is the storage's size). The op that creates a storage is an IR :class:`Node`
with the FX node's name as id and name; ops whose outputs only alias existing storages (views,
``detach``, tuple ``getitem``) are not nodes: a node that reads a view lists the base value.
Kinds: ``param`` and ``buffer`` placeholders, ``input`` for the example inputs and the loss's
incoming gradient (``tangents_1``, the ``ones`` that ``loss.backward()`` creates), ``buffer`` for
updated buffers and graph constants, ``loss``, ``gradient`` for values made in the backward phase
(required for parameter gradients), ``activation`` otherwise. Value ids are FX node names too.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from remat.ir import Graph, Node, Value
from remat.ir.errors import RematError
from remat.tracer.flops import node_flops

_getitem = operator.getitem


class TraceError(RematError, ValueError):
    """The model could not be traced. ``op`` and ``module`` name where, when known."""

    def __init__(self, message: str, *, op: str | None = None, module: str | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.module = module


LossFn = Callable[[Any], torch.Tensor]


@dataclass
class Capture:
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
    fake
        Whether the capture ran on fake tensors.
    target
        ``"cpu"`` or ``"cuda"``: whose eager step the graph mirrors (see :func:`capture`).
    """

    joint: torch.fx.GraphModule
    graph: Graph
    param_names: list[str]
    buffer_names: list[str]
    num_inputs: int
    input_spec: pytree.TreeSpec
    input_constants: dict[int, Any]
    node_fx: dict[str, torch.fx.Node]
    value_fx: dict[str, torch.fx.Node]
    value_aliases: dict[str, list[torch.fx.Node]]
    fx_value: dict[str, str]
    param_values: dict[str, str]
    buffer_values: dict[str, str]
    input_values: list[str]
    tangent_value: str
    loss_value: str
    grad_values: dict[str, str]
    buffer_updates: dict[str, str]
    output_roles: list[tuple[str, str]]
    fake: bool
    requires_grad: dict[str, bool] = field(default_factory=dict)
    target: str = "cpu"

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


# Ops for which torch registers Python decompositions (at CompositeImplicitAutograd or
# Autograd) that tracing uses but eager CPU does not (eager runs the C++ composite or
# derivative). Tracing through the C++ ones keeps the graph equal to the eager step: same ops,
# same saved tensors, same random numbers (dropout's bernoulli noise, not native_dropout's mask).
_EAGER_COMPOSITES = (
    "dropout.default",
    *(
        f"{kind}.{overload}"
        for kind in (
            "upsample_nearest1d",
            "upsample_nearest2d",
            "upsample_nearest3d",
            "_upsample_nearest_exact1d",
            "_upsample_nearest_exact2d",
            "_upsample_nearest_exact3d",
            "upsample_linear1d",
            "upsample_bilinear2d",
            "upsample_trilinear3d",
            "upsample_bicubic2d",
            "_upsample_bilinear2d_aa",
            "_upsample_bicubic2d_aa",
        )
        for overload in ("default", "vec")
    ),
    "hardshrink.default",
    "softshrink.default",
    "multi_margin_loss.default",
    "multilabel_margin_loss_forward.default",
)


@contextlib.contextmanager
def _eager_composites(*, keep_fused_dropout: bool = False) -> Iterator[None]:
    """Trace the ops in ``_EAGER_COMPOSITES`` as eager runs them (dropout as on the CPU unless
    ``keep_fused_dropout``: CUDA runs ``native_dropout``, as torch's decomposition does)."""
    keys = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)
    saved: list[tuple[Any, Any, Any]] = []
    for name in _EAGER_COMPOSITES:
        if keep_fused_dropout and name == "dropout.default":
            continue
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is None:
            continue
        for key in keys:
            if key in op.py_kernels:
                saved.append((op, key, op.py_kernels.pop(key)))
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, key, kernel in saved:
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()


@contextlib.contextmanager
def _no_fused_cpu_rnn() -> Iterator[None]:
    """RNNs decompose into cells instead of ``mkldnn_rnn_layer``, whose saved workspace its fake
    implementation leaves undefined (the joint graph then cannot run). Only torch's RNN
    decomposition reads this flag while tracing; convolutions stay ``aten.convolution``."""
    # (torch.backends.mkldnn.flags() would also touch TF32 settings, with a warning each time.)
    saved = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(saved)


@contextlib.contextmanager
def _allow_fake_constants() -> Iterator[None]:
    """Let fake tensors a model closes over (a model built under FakeTensorMode, targets made
    there) become graph constants: ``aot_function`` rejects them with "Unexpected fake buffer
    _tensor_constant0", a check meant for compiled graphs that will run; ours is only read."""
    import torch._dynamo.utils as dynamo_utils

    saved = dynamo_utils.assert_no_fake_params_or_buffers
    dynamo_utils.assert_no_fake_params_or_buffers = lambda gm: None  # type: ignore[assignment]
    try:
        yield
    finally:
        dynamo_utils.assert_no_fake_params_or_buffers = saved


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
    """Remembers the torch function that raised last, and in which module, for error messages."""

    def __init__(self, modules: _ModuleTracker, *, fused_attention: bool = False) -> None:
        super().__init__()
        self.modules = modules
        self.fused_attention = fused_attention
        self.failed: tuple[str, str, BaseException] | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        try:
            if self.fused_attention and func is torch.nn.functional.scaled_dot_product_attention:
                return _fused_attention(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
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


# Capture patches process-wide torch state for its duration (see _eager_composites and
# _allow_fake_constants): one capture at a time.
_CAPTURE_LOCK = threading.Lock()


def capture(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    fake: bool = True,
    target: str = "cpu",
) -> Capture:
    """Capture one training step of ``model`` as a joint FX graph and its IR graph.

    Parameters
    ----------
    model
        Any ``nn.Module``. It is not modified (its parameters are swapped in functionally).
    example_inputs
        A tensor or a tuple of the model's positional arguments.
    loss_fn
        ``loss_fn(output) -> scalar``; when None the model's output must be the scalar loss.
    fake
        The capture always runs on fake tensors (as ``aot_function`` does), so no memory the
        size of the model is allocated; ``fake=False`` only asserts that the model is real
        (not on the meta device), as ``cost="measure"`` needs, and is recorded.
    target
        ``"cpu"`` (default): the graph is the eager CPU step (its memory matches
        :func:`remat.executor.measure` on the CPU; it runs on the CPU with the eager gradients).
        ``"cuda"``: ops are chosen as CUDA eager runs them, for planning a GPU from a CPU:
        dropout saves a 1-byte mask (``native_dropout``) instead of CPU's float noise, and
        attention is a fused kernel that saves its output and logsumexp, never the attention
        matrix (the CPU runs the unfused math path when attention has dropout). Such a graph is
        for planning; it need not run on the CPU.

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
    if not fake:
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.device.type == "meta":
                raise TraceError(
                    f"fake=False needs real tensors, but {name!r} is on the meta device"
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
        out = torch.func.functional_call(
            model, (params, buffers), tuple(call_args), dict(call_kwargs)
        )
        loss = loss_fn(out) if loss_fn is not None else out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = "loss_fn" if loss_fn is not None else "the model (no loss_fn given)"
            raise TraceError(
                f"{what} must return a scalar tensor, got "
                + (
                    f"shape {tuple(loss.shape)}"
                    if isinstance(loss, torch.Tensor)
                    else type(loss).__name__
                )
            )
        return loss

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
            mode,
            _eager_composites(keep_fused_dropout=target == "cuda"),
            _no_fused_cpu_rnn(),
            _allow_fake_constants(),
            fx_traceback.preserve_node_meta(),
            modules,
            recorder,
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
    if num_fwd != len(mutated) + 1:
        raise TraceError(
            f"unexpected joint graph: {num_fwd} forward outputs for {len(mutated)} mutated "
            "buffers and one loss (does the loss alias an intermediate tensor?)"
        )
    cap = _to_ir(
        joint,
        model_name=type(model).__name__,
        param_names=param_names,
        buffer_names=buffer_names,
        requires_grad=requires_grad,
        mutated_buffers=[buffer_names[i - P] for i in mutated],
        num_inputs=len(tensor_pos),
        input_spec=input_spec,
        input_constants=input_constants,
        fake=fake,
    )
    cap.target = target
    return cap


# -- FX -> IR ---------------------------------------------------------------------------------


def _is_rng(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(val: Any) -> list[torch.Tensor | None]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _to_ir(
    joint: torch.fx.GraphModule,
    *,
    model_name: str,
    param_names: list[str],
    buffer_names: list[str],
    requires_grad: dict[str, bool],
    mutated_buffers: list[str],
    num_inputs: int,
    input_spec: pytree.TreeSpec,
    input_constants: dict[int, Any],
    fake: bool,
) -> Capture:
    P, B = len(param_names), len(buffer_names)
    fx_nodes = list(joint.graph.nodes)

    storage_value: dict[StorageWeakRef, str] = {}
    value_base: dict[str, torch.Tensor] = {}
    value_fx: dict[str, torch.fx.Node] = {}
    value_aliases: dict[str, list[torch.fx.Node]] = {}
    fx_value: dict[str, str] = {}
    kinds: dict[str, str] = {}

    def new_value(vid: str, t: torch.Tensor, fx: torch.fx.Node, kind: str) -> None:
        storage_value[StorageWeakRef(t.untyped_storage())] = vid
        value_base[vid] = t
        value_fx[vid] = fx
        value_aliases[vid] = [fx]
        kinds[vid] = kind
        fx_value[fx.name] = vid

    def alias(fx: torch.fx.Node, vid: str) -> None:
        fx_value[fx.name] = vid
        value_aliases[vid].append(fx)

    def storage_of(t: torch.Tensor) -> str | None:
        return storage_value.get(StorageWeakRef(t.untyped_storage()))

    # Module of each forward seq_nr, for backward nodes.
    seq_module: dict[int, str] = {}

    def module_of(n: torch.fx.Node) -> str:
        stack = n.meta.get("nn_module_stack")
        if stack:
            return str(list(stack.values())[-1][0])
        return ""

    for n in fx_nodes:
        if n.op == "call_function" and n.meta.get("partitioner_tag") != "is_backward":
            seq = n.meta.get("seq_nr")
            if seq is not None and seq not in seq_module:
                seq_module[seq] = module_of(n)

    placeholders = [n for n in fx_nodes if n.op == "placeholder"]
    num_primals = P + B + num_inputs
    primals, tangents = placeholders[:num_primals], placeholders[num_primals:]
    if len(tangents) != 1:
        raise TraceError(f"expected one tangent (the loss's gradient), found {len(tangents)}")
    param_values: dict[str, str] = {}
    buffer_values: dict[str, str] = {}
    input_values: list[str] = []
    for i, ph in enumerate(primals):
        t = ph.meta["val"]
        known = storage_of(t)
        if known is not None:  # two primals on one storage (should not happen: tied are deduped)
            alias(ph, known)
            vid = known
        else:
            kind = "param" if i < P else ("buffer" if i < P + B else "input")
            new_value(ph.name, t, ph, kind)
            vid = ph.name
        if i < P:
            param_values[param_names[i]] = vid
        elif i < P + B:
            buffer_values[buffer_names[i - P]] = vid
        else:
            input_values.append(vid)
    tangent = tangents[0]
    new_value(tangent.name, tangent.meta["val"], tangent, "input")

    # Outputs and their roles.
    out_node = next(n for n in reversed(fx_nodes) if n.op == "output")
    out_args = pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: x is None)
    # is_leaf keeps Nones; tree_leaves over fx Nodes yields nodes.
    n_mut = len(mutated_buffers)
    roles: list[tuple[str, str]] = []
    for j in range(len(out_args)):
        if j < n_mut:
            roles.append(("buffer", mutated_buffers[j]))
        elif j == n_mut:
            roles.append(("loss", ""))
        else:
            k = j - n_mut - 1
            if k < P and out_args[j] is not None:
                roles.append(("grad", param_names[k]))
            else:
                roles.append(("none", ""))
    buffer_out: dict[str, torch.fx.Node] = {}
    grad_out: dict[str, torch.fx.Node] = {}
    loss_out: torch.fx.Node | None = None
    for (role, name), a in zip(roles, out_args, strict=True):
        if role == "buffer":
            buffer_out[name] = a
        elif role == "grad":
            grad_out[name] = a
        elif role == "loss":
            loss_out = a
    if loss_out is None:
        raise TraceError("the joint graph has no loss output")

    attr_value: dict[str, str] = {}
    ir_nodes: list[dict[str, Any]] = []
    node_fx: dict[str, torch.fx.Node] = {}
    for n in fx_nodes:
        if n.op == "get_attr":
            t = n.meta.get("val")
            if t is None:
                t = getattr(joint, str(n.target), None)
            if isinstance(t, torch.Tensor):
                known = attr_value.get(str(n.target)) or storage_of(t)
                attr_value.setdefault(str(n.target), known or n.name)
                if known is None:
                    new_value(n.name, t, n, "buffer")
                else:
                    alias(n, known)
            continue
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        if n.target is _getitem:
            # A tuple element: its value was made with the multi-output op (or it aliases one).
            if n.name not in fx_value and isinstance(val, torch.Tensor):
                known = storage_of(val)
                if known is not None:
                    alias(n, known)
            continue
        outs = _tensors(val)
        created: list[str] = []
        multi = not isinstance(val, torch.Tensor)
        for i, t in enumerate(outs):
            if t is None:
                continue
            known = storage_of(t)
            if known is None:
                src = _aliased_input(n, i)
                if src is not None:
                    known = fx_value.get(src.name)
            if known is not None:
                if not multi:
                    alias(n, known)
                else:
                    elem = _elem_node(n, i)
                    if elem is not None:
                        alias(elem, known)
                continue
            base = _elem_node(n, i) if multi else n
            vid = base.name if base is not None else f"{n.name}#{i}"
            phase = "backward" if n.meta.get("partitioner_tag") == "is_backward" else "forward"
            new_value(vid, t, base or n, "gradient" if phase == "backward" else "activation")
            if base is None:
                del fx_value[n.name]
            created.append(vid)
        if not created and outs:
            continue  # a view or alias: folded into the nodes that read it
        inputs: list[str] = []
        for a in n.all_input_nodes:
            vid = fx_value.get(a.name)
            if vid is not None and vid not in inputs:
                inputs.append(vid)
        phase = "backward" if n.meta.get("partitioner_tag") == "is_backward" else "forward"
        module = (
            module_of(n) if phase == "forward" else seq_module.get(n.meta.get("seq_nr", -1), "")
        )
        flat_args = pytree.tree_map(_meta_val, list(n.args))
        flat_kwargs = pytree.tree_map(_meta_val, dict(n.kwargs))
        try:
            flops = node_flops(n.target, flat_args, flat_kwargs, val)
        except Exception:  # a formula that does not fit this call: count nothing
            flops = 0
        ir_nodes.append(
            {
                "id": n.name,
                "name": n.name,
                "op": _op_name(n.target),
                "phase": phase,
                "inputs": tuple(inputs),
                "outputs": tuple(created),
                "flops": flops,
                "module": module,
                "rng": _is_rng(n.target),
                "recomputable": True,
            }
        )
        node_fx[n.name] = n

    # Roles of outputs.
    def out_value(a: torch.fx.Node) -> str:
        return fx_value[a.name]

    loss_value = out_value(loss_out)
    kinds[loss_value] = "loss"
    grad_values: dict[str, str] = {}
    owner: dict[str, str] = {}
    producer_phase = {o: nd["phase"] for nd in ir_nodes for o in nd["outputs"]}
    for pname, a in grad_out.items():
        vid = out_value(a)
        if producer_phase.get(vid) != "backward":
            raise TraceError(
                f"the gradient of parameter {pname!r} is not a fresh tensor made by the backward "
                f"pass (it aliases value {vid!r}); such models are not supported"
            )
        # Two parameters may get one storage as gradient (the CPU LSTM kernel returns the same
        # tensor for both biases): one value, required once; eager copies it into the second
        # ``.grad``, and static_bytes counts a gradient per parameter either way.
        owner[vid] = pname
        kinds[vid] = "gradient"
        if requires_grad.get(pname, True):
            grad_values[pname] = vid
    buffer_updates: dict[str, str] = {}
    side_effect_nodes: set[str] = set()
    producer_of = {o: nd["id"] for nd in ir_nodes for o in nd["outputs"]}
    for bname, a in buffer_out.items():
        vid = out_value(a)
        if vid not in producer_of:
            raise TraceError(f"buffer {bname!r} is updated to an existing tensor {vid!r}")
        kinds[vid] = "buffer"
        buffer_updates[bname] = vid
        side_effect_nodes.add(producer_of[vid])
    for nd in ir_nodes:
        if nd["id"] in side_effect_nodes:
            nd["recomputable"] = False

    _hold_until_group_end(ir_nodes, node_fx, kinds)
    values = [
        Value(
            id=vid,
            size_bytes=_storage_bytes(t, value_fx[vid]),
            kind=kinds[vid],  # type: ignore[arg-type]
            shape=tuple(int(s) for s in t.shape),
            dtype=_dtype_name(t.dtype),
        )
        for vid, t in value_base.items()
    ]
    required = [*dict.fromkeys(grad_values.values()), loss_value]
    static = _static_bytes(value_base, param_values, buffer_values, grad_values)
    graph = Graph(
        name=model_name,
        nodes=[Node(**nd) for nd in ir_nodes],
        values=values,
        required=required,
        static_bytes=static,
    )
    return Capture(
        joint=joint,
        graph=graph,
        param_names=param_names,
        buffer_names=buffer_names,
        num_inputs=num_inputs,
        input_spec=input_spec,
        input_constants=input_constants,
        node_fx=node_fx,
        value_fx=value_fx,
        value_aliases=value_aliases,
        fx_value=fx_value,
        param_values=param_values,
        buffer_values=buffer_values,
        input_values=input_values,
        tangent_value=tangent.name,
        loss_value=loss_value,
        grad_values=grad_values,
        buffer_updates=buffer_updates,
        output_roles=roles,
        fake=fake,
        requires_grad=requires_grad,
    )


def _meta_val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _hold_until_group_end(
    ir_nodes: list[dict[str, Any]], node_fx: dict[str, torch.fx.Node], kinds: dict[str, str]
) -> None:
    """Make each backward autograd node's inputs live until its last op, as in eager.

    Eager autograd runs one backward node (e.g. ``BmmBackward``) as a unit: its saved tensors
    and incoming gradients are released when the whole node has run. The joint graph spells the
    node as several ops with the same ``seq_nr``; without this, a value read only by the first
    of them would be freed between them, earlier than eager frees it. Likewise the intermediate
    results of the node's formula (C++ locals and temporaries) live until the formula returns.
    The last op of each such run lists every dynamic value the earlier ops of the run read or
    make.
    """
    i = 0
    while i < len(ir_nodes):
        nd = ir_nodes[i]
        seq = node_fx[nd["id"]].meta.get("seq_nr")
        j = i + 1
        if nd["phase"] == "backward" and seq is not None:
            while (
                j < len(ir_nodes)
                and ir_nodes[j]["phase"] == "backward"
                and node_fx[ir_nodes[j]["id"]].meta.get("seq_nr") == seq
            ):
                j += 1
        if j - i > 1:
            last = ir_nodes[j - 1]
            # Reads from outside the run, and what earlier ops of the run made (C++ locals and
            # temporaries of the backward formula live until it returns).
            # ``copy_`` in a formula (CopySlices) is functionalized into ``copy``, a new
            # storage where eager writes in place: its destination and result are not held.
            made = {o for k in range(i, j) for o in ir_nodes[k]["outputs"]}
            copies = {
                v
                for k in range(i, j)
                if ir_nodes[k]["op"] == "aten.copy.default"
                for v in (*ir_nodes[k]["outputs"], *ir_nodes[k]["inputs"][:1])
            }
            extra = [
                x
                for k in range(i, j - 1)
                for x in (*ir_nodes[k]["inputs"], *ir_nodes[k]["outputs"])
                if x not in last["outputs"]
                and kinds.get(x) not in ("param", "buffer")
                and (x not in copies or x not in made)
            ]
            merged = list(last["inputs"])
            for x in extra:
                if x not in merged:
                    merged.append(x)
            last["inputs"] = tuple(merged)
        i = j


# CPU loss kernels that compute the unreduced loss into their result tensor and then reduce it
# in place: the scalar they return keeps a storage as large as the input. Fake tensors report 4
# bytes; the eager step holds the full size until the loss is freed.
_FULL_STORAGE_REDUCTIONS = frozenset(
    {
        "aten.mse_loss.default",
        "aten.smooth_l1_loss.default",
        "aten.soft_margin_loss.default",
        "aten.binary_cross_entropy.default",
    }
)


def _storage_bytes(t: torch.Tensor, fx: torch.fx.Node) -> int:
    """Bytes of the storage of ``t`` (made by ``fx``) as the eager CPU kernel allocates it."""
    nbytes = int(t.untyped_storage().nbytes())
    if fx.op == "call_function" and _op_name(fx.target) in _FULL_STORAGE_REDUCTIONS:
        src = fx.args[0].meta.get("val") if isinstance(fx.args[0], torch.fx.Node) else None
        reduction = fx.args[2] if len(fx.args) > 2 else fx.kwargs.get("reduction", 1)
        if isinstance(src, torch.Tensor) and reduction != 0:
            nbytes = max(nbytes, int(src.numel() * t.element_size()))
    return nbytes


def _aliased_input(n: torch.fx.Node, i: int) -> torch.fx.Node | None:
    """The FX input that output ``i`` of ``n`` aliases according to the op's schema, if any."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return None
    returns = schema.returns
    ret = returns[min(i, len(returns) - 1)]
    if ret.alias_info is None or ret.alias_info.is_write:
        return None
    sets = set(ret.alias_info.before_set)
    for k, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not sets & set(info.before_set):
            continue
        value = n.args[k] if k < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            return value
    return None


def _elem_node(n: torch.fx.Node, i: int) -> torch.fx.Node | None:
    """The ``getitem`` node that extracts element ``i`` of a multi-output node, if any."""
    for u in n.users:
        if u.target is _getitem and u.args[1] == i:
            return u
    return None


def _static_bytes(
    value_base: dict[str, torch.Tensor],
    param_values: dict[str, str],
    buffer_values: dict[str, str],
    grad_values: dict[str, str],
) -> int:
    """Parameters, their gradients (one per parameter with requires_grad) and buffers."""
    size = {vid: int(t.untyped_storage().nbytes()) for vid, t in value_base.items()}
    params = set(param_values.values())
    buffers = set(buffer_values.values())
    grads = sum(size[param_values[p]] for p in grad_values)
    return sum(size[v] for v in params) + sum(size[v] for v in buffers) + grads
