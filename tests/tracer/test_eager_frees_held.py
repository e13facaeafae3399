"""A block's tensor arguments are recorded on the values (``Value.held_by``), read by its ops
or not, so that a checkpoint region's hold on them is counted."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.executor import measure
from remat.ir import Plan, checkpoint_class, simulate


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)).square()  # `unused` is an argument it never reads


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.wide, self.narrow = nn.Linear(8, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.wide(x)  # given to each block, which never reads it
        x = x + self.narrow(torch.relu(side))  # its last read in the graph: relu
        for b in self.blocks:
            x = b(x, side)
        return x.square().mean()


def test_held_by_names_the_blocks_given_a_value_and_checkpoint_mode_counts_it() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(64, 8)
    graph = remat.trace(model, x)
    held = {v.id: v.held_by for v in graph.values if v.held_by}
    side = [vid for vid, paths in held.items() if "blocks.2" in paths and "blocks.0" in paths]
    assert side, held  # the `side` activation, given to every block
    regions = [checkpoint_class.region(graph, f"blocks.{i}") for i in range(3)]
    plan = checkpoint_class.checkpoint_plan(graph, regions)
    predicted = simulate(graph, plan).peak_dynamic_bytes
    remat.apply(model, plan, graph, mode="checkpoint")
    assert measure(model, x, None).peak_dynamic_bytes == predicted
    # without the record, the class would free `side` at its last read (relu), long before the
    # first block's backward ends, where the checkpoint frame lets it go
    bare = graph.model_copy(
        update={"values": tuple(v.model_copy(update={"held_by": ()}) for v in graph.values)}
    )
    (vid,) = side

    def freed_at(p: Plan) -> int:
        return next(i for i, st in enumerate(p.steps) if st.op == "free" and st.id == vid)

    assert freed_at(checkpoint_class.checkpoint_plan(bare, regions)) < freed_at(plan)
    block0_backward = [
        i for i, st in enumerate(plan.steps)
        if st.op == "compute" and graph.node(st.id).phase == "backward"
        and graph.node(st.id).module.startswith("blocks.0")
    ]  # fmt: skip
    assert freed_at(plan) > max(block0_backward)
