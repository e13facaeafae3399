"""Typed records that the FX -> IR passes (:mod:`remat.tracer.fx_to_ir`) read and return.

All are frozen: a pass returns new records instead of changing the ones it was given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx

from remat.ir import Graph, Node
from remat.ir.graph import ValueKind

Phase = Literal["forward", "backward"]
OutputRole = tuple[str, str]


@dataclass(frozen=True)
class JointSignature:
    """What a joint graph's placeholders and outputs are.

    Placeholders: ``param_names`` parameters, ``buffer_names`` buffers, ``num_inputs`` flat
    inputs, then one tangent (the loss's gradient). Outputs: the updated ``mutated_buffers`` (in
    that order), the loss, then one gradient (or None) per primal.
    """

    model_name: str
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    num_inputs: int
    requires_grad: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    mutated_buffers: tuple[str, ...] = ()

    @property
    def num_primals(self) -> int:
        return len(self.param_names) + len(self.buffer_names) + self.num_inputs


@dataclass(frozen=True)
class StorageRecord:
    """One storage: its base tensor (fake), the FX node that names it, and its kind."""

    id: str
    tensor: torch.Tensor
    fx: torch.fx.Node
    kind: ValueKind


@dataclass(frozen=True)
class OpRecord:
    """One op that creates storages: the fields of its IR :class:`~remat.ir.Node`."""

    id: str
    op: str
    phase: Phase
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: int
    module: str
    rng: bool
    recomputable: bool
    seq_nr: int | None

    def to_node(self, autograd_node: int | None = None) -> Node:
        """The IR node; ``autograd_node`` numbers its backward autograd node (see
        :func:`remat.tracer.fx_to_ir.build_graph`)."""
        return Node(
            id=self.id,
            name=self.id,
            op=self.op,
            phase=self.phase,
            inputs=self.inputs,
            outputs=self.outputs,
            flops=self.flops,
            module=self.module,
            rng=self.rng,
            recomputable=self.recomputable,
            autograd_node=autograd_node,
        )


@dataclass(frozen=True)
class StorageMap:
    """What :func:`map_storages` found: storages, the ops that make them, and the FX maps."""

    storages: dict[str, StorageRecord]
    ops: tuple[OpRecord, ...]
    node_fx: dict[str, torch.fx.Node]
    value_aliases: dict[str, list[torch.fx.Node]]
    fx_value: dict[str, str]
    param_values: dict[str, str]
    buffer_values: dict[str, str]
    input_values: list[str]
    tangent_value: str


@dataclass(frozen=True)
class JointOutputs:
    """The role of each joint output (:func:`read_outputs`) and the FX nodes behind them."""

    roles: list[OutputRole]
    loss: torch.fx.Node
    grads: dict[str, torch.fx.Node]
    buffers: dict[str, torch.fx.Node]


@dataclass(frozen=True)
class OutputValues:
    """The IR values of the loss, the parameter gradients and the updated buffers."""

    loss_value: str
    grad_values: dict[str, str]
    buffer_updates: dict[str, str]
    kinds: dict[str, ValueKind]


@dataclass  # not frozen: Capture extends it, and trace() sets its costed graph
class IrMapping:
    """The IR graph of a joint graph and the maps between them (see :mod:`remat.tracer`)."""

    graph: Graph
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
    output_roles: list[OutputRole]
