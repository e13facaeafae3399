"""``remat.apply`` under ``DistributedDataParallel``: two CPU processes (gloo), one step each.

Each rank runs the same GPT (with dropout) on its own batch, once plainly and once with the plan
applied. The all-reduced gradients must be identical on both ranks and equal, bit for bit, to
those of plain DDP.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import remat
from remat.ir import Graph, Plan

WORLD = 2


def _build() -> tuple:
    from examples.models import build_gpt

    return build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=2, n_heads=2, dropout=0.1)


def _worker(rank: int, init_file: str, graph_json: str, plan_json: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, (idx,), loss_fn = _build()
        idx = (idx + rank) % 64  # each rank its own batch
        graph = Graph.from_json(graph_json)
        plan = Plan.model_validate_json(plan_json)
        grads = {}
        for name, remat_it in (("plain", False), ("remat", True)):
            m = copy.deepcopy(model)
            if remat_it:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    remat.apply(m, plan, graph)
            ddp = DDP(m)
            torch.manual_seed(100 + rank)
            loss_fn(ddp(idx)).backward()
            grads[name] = {n: p.grad.clone() for n, p in m.named_parameters()}
        torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_apply_under_ddp_gives_identical_gradients(tmp_path: Path) -> None:
    from remat import solver
    from remat.tracer import capture

    model, inputs, loss_fn = _build()
    graph = capture(model, inputs, loss_fn).graph
    result = solver.get("checkpoint-all")(graph, 10**12)
    assert result.plan is not None and result.plan.compute_counts().most_common(1)[0][1] > 1
    mp.start_processes(
        _worker,
        args=(
            str(tmp_path / "init"),
            graph.to_json(),
            result.plan.model_dump_json(),
            str(tmp_path),
        ),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    assert r0["remat"].keys() == r0["plain"].keys()
    for name in r0["plain"]:
        assert torch.equal(r0["remat"][name], r1["remat"][name]), f"ranks differ on {name}"
        assert torch.equal(r0["remat"][name], r0["plain"][name]), f"remat != plain DDP on {name}"
    # The two ranks saw different batches: the reduction really happened.
    assert any(
        not torch.equal(r0["plain"][n], torch.zeros_like(r0["plain"][n])) for n in r0["plain"]
    )


if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="torch.distributed with gloo is not available")
