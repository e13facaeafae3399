"""``remat.apply`` under ``DistributedDataParallel``: two CPU processes (gloo), two steps each.

Each rank runs the same GPT (with dropout) on its own batch, once plainly and once with the plan
applied, in both modes (op-level inside autograd, and checkpoint regions). DDP's hooks must fire
(its all-reduce averages the ranks' gradients): the gradients must be identical on both ranks
and equal, bit for bit, to those of plain DDP, and so must the parameters after two SGD steps.
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
from remat.ir import checkpoint_class

WORLD = 2


def _build() -> tuple:
    from examples.models import build_gpt

    return build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=2, n_heads=2, dropout=0.1)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from remat import solver
    from remat.tracer import capture

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, (idx,), loss_fn = _build()
        idx = (idx + rank) % 64  # each rank its own batch
        # Each rank captures and plans for itself (as a training script would): the op-level
        # executor reuses that capture, so no process captures the step twice.
        cap = capture(model, (idx,), loss_fn)
        graph = cap.graph
        plan = solver.get("checkpoint-all")(graph, 10**12).plan
        assert plan is not None
        grads: dict[str, object] = {"recomputes": plan.compute_counts().most_common(1)[0][1] > 1}
        for name in ("plain", "remat", "checkpoint"):
            m = copy.deepcopy(model)
            if name == "checkpoint":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    remat.apply(m, checkpoint_class.project(graph, plan), graph, mode="checkpoint")
            elif name == "remat":
                remat.apply(m, plan, graph, loss_fn=loss_fn, capture=cap, example_inputs=(idx,))
            ddp = DDP(m)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            torch.manual_seed(100 + rank)
            for _ in range(2):
                opt.zero_grad()
                out = ddp(idx)
                (out if name == "remat" else loss_fn(out)).backward()
                if _ == 0:
                    grads[name] = {n: p.grad.clone() for n, p in m.named_parameters()}
                opt.step()
            grads[name + "-params"] = {n: p.detach().clone() for n, p in m.named_parameters()}
        torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_apply_under_ddp_gives_identical_gradients(tmp_path: Path) -> None:
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    assert r0["recomputes"] and r1["recomputes"]  # the plan recomputes something
    for mode in ("remat", "checkpoint", "remat-params", "checkpoint-params"):
        plain = "plain-params" if mode.endswith("params") else "plain"
        assert r0[mode].keys() == r0[plain].keys()
        for name in r0[plain]:
            assert torch.equal(r0[mode][name], r1[mode][name]), f"{mode}: ranks differ on {name}"
            assert torch.equal(r0[mode][name], r0[plain][name]), f"{mode} != plain on {name}"
    # The two ranks saw different batches: the reduction really happened.
    assert any(
        not torch.equal(r0["plain"][n], torch.zeros_like(r0["plain"][n])) for n in r0["plain"]
    )


if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="torch.distributed with gloo is not available")
