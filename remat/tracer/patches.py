"""Process-wide torch state that a capture changes for its duration, and restores.

Each patch makes the traced graph mirror the eager step it replaces, or lets a model trace at
all; :func:`capture_patches` applies them together under one lock, because they change state
that every thread of the process sees (dispatcher kernels, global flags, module attributes).

* :func:`eager_composites`: ``aten.dropout`` (and upsampling and a few losses) traced through
  their C++ composites, as eager CPU runs them, instead of torch's Python decompositions
  (``native_dropout``, index arithmetic), so that the saved tensors and the random numbers
  drawn are those of the eager step.
* :func:`no_fused_cpu_rnn`: RNNs decomposed into cells (torch's decomposition, with mkldnn off
  while tracing): the fused CPU kernel (``mkldnn_rnn_layer``) has no usable fake implementation
  of its saved workspace, and its joint graph cannot run.
* :func:`allow_fake_constants`: fake tensors a model closes over may become graph constants.
* :func:`transformers_sees_tracing`: transformers' ``is_tracing`` guard recognises the
  capture's functional tensors, so its masking code does not read their (absent) data.
* :func:`grouped_mm_any_dtype`: ``torch._grouped_mm`` traces in float32, as the CPU runs it.
* :func:`answering_as_eager`: the patches a step run on fake tensors outside a capture needs,
  with the data-independent tensors' real values (:mod:`remat.tracer.shadow`) answering its
  data questions.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from remat.tracer.shadow import (
    BATCH_QUESTIONS,
    ShadowMode,
    Shadows,
    batch_questions,
    known,
    seed_batch,
    shadowing,
)

# Ops for which torch registers Python decompositions (at CompositeImplicitAutograd or
# Autograd) that tracing uses but eager CPU does not (eager runs the C++ composite or
# derivative). Tracing through the C++ ones keeps the graph equal to the eager step: same ops,
# same saved tensors, same random numbers (dropout's bernoulli noise, not native_dropout's mask).
EAGER_COMPOSITES = (
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
def eager_composites(*, keep_fused_dropout: bool = False) -> Iterator[None]:
    """Trace the ops in :data:`EAGER_COMPOSITES` as eager runs them (dropout as on the CPU unless
    ``keep_fused_dropout``: CUDA runs ``native_dropout``, as torch's decomposition does)."""
    keys = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)
    saved: list[tuple[Any, Any, Any]] = []
    for name in EAGER_COMPOSITES:
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
def no_fused_cpu_rnn() -> Iterator[None]:
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
def allow_fake_constants() -> Iterator[None]:
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


@contextlib.contextmanager
def transformers_sees_tracing() -> Iterator[None]:
    """transformers' ``is_tracing(tensor)`` recognises the capture's tensors, and its masking
    questions get eager's answers where the capture knows them.

    Its masking code reads tensor data in Python (``find_packed_sequence_indices``,
    ``_ignore_causal_mask_sdpa``) unless ``is_tracing`` says the tensor has none; that checks
    for ``FakeTensor``, but inside ``aot_function`` the model sees ``FunctionalTensor``s wrapping
    fakes, and ``.item()`` raises ``DataDependentOutputException``. Nothing is imported: a
    process that has not imported transformers has nothing to patch.

    A tensor whose real value the capture knows (:mod:`remat.tracer.shadow`: ``position_ids``
    made by ``arange`` inside ``forward``; inside the functions of
    :data:`~remat.tracer.shadow.BATCH_QUESTIONS`, also the caller's ``attention_mask`` and
    ``position_ids`` and what is computed from them) is not reported as traced, so transformers
    reads it as eager does and the traced step skips the causal mask where eager skips it
    (attention's ``is_causal``, grouped query attention without repeated keys and values).
    """
    import sys

    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None)
    if utils is None or original is None:
        yield
        return
    from torch._subclasses.functional_tensor import FunctionalTensor

    def is_fake_tensor(x: Any) -> bool:
        if known(x):  # eager's answer is known (remat.tracer.shadow)
            return False
        return isinstance(x, FunctionalTensor) or bool(original(x))

    def reading_the_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with batch_questions():
                return fn(*args, **kwargs)

        return run

    masking = sys.modules.get("transformers.masking_utils")
    saved = {
        name: fn for name in BATCH_QUESTIONS if (fn := getattr(masking, name, None)) is not None
    }
    utils.is_fake_tensor = is_fake_tensor
    for name, fn in saved.items():
        setattr(masking, name, reading_the_batch(fn))
    try:
        yield
    finally:
        utils.is_fake_tensor = original
        for name, fn in saved.items():
            setattr(masking, name, fn)


def _grouped_mm_shape(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Any) -> list[int]:
    """The output shape of ``torch._grouped_mm``: a 2-D operand is split into groups along its
    rows (A) or columns (B) by ``offs``; two 3-D operands are a batched matmul."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:  # groups along K: one (M, N) result per group
        return [int(offs.shape[0]), int(mat_a.shape[0]), int(mat_b.shape[1])]
    if a2:  # rows of A in groups, one (K, N) matrix of B per group
        return [int(mat_a.shape[0]), int(mat_b.shape[-1])]
    if b2:  # columns of B in groups, one (M, K) matrix of A per group
        return [int(mat_a.shape[1]), int(mat_b.shape[1])]
    return [int(mat_a.shape[0]), int(mat_a.shape[1]), int(mat_b.shape[-1])]


@contextlib.contextmanager
def grouped_mm_any_dtype() -> Iterator[None]:
    """A fake implementation of ``torch._grouped_mm`` for dtypes other than bfloat16.

    torch's meta kernel checks the CUDA kernel's constraints (bfloat16 only, 16-byte aligned
    strides), but the CPU kernel runs float32 (Mixtral's default experts implementation in
    transformers calls it). Outside those dtypes nothing changes: bfloat16 calls still go
    through torch's meta kernel.
    """
    from torch._subclasses import fake_impls

    op = torch.ops.aten._grouped_mm.default

    def applies(func: Any) -> bool:
        return func is op

    def fake_grouped_mm(
        mode: Any,
        func: Any,
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        offs: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> Any:
        if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
            return NotImplemented
        torch._check(
            mat_a.dtype == mat_b.dtype,
            lambda: f"_grouped_mm needs one dtype, got {mat_a.dtype} and {mat_b.dtype}",
        )
        torch._check(
            mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
            lambda: "_grouped_mm multiplicands must be 2-D or 3-D",
        )
        torch._check(
            (mat_a.dim() == 3 and mat_b.dim() == 3) or offs is not None,
            lambda: "_grouped_mm with a 2-D operand needs offs",
        )
        shape = _grouped_mm_shape(mat_a, mat_b, offs)
        with mode:
            return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)

    entry = (applies, fake_grouped_mm)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)


# The patches change process-wide torch state: one capture at a time (re-entrant, so a capture
# made while tracing, by a model's own code, does not deadlock).
CAPTURE_LOCK = threading.RLock()


@contextlib.contextmanager
def capture_patches(*, target: str = "cpu") -> Iterator[None]:
    """Every patch above, under :data:`CAPTURE_LOCK`, for one capture for ``target``."""
    with (
        CAPTURE_LOCK,
        eager_composites(keep_fused_dropout=target == "cuda"),
        no_fused_cpu_rnn(),
        allow_fake_constants(),
        transformers_sees_tracing(),
        grouped_mm_any_dtype(),
    ):
        yield


@contextlib.contextmanager
def answering_as_eager(inputs: Any = None, real_inputs: Any = None) -> Iterator[Shadows]:
    """Data questions on data-independent fake tensors answered as eager answers them, and
    transformers told so (its ``is_tracing`` guard), for a step run on fake tensors; and
    ``torch._grouped_mm``'s fake kernel in float32, as the CPU kernel runs it. ``inputs`` (the
    step's fake keyword arguments) and ``real_inputs`` (the caller's) seed the batch's masking
    data as the capture does (:func:`remat.tracer.shadow.seed_batch`)."""
    shadows = Shadows()
    seed_batch(shadows, inputs, real_inputs)
    with (
        CAPTURE_LOCK,
        transformers_sees_tracing(),
        grouped_mm_any_dtype(),
        ShadowMode(shadows),
        shadowing(shadows),
    ):
        yield shadows
