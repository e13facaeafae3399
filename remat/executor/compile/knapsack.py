"""remat's search as torch's knapsack: for users who keep torch's partitioner.

``torch._functorch.config.activation_memory_budget_solver = RematKnapsack(budget="12GiB")``
(with ``activation_memory_budget`` below 1, so that torch asks a knapsack at all). Torch's
min-cut partitioner hands the knapsack the candidates it would otherwise not recompute
(``all_recomputable_banned_nodes``) and asks which of them to keep saved; torch then solves its
min cut (on bytes alone) with the others allowed to be recomputed, and that cut, not the
knapsack's choice, is the saved set.

:class:`RematKnapsack` therefore judges each choice by its outcome: it runs torch's own min cut
for the choice (``solve_min_cut`` with the aggressive options torch uses after the knapsack) and
simulates the partition that cut gives
(:meth:`~remat.executor.compile.partition.PartitionModel.figures`), under a budget in bytes. It
starts from letting torch recompute every candidate (torch's fewest saved bytes), keeps
candidates saved again in order of recomputation seconds per byte while the outcome fits, then
tries single changes while one makes the step faster. Torch's ``max_memory`` (a share of the
candidates' normalised sizes) is ignored when a budget is given; without one, torch's
``activation_memory_budget`` is read as a share of the graph's uncompiled dynamic peak. The
knapsack warns when no choice fits, and
:class:`remat.executor.compile.evaluate.PartitionRecorder` judges the partition torch made and
warns when it exceeds the bytes the knapsack was given.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomKnapsackSolver, get_hash_for_files

from remat.executor.compile.joint import joint_to_ir
from remat.executor.compile.partition import Figures, PartitionModel
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
        nodes = list(all_recomputable_banned_nodes)
        outcome = _MinCutOutcome(joint_graph, node_info, nodes, jir.fx_value, model)
        deadline = time.monotonic() + self.time_limit_s
        allowed, best = _choose(outcome, budget_bytes, deadline)
        self.calls += 1
        self.last_budget_bytes = budget_bytes
        self.last_predicted_peak_bytes = best.peak_bytes
        if best.peak_bytes > budget_bytes:
            from remat.executor.compile.dynamo import RematCompileWarning

            warnings.warn(
                f"RematKnapsack: no choice among torch's {len(nodes)} candidates fits "
                f"{format_bytes(budget_bytes)}; torch's min cut after the lowest needs "
                f"{format_bytes(best.peak_bytes)} (torch's partition will exceed the budget)",
                RematCompileWarning,
                stacklevel=2,
            )
        saved = [i for i in range(len(nodes)) if i not in allowed]
        recomputed = sorted(allowed)
        return saved, recomputed


class _MinCutOutcome:
    """What torch's partitioner saves when the knapsack lets it recompute ``allowed`` (indices
    into its candidates): torch's own min cut with its aggressive options and those nodes not
    banned, as it runs after the knapsack, judged by the simulator."""

    def __init__(
        self,
        joint_graph: torch.fx.Graph,
        node_info: Any,
        nodes: Sequence[torch.fx.Node],
        fx_value: dict[str, str],
        model: PartitionModel,
    ) -> None:
        from torch._functorch import config as functorch_config
        from torch._functorch.partitioners import MinCutOptions

        self.joint_graph = joint_graph
        self.node_info = node_info
        self.nodes = list(nodes)
        self.fx_value = fx_value
        self.model = model
        # torch's choose_saved_values_set: the aggressive options the knapsack's answer feeds.
        self.options = MinCutOptions(
            ban_if_used_far_apart=False,
            ban_if_long_fusible_chains=False,
            ban_if_materialized_backward=False,
            ban_if_not_in_allowlist=False,
            ban_if_reduction=functorch_config.ban_recompute_reductions,
        )
        self.cache: dict[frozenset[int], Figures] = {}

    def __call__(self, allowed: frozenset[int]) -> Figures:
        got = self.cache.get(allowed)
        if got is None:
            from torch._functorch.partitioners import solve_min_cut
            from torch.utils._ordered_set import OrderedSet

            dont_ban = OrderedSet(self.nodes[i] for i in sorted(allowed))
            saved_nodes, _ = solve_min_cut(self.joint_graph, self.node_info, self.options, dont_ban)
            saved = {self.fx_value[n.name] for n in saved_nodes if n.name in self.fx_value}
            got = self.model.figures(saved & self.model.forward_values)
            self.cache[allowed] = got
        return got


def _choose(
    outcome: _MinCutOutcome, budget_bytes: int, deadline: float
) -> tuple[frozenset[int], Figures]:
    """The candidates to let torch recompute: the fastest outcome that fits, else the lowest.

    Torch's outcome is not monotone in the choice: letting it recompute every candidate gives
    its fewest saved bytes, but the class recomputes each value once and keeps it until its
    last backward use, so the peak can rise again. From both ends (recompute none, recompute
    all), single changes (ban a candidate again, or let one be recomputed) are taken while one
    lowers the peak, until it fits; from the fitting outcomes, candidates are banned again in
    order of recomputation seconds per byte, then single changes are tried, while the step gets
    faster within the budget. Every outcome judged is kept; the fastest that fits is returned,
    else the one with the lowest peak. The deadline stops the search where it is, after a floor
    of outcomes (two passes of single changes).
    """
    every = frozenset(range(len(outcome.nodes)))
    model = outcome.model

    def late() -> bool:
        # As the class search's: the deadline binds after a floor of judged outcomes (a pass
        # of single changes from each end), so that a loaded machine still descends.
        return len(judged) > 2 * len(order) + 2 and time.monotonic() > deadline

    def fits(f: Figures) -> bool:
        return f.peak_bytes <= budget_bytes

    def seconds_per_byte(i: int) -> float:
        v = outcome.fx_value.get(outcome.nodes[i].name)
        if v is None or v not in model.producer:
            return 0.0
        return model.node[model.producer[v]].time_s / max(model.size[v], 1)

    order = sorted(every, key=seconds_per_byte, reverse=True)
    judged: dict[frozenset[int], Figures] = {}

    def judge(allowed: frozenset[int]) -> Figures:
        judged[allowed] = f = outcome(allowed)
        return f

    if fits(judge(frozenset())):
        return frozenset(), judged[frozenset()]
    for start in (every, frozenset()):
        cur, f = start, judge(start)
        while not fits(f) and not late():
            moves = [(judge(cur ^ {i}), cur ^ {i}) for i in order if not late()]
            lower = [(g, a) for g, a in moves if g.peak_bytes < f.peak_bytes]
            if not lower:
                break
            f, cur = min(lower, key=lambda ga: (ga[0].peak_bytes, ga[0].total_time_s))
        if not fits(f):
            continue
        for i in order:
            if late():
                break
            trial = cur - {i}
            g = judge(trial)
            if fits(g) and g.total_time_s <= f.total_time_s:
                cur, f = trial, g
        improved = True
        while improved and not late():
            improved = False
            for i in order:
                if late():
                    break
                g = judge(cur ^ {i})
                if fits(g) and g.total_time_s < f.total_time_s:
                    cur, f, improved = cur ^ {i}, g, True
    fitting = [(f, a) for a, f in judged.items() if fits(f)]
    if fitting:
        f, a = min(fitting, key=lambda fa: (fa[0].total_time_s, fa[0].peak_bytes, sorted(fa[1])))
    else:
        f, a = min(
            ((f, a) for a, f in judged.items()),
            key=lambda fa: (fa[0].peak_bytes, fa[0].total_time_s, sorted(fa[1])),
        )
    return a, f
