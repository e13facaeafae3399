"""remat's search as torch's knapsack: for users who keep torch's partitioner.

``torch._functorch.config.activation_memory_budget_solver = RematKnapsack(budget="12GiB")``
(with ``activation_memory_budget`` below 1, so that torch asks a knapsack at all). Torch's
min-cut partitioner hands the knapsack the candidates it would otherwise not recompute
(``all_recomputable_banned_nodes``) and asks which of them to keep saved; torch then solves its
min cut with the others allowed to be recomputed.

:class:`RematKnapsack` maps the joint graph to the IR, searches the partitioner's class with
only those candidates free to be recomputed
(:func:`~remat.executor.compile.search.search_partition`) under a budget in bytes, and keeps
saved the candidates of the best partition. Torch's ``max_memory`` (a share of the candidates'
normalised sizes) is ignored when a budget is given; without one, torch's
``activation_memory_budget`` is read as a share of the graph's uncompiled dynamic peak. The
final saved set is torch's min cut, which may save other values than the knapsack chose (and
exceed the bytes): the knapsack warns when no choice of its candidates fits, and
:class:`remat.executor.compile.evaluate.PartitionRecorder` judges the partition torch made and
warns when it exceeds the bytes the knapsack was given.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomKnapsackSolver, get_hash_for_files

from remat.executor.compile.joint import joint_to_ir
from remat.executor.compile.partition import PartitionModel
from remat.executor.compile.search import search_partition
from remat.executor.compile.split import RNG_STATE_BYTES
from remat.ir import simulate
from remat.ir.budget import BudgetSpec, format_bytes, parse_budget
from remat.ir.plan_builders import eager_plan


class RematKnapsack(CustomKnapsackSolver):
    """A ``CustomKnapsackSolver`` that keeps saved what remat's class search keeps.

    Parameters
    ----------
    budget
        Device bytes of the step, or a share of each graph's uncompiled need (``"70%"``);
        None: torch's ``activation_memory_budget`` as that share.
    cost
        The cost model for the IR's node times (``"cpu"``, ``"h100"``, ``"flops"``).
    time_limit_s
        Seconds for the search per graph.
    """

    def __init__(
        self, budget: BudgetSpec | None = None, *, cost: str = "cpu", time_limit_s: float = 10.0
    ) -> None:
        self.budget = None if budget is None else parse_budget(budget)
        if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
            raise ValueError(f"time_limit_s must be > 0, got {time_limit_s!r}")
        self.cost = cost
        self.time_limit_s = float(time_limit_s)
        self.last_budget_bytes: int | None = None
        self.calls = 0
        """How many times torch asked this knapsack (once per joint graph it partitions)."""
        self.last_predicted_peak_bytes: int | None = None

    def uuid(self) -> Any | None:
        """Stable across processes: the search's source files and this object's settings."""
        here = Path(__file__).parent
        files = tuple(str(here / f) for f in ("knapsack.py", "partition.py", "joint.py"))
        extra = json.dumps([self.budget, self.cost, self.time_limit_s], sort_keys=True)
        return get_hash_for_files(files, extra)

    def __call__(
        self,
        memory: list[float],
        joint_graph: torch.fx.Graph,
        max_memory: float,
        node_info: Any,
        all_recomputable_banned_nodes: list[torch.fx.Node],
    ) -> tuple[list[int], list[int]]:
        module = joint_graph.owning_module
        if module is None:
            raise ValueError("RematKnapsack: the joint graph has no owning module")
        out = next(n for n in reversed(joint_graph.nodes) if n.op == "output")
        outs = list(out.args[0])
        num_fwd = 0
        for o in outs:
            if isinstance(o, torch.fx.Node) and node_info.is_required_fw(o):
                num_fwd += 1
            else:
                break
        primals = [n for n in joint_graph.nodes if n.op == "placeholder"]
        primals = [n for n in primals if not n.name.startswith("tangents")]
        statics = [i for i, p in enumerate(primals) if p in node_info.static_lifetime_input_nodes]
        jir = joint_to_ir(
            module, num_fwd_outputs=num_fwd, static_input_indices=statics, cost=self.cost
        )
        graph = jir.graph
        model = PartitionModel(graph, rng_state_bytes=RNG_STATE_BYTES)
        eager = simulate(graph, eager_plan(graph))
        if isinstance(self.budget, int):
            budget_bytes = self.budget
        else:
            share = (
                self.budget
                if self.budget is not None
                else float(torch._functorch.config.activation_memory_budget)
            )
            budget_bytes = graph.static_bytes + int(share * eager.peak_dynamic_bytes)
        value_of = [jir.fx_value.get(n.name) for n in all_recomputable_banned_nodes]
        droppable = {v for v in value_of if v is not None}
        best, _ = search_partition(
            model, budget_bytes, time_limit_s=self.time_limit_s, droppable=droppable
        )
        self.calls += 1
        self.last_budget_bytes = budget_bytes
        self.last_predicted_peak_bytes = best.peak_bytes
        if best.peak_bytes > budget_bytes:
            from remat.executor.compile.dynamo import RematCompileWarning

            warnings.warn(
                f"RematKnapsack: no choice among torch's {len(droppable)} candidates fits "
                f"{format_bytes(budget_bytes)}; the lowest needs "
                f"{format_bytes(best.peak_bytes)} (torch's partition will exceed the budget)",
                RematCompileWarning,
                stacklevel=2,
            )
        saved = [i for i, v in enumerate(value_of) if v is None or v in best.saved]
        recomputed = [i for i, v in enumerate(value_of) if v is not None and v not in best.saved]
        return saved, recomputed
