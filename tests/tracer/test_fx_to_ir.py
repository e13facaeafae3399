"""The FX -> IR passes as a callable API: a joint graph and its signature -> an IR graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.tracer import capture
from remat.tracer.fx_to_ir import hold_until_group_end, joint_to_ir, mark_side_effects
from remat.tracer.records import JointSignature, OpRecord


def _bn_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)), (
        torch.randn(3, 4)
    )


def test_joint_to_ir_rebuilds_the_captured_graph() -> None:
    model, x = _bn_model()
    cap = capture(model, x, lambda y: y.sum())
    signature = JointSignature(
        model_name=type(model).__name__,
        param_names=tuple(cap.param_names),
        buffer_names=tuple(cap.buffer_names),
        num_inputs=cap.num_inputs,
        requires_grad=cap.requires_grad,
        mutated_buffers=tuple(n for role, n in cap.output_roles if role == "buffer"),
    )
    mapping = joint_to_ir(cap.joint, signature)
    # The capture adds what only the eager replay sees: which blocks each storage is given to
    # (Value.held_by). Without that, the graphs are the same.
    assert any(v.held_by for v in cap.graph.values)
    unheld = cap.graph.model_copy(
        update={"values": tuple(v.model_copy(update={"held_by": ()}) for v in cap.graph.values)}
    )
    assert mapping.graph.content_hash() == unheld.content_hash()
    assert mapping.buffer_updates == cap.buffer_updates
    # The batch-norm statistics update is a side effect: its node may not be recomputed.
    producers = [mapping.graph.producer_of(v) for v in mapping.buffer_updates.values()]
    updaters = {p.id for p in producers if p is not None}
    assert updaters and all(not mapping.graph.node(n).recomputable for n in updaters)


def test_a_wrong_signature_is_a_trace_error() -> None:
    model, x = _bn_model()
    cap = capture(model, x, lambda y: y.sum())
    signature = JointSignature(
        model_name="m",
        param_names=tuple(cap.param_names),
        buffer_names=tuple(cap.buffer_names),
        num_inputs=cap.num_inputs + 1,  # one placeholder too many for the primals
    )
    with pytest.raises(ValueError, match="expected one tangent"):
        joint_to_ir(cap.joint, signature)


def _op(i: str, inputs: tuple[str, ...], outputs: tuple[str, ...], seq: int | None) -> OpRecord:
    return OpRecord(
        id=i,
        op="aten.mul.Tensor",
        phase="backward",
        inputs=inputs,
        outputs=outputs,
        flops=0,
        module="",
        rng=False,
        recomputable=True,
        seq_nr=seq,
    )


def test_hold_until_group_end_returns_new_records() -> None:
    # One autograd node spelled as two ops (seq 7): the last holds what the first read and made.
    ops = (_op("a", ("g", "w", "s"), ("t",), 7), _op("b", ("t",), ("dx",), 7))
    kinds = {"g": "gradient", "w": "param", "s": "activation", "t": "gradient", "dx": "gradient"}
    held = hold_until_group_end(ops, kinds)  # type: ignore[arg-type]
    assert held[1].inputs == ("t", "g", "s")  # the parameter is static: not held
    assert ops[1].inputs == ("t",)  # the input records are unchanged
    assert held[0] is ops[0]
    assert mark_side_effects(held, {"buf": "dx"})[1].recomputable is False
