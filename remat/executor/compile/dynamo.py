""":class:`RematBackend`: a torch.compile backend whose partition of each joint graph is
remat's, under a budget in bytes.

Graph breaks
------------
A step compiled with graph breaks runs several joint graphs; they share one budget in bytes. The
graphs are planned in the order dynamo compiles them (the order their forwards first run).
While graph ``k`` runs, every graph compiled before it holds its static bytes and what it saved
for its backward (its backward runs after ``k``'s), so graph ``k`` is planned under the budget
minus those bytes. Graphs compiled later are not known yet; their parameters are not in an
earlier graph's figures, so after all graphs are compiled :attr:`RematBackend.predicted_peak_bytes`
adds them up and :meth:`RematBackend.check` says whether the whole step fits. The first graphs
take the fastest plan that fits what is left; a later graph that cannot fit in what they leave
raises :class:`~remat.ir.InfeasibleBudgetError` naming the bytes they hold (earlier graphs are
compiled already and are not planned again). A recompilation of
the same code (a guard failed, a new shape) replaces that graph's entry instead of adding one.
Memory held by eager code between the graphs (e.g. a loss computed outside the compiled
region) is not part of any graph.

Relative budgets (``"70%"``, ``0.7``) apply per graph: its static bytes plus that share of the
dynamic peak its uncompiled (eager, no recomputation) schedule needs.

Dynamic shapes
--------------
A graph compiled with symbolic sizes is planned at the sizes of the call that triggered its
compilation (the symbols' hints); the budget holds for those sizes, and a larger input can take
more memory. The backend warns when it plans a symbolic graph. ``remat.compile`` compiles with
``dynamic=False``, so every new shape is compiled and planned again.

Inductor's schedule
-------------------
Inductor compiles the graphs the plan split in an order of its own: its pattern passes rewrite
them, its lowering computes a value inside the kernel that reads it, and it fuses kernels, so
the peak of its code (replayed by :mod:`~remat.executor.compile.inductor_memory`) can exceed
the plan's. Each graph is compiled up to four times (:data:`INDUCTOR_TRIES`), and the first
whose code fits the budget is kept: with inductor's heuristics (the fastest code); with the
plan's order pinned; with the plan's kernels one by one (each value made where the plan makes
it, no fusion: :mod:`~remat.executor.compile.inductor_order`); then the kernels again, with the
plan made under the budget less what their code needed over it. Where none fits, the try with
the lowest peak is kept and the backend warns. :attr:`GraphPlan.inductor_tries` lists the tries
with their peaks.

Where the solver finds no plan within the budget on the joint graph as inductor decomposed it
(GELU, layer norm and softmax as chains of pointwise ops, whose intermediates the IR counts but
inductor never allocates), the graph is planned again with those chains folded into their
readers (:func:`~remat.executor.compile.fuse.fold_inlined`): the plan then counts inductor's
buffers, and the tries above compile it (their notes say "inlined chains folded"). The GPT
example at 30%: no plan on the 355-node IR, a 5.64 MiB code on the folded one (198 nodes)
within 5.96 MiB. With ``aot_eager`` every FX node allocates, so nothing is folded.

``remat.backend`` and ``remat.compile`` (:mod:`remat.torch_compile`) build this backend with a
remat solver as its seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from remat.executor.compile.fuse import fold_inlined
from remat.executor.compile.inductor_memory import CompiledMemory, capture_graphs, compiled_memory
from remat.executor.compile.inductor_order import inductor_order
from remat.executor.compile.joint import JointIR, joint_to_ir
from remat.executor.compile.partition import Partition, PartitionModel
from remat.executor.compile.plan_split import (
    PlanSplit,
    emitted_figures,
    plan_orders,
    split_plan,
)
from remat.executor.compile.search import search_partition
from remat.executor.compile.split import RNG_STATE_BYTES, Split, split_joint
from remat.ir import Graph, InfeasibleBudgetError, InvalidPlanError, Plan, simulate
from remat.ir.budget import BudgetSpec, format_bytes, parse_budget
from remat.ir.plan_builders import eager_plan

Compiler = str | Callable[[torch.fx.GraphModule, Sequence[Any]], Any]
SeedFn = Callable[[Graph, int, float], Plan | None]
"""``seed(graph, budget_bytes, time_limit_s) -> plan or None``: a remat solver's plan on a
joint graph's IR, whose saved values start the class search (``remat.backend`` passes
``remat.solve`` with the named solver; the executor does not import the solvers)."""


OP_LEVEL = ("below-class", "prefer", "never")
"""When the graphs run the solver's op-level plan instead of a saved set of the class:
when no saved set found fits, always (when it fits), or never."""


class RematCompileWarning(UserWarning):
    """A compiled graph's plan holds under assumptions the user should know about."""


INDUCTOR_TRIES: tuple[str, ...] = ("heuristics", "pinned", "kernels", "kernels")
"""The compiles of one graph with inductor, in order, until one's code fits: its heuristics, the
plan's order pinned, the plan's kernels one by one
(:mod:`~remat.executor.compile.inductor_order`), and the kernels again with the plan made under
the budget less what the last code needed over it."""

_HOW = {
    "heuristics": "inductor's heuristics",
    "pinned": "the plan's order pinned",
    "kernels": "the plan's kernels one by one",
}


def infeasible_cause(exc: BaseException | None) -> InfeasibleBudgetError | None:
    """The :class:`InfeasibleBudgetError` behind ``exc`` (torch wraps what backends raise)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, InfeasibleBudgetError):
            return exc
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
        seen += 1
    return None


@dataclass(frozen=True)
class _Call:
    """One call of the partition function: what every plan made in it shares."""

    key: str
    index: int
    budget_bytes: int
    planned: int
    """The budget the plans are made under (:attr:`GraphPlan.planned_bytes`)."""
    eager: Any
    """The simulation of the joint graph's eager plan (the baseline)."""
    num_fwd_outputs: int
    t0: float


def _about(call: _Call, jir: JointIR) -> dict[str, Any]:
    """The fields of a :class:`GraphPlan` that do not depend on how it was split."""
    return {
        "index": call.index,
        "key": call.key,
        "num_nodes": jir.graph.num_nodes,
        "static_bytes": jir.graph.static_bytes,
        "eager_peak_bytes": call.eager.peak_bytes,
        "baseline_time_s": call.eager.total_time_s,
        "solve_time_s": time.perf_counter() - call.t0,
        "symbolic": jir.symbolic,
        "ir": jir,
        "budget_bytes": call.budget_bytes,
        "planned_bytes": call.planned,
    }


@dataclass(frozen=True)
class GraphPlan:
    """What the backend decided for one joint graph, with the simulator's figures."""

    index: int
    key: str
    num_nodes: int
    budget_bytes: int
    static_bytes: int
    eager_peak_bytes: int
    predicted_peak_bytes: int
    """Peak of the compiled step: with inductor, its generated code replayed
    (:attr:`compiled`); otherwise :attr:`simulated_peak_bytes`."""
    simulated_peak_bytes: int
    """The simulator's peak on the FX graphs (forward, then the backward order the split
    made), which the plan was chosen by: an upper bound of inductor's, which fuses."""
    baseline_time_s: float
    predicted_time_s: float
    saved_bytes: int
    """Bytes of the activations saved for the backward (held across later graphs); with
    inductor, the storages its forward hands to the backward."""
    num_saved: int
    num_recomputed: int
    rng_replayed: tuple[str, ...]
    solve_time_s: float
    symbolic: bool
    fits: bool
    partition: Partition | None
    """The saved set of the partitioner's class; None for an op-level plan."""
    ir: JointIR
    split: Split | PlanSplit
    op_level: bool = False
    """True when the graphs run the solver's op-level plan (below the partitioner's class:
    values recomputed several times, where the plan places them)."""
    compiled: CompiledMemory | None = None
    """With inductor: the figures of its generated code
    (:func:`~remat.executor.compile.inductor_memory.compiled_memory`)."""
    planned_bytes: int = 0
    """The budget the plan was made under: :attr:`budget_bytes`, less what inductor's code
    needed over it on an earlier try (0: the budget)."""
    inductor_tries: tuple[str, ...] = ()
    """With inductor: each compile tried and the peak of its code (module docstring)."""

    @property
    def predicted_overhead(self) -> float:
        return self.predicted_time_s / self.baseline_time_s - 1 if self.baseline_time_s else 0.0


class _Partitioner(CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn`` hook, calling back into the backend."""

    def __init__(self, backend: RematBackend) -> None:
        self.backend = backend

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        kwargs.pop("compiler", None)
        return self.backend.partition(gm, joint_inputs, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Partitioner:
        # Inductor copies its config (debug and repro strings); the backend it calls back
        # into holds FX graphs of fake tensors, which do not copy. One instance is enough.
        return self

    def uuid(self) -> Any | None:
        # The partition depends on the budget left by the graphs compiled before this one:
        # never reuse a cached compile.
        return None


class RematBackend:
    """A torch.compile backend (``torch.compile(model, backend=RematBackend(...))``).

    Parameters
    ----------
    budget
        Device bytes for the step (``"12GiB"``, an int), or a share of each graph's uncompiled
        need (``"70%"``, ``0.7``): see the module docstring.
    solver
        The name of the remat solver behind ``seed`` (for reports).
    seed
        A remat solver's plan on each graph's IR (see :data:`SeedFn`) whose saved values seed
        the search in the partitioner's class; None: the class search alone.
    time_limit_s
        Seconds per graph for the solver and the search together.
    compiler
        ``"inductor"`` (default), ``"aot_eager"`` (run the FX graphs as they are), or a
        callable ``(gm, example_inputs) -> callable`` that compiles the forward and the backward
        graph (as AOT autograd's ``fw_compiler`` and ``bw_compiler``).
    cost
        The cost model for the IR's node times: a device profile name (``"cpu"``, ``"h100"``)
        or ``"flops"``.
    exact_random
        With inductor, draw random numbers with eager's kernels (``fallback_random``) so that
        dropout gives the uncompiled step's numbers.
    op_level
        ``"below-class"`` (default): where no saved set of the partitioner's class found fits
        the budget, run the seed's op-level plan (values recomputed several times, where it
        places them, :mod:`~remat.executor.compile.plan_split`) if what it runs fits;
        ``"prefer"``: that plan whenever it fits; ``"never"``: the class only.
    """

    def __init__(
        self,
        budget: BudgetSpec,
        *,
        solver: str = "greedy",
        seed: SeedFn | None = None,
        time_limit_s: float = 30.0,
        compiler: Compiler = "inductor",
        cost: str = "cpu",
        exact_random: bool = True,
        op_level: str = "below-class",
    ) -> None:
        self.budget = parse_budget(budget)
        if op_level not in OP_LEVEL:
            raise ValueError(f"op_level must be one of {OP_LEVEL}, got {op_level!r}")
        self.op_level = op_level
        if not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0):
            raise ValueError(f"time_limit_s must be > 0, got {time_limit_s!r}")
        if not (callable(compiler) or compiler in ("inductor", "aot_eager")):
            raise ValueError(
                f"compiler must be 'inductor', 'aot_eager' or a callable, got {compiler!r}"
            )
        self.solver = solver
        self.seed = seed
        self.time_limit_s = float(time_limit_s)
        self.compiler = compiler
        self.cost = cost
        self.exact_random = exact_random
        self.plans: dict[str, GraphPlan] = {}
        self._count = 0
        self._tightened: dict[str, int] = {}
        """Bytes taken off a graph's budget for the next inductor try (``_compile_inductor``)."""
        self._memo: dict[tuple[Any, ...], tuple[Plan | None, Partition, Partition]] = {}
        """Plans made during one ``_compile_inductor``, by graph and budget: a later try at the
        same budget compiles the same plan without solving again."""
        self._folded_memo: dict[tuple[Any, ...], Plan | None] = {}
        """As ``_memo``, for the plans made on the folded IR (``_folded_plan``)."""
        self._last_key: str | None = None

    # -- the dynamo backend -----------------------------------------------------------------

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        if self.compiler == "inductor":
            return self._compile_inductor(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        # aot_eager: torch's boxed runner, which frees each input (saved tensors included) after
        # its last use, as inductor's code does.
        inner = self.compiler if callable(self.compiler) else boxed_nop

        compiled = aot_autograd(
            fw_compiler=inner,
            bw_compiler=inner,
            partition_fn=self.partition,
            keep_inference_input_mutations=True,
        )
        return compiled(gm, example_inputs)

    def _compile_inductor(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        """Inductor, tried until its generated code fits the budget (module docstring,
        "Inductor's schedule", :data:`INDUCTOR_TRIES`)."""
        from torch._inductor.compile_fx import compile_fx

        self._memo.clear()
        self._folded_memo.clear()
        tries: list[tuple[Any, GraphPlan]] = []
        notes: list[str] = []
        key: str | None = None
        for mode in INDUCTOR_TRIES:
            self._last_key = None
            try:
                with (
                    capture_graphs() as graphs,
                    self._inductor_patches(mode),
                ):
                    compiled = compile_fx(gm, example_inputs)
            except Exception as exc:
                # A budget tightened past what any plan fits: keep the tries made so far.
                if not tries or infeasible_cause(exc) is None:
                    raise
                # The refused plan's entry (written before the partition raised).
                planned = self.plans[key].planned_bytes if key else 0
                notes.append(f"planned under {format_bytes(planned)}: no plan fits")
                break
            key = self._last_key
            if key is None:
                return compiled  # no joint graph (an inference graph): nothing planned
            mem = self._attach_compiled(key, graphs)
            plan = self.plans[key]
            tries.append((compiled, plan))
            how = _HOW[mode]
            if plan.ir.fused:
                how += ", inlined chains folded"
            if plan.planned_bytes != plan.budget_bytes:
                how += f", planned under {format_bytes(plan.planned_bytes)}"
            notes.append(f"{how}: {format_bytes(plan.predicted_peak_bytes)}")
            if mem is None or mem.peak_bytes <= plan.budget_bytes:
                break
            if mode == "kernels":
                # Plan again for what the compiled code needs beyond the FX graphs' figures.
                self._tightened[key] = self._tightened.get(key, 0) + (
                    mem.peak_bytes - plan.budget_bytes
                )
        assert key is not None and tries
        compiled, plan = min(
            tries, key=lambda t: (not t[1].fits, 0 if t[1].fits else t[1].predicted_peak_bytes)
        )
        self._tightened.pop(key, None)
        plan = dataclasses.replace(plan, inductor_tries=tuple(notes))
        self.plans[key] = plan
        if not plan.fits and plan.compiled is not None:
            warnings.warn(
                f"remat: graph {plan.index}'s compiled code needs "
                f"{format_bytes(plan.predicted_peak_bytes)}, over its budget of "
                f"{format_bytes(plan.budget_bytes)} (the plan fit on the FX graphs: "
                f"{format_bytes(plan.simulated_peak_bytes)}; inductor tried: "
                f"{'; '.join(notes)})",
                RematCompileWarning,
                stacklevel=3,
            )
        return compiled

    @contextlib.contextmanager
    def _inductor_patches(self, mode: str) -> Iterator[None]:
        from torch._inductor import config as inductor_config

        # No compile caches: the partition depends on the budget left by earlier graphs.
        patch: dict[str, Any] = {
            "custom_partitioner_fn": _Partitioner(self),
            "fx_graph_cache": False,
        }
        if self.exact_random:
            patch["fallback_random"] = True
        with contextlib.ExitStack() as stack:
            stack.enter_context(inductor_config.patch(patch))
            stack.enter_context(
                torch._functorch.config.patch(
                    force_non_lazy_backward_lowering=True, enable_autograd_cache=False
                )
            )
            stack.enter_context(inductor_order(mode))
            yield

    # -- the partition function -------------------------------------------------------------

    def partition(
        self,
        joint: torch.fx.GraphModule,
        joint_inputs: Sequence[object],
        *,
        num_fwd_outputs: int,
        static_lifetime_input_indices: list[int] | None = None,
        **_: Any,
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """AOT autograd's ``partition_fn``: map, solve in the class, split."""
        t0 = time.perf_counter()
        joint.graph.eliminate_dead_code()
        joint.recompile()
        key = _graph_key()
        self._last_key = key
        index = self.plans[key].index if key in self.plans else self._count
        if key not in self.plans:
            self._count += 1
        jir = joint_to_ir(
            joint,
            num_fwd_outputs=num_fwd_outputs,
            static_input_indices=static_lifetime_input_indices or (),
            cost=self.cost,
            name=f"graph{index}",
        )
        if jir.symbolic:
            warnings.warn(
                f"remat: graph {index} has symbolic sizes; it is planned at the sizes of this "
                "call, and the budget holds for those (compile with dynamic=False to plan "
                "each shape)",
                RematCompileWarning,
                stacklevel=2,
            )
        graph = jir.graph
        model = PartitionModel(graph, rng_state_bytes=RNG_STATE_BYTES)
        eager = simulate(graph, eager_plan(graph))
        budget_bytes = self._graph_budget(key, graph.static_bytes, eager.peak_dynamic_bytes)
        planned = budget_bytes - self._tightened.get(key, 0)
        memo_key = (key, planned, tuple((n.name, str(n.target)) for n in joint.graph.nodes))
        if memo_key in self._memo:
            seed_plan, best, lowest = self._memo[memo_key]
        else:
            seed_plan, best, lowest = self._solve(model, graph, planned, t0)
            self._memo[memo_key] = (seed_plan, best, lowest)
        below = ""
        call = _Call(key, index, budget_bytes, planned, eager, num_fwd_outputs, t0)
        op_level = self.op_level == "prefer" or (
            self.op_level == "below-class" and best.peak_bytes > planned
        )
        if op_level and seed_plan is not None:
            got = self._op_level_plan(call, jir, model, seed_plan)
            if isinstance(got, GraphPlan):
                return got.split.forward, got.split.backward
            below = got
        if op_level and self.compiler == "inductor" and self.seed is not None:
            got = self._folded_plan(call, jir, memo_key)
            if isinstance(got, GraphPlan):
                return got.split.forward, got.split.backward
            below += got
        split = split_joint(
            jir,
            best,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )
        # The figures of what will run: the forward and backward orders the split produced.
        plan = model.plan_for_orders(split.forward_order, split.backward_order, best.saved)
        sim = simulate(graph, plan)
        rng_bytes = RNG_STATE_BYTES * len(split.rng_replayed)
        predicted = sim.peak_bytes + rng_bytes
        saved_bytes = sum(model.size[v] for v in best.saved) + rng_bytes
        fits = predicted <= planned
        self.plans[key] = GraphPlan(
            **_about(call, jir),
            predicted_peak_bytes=predicted,
            simulated_peak_bytes=predicted,
            predicted_time_s=sim.total_time_s,
            saved_bytes=saved_bytes,
            num_saved=len(best.saved),
            num_recomputed=len(best.recomputed),
            rng_replayed=tuple(split.rng_replayed),
            fits=fits,
            partition=best,
            split=split,
        )
        if not fits:
            held = (
                ""
                if isinstance(self.budget, float) or not index
                else f" ({format_bytes(self.budget - budget_bytes)} of the step's budget are "
                "held by the graphs compiled before it: their parameters, gradients and saved "
                "activations)"
            )
            if planned != budget_bytes:
                held += (
                    f" (less {format_bytes(budget_bytes - planned)} that inductor's code needed "
                    "over the plan before)"
                )
            floor = model.floor_bytes()
            proven = (
                "so none fits (proven)"
                if floor > planned
                else "so a partition between the two may exist that the search did not find"
            )
            raise InfeasibleBudgetError(
                f"remat: graph {index} ({graph.num_nodes} nodes): the lowest partition found in "
                f"the partitioner's class needs {format_bytes(lowest.peak_bytes)}, over its "
                f"budget of {format_bytes(planned)}{held}; no partition of the class needs "
                f"less than {format_bytes(floor)}, {proven}{below}",
                min_budget_bytes=lowest.peak_bytes,
            )
        return split.forward, split.backward

    def _seed_plan(self, model: PartitionModel, budget_bytes: int) -> Plan | None:
        """The seed solver's plan on ``model``'s graph, on a quarter of the time; None where
        it finds none. The solver does not see the generator states that rerun random ops
        save: it plans under the budget less one state per random op."""
        if self.seed is None:
            return None
        graph = model.graph
        reserve = RNG_STATE_BYTES * sum(graph.node(n).rng for n in model.forward)
        try:
            return self.seed(graph, budget_bytes - reserve, self.time_limit_s / 4)
        except InfeasibleBudgetError:
            return None

    def _solve(
        self, model: PartitionModel, graph: Graph, budget_bytes: int, t0: float
    ) -> tuple[Plan | None, Partition, Partition]:
        """The seed solver's plan (where the whole saved set does not fit, or always with
        ``op_level="prefer"``), and the best and the lowest partition of the class found."""
        seeds: list[set[str]] = []
        seed_plan: Plan | None = None
        full = model.partition(model.read_by_backward)
        if full.peak_bytes > budget_bytes or self.op_level == "prefer":
            seed_plan = self._seed_plan(model, budget_bytes)
            if seed_plan is not None:
                seeds.append(model.saved_from_plan(seed_plan))
        left = max(self.time_limit_s - (time.perf_counter() - t0), 1.0)
        best, lowest = search_partition(model, budget_bytes, seeds=seeds, time_limit_s=left)
        return seed_plan, best, lowest

    def _folded_plan(self, call: _Call, jir: JointIR, memo_key: tuple[Any, ...]) -> GraphPlan | str:
        """With inductor: the seed's op-level plan made on the IR with the chains inductor
        inlines folded (:func:`~remat.executor.compile.fuse.fold_inlined`: the plan counts
        inductor's buffers, not the decomposed graph's intermediates), as forward and
        backward graphs when what they run fits; else why not (a clause for the error)."""
        folded = fold_inlined(jir)
        if folded is jir:
            return ""
        model = PartitionModel(folded.graph, rng_state_bytes=RNG_STATE_BYTES)
        fkey = (*memo_key, "folded")
        if fkey in self._folded_memo:
            plan = self._folded_memo[fkey]
        else:
            plan = self._folded_memo[fkey] = self._seed_plan(model, call.planned)
        where = f"on inductor's buffers ({folded.graph.num_nodes} nodes, chains folded)"
        if plan is None:
            return f"; {where} the {self.solver} solver finds no plan either"
        got = self._op_level_plan(call, folded, model, plan)
        return got if isinstance(got, GraphPlan) else f"; {where}{got.removeprefix(';')}"

    def _op_level_plan(
        self, call: _Call, jir: JointIR, model: PartitionModel, plan: Plan
    ) -> GraphPlan | str:
        """The solver's op-level plan as forward and backward graphs
        (:mod:`~remat.executor.compile.plan_split`) when what they run fits the budget;
        else why not (a clause for the error)."""
        try:
            orders = plan_orders(jir, plan)
            figures = emitted_figures(model, orders, rng_state_bytes=RNG_STATE_BYTES)
            if figures.peak_bytes > call.planned:
                return (
                    f"; the {self.solver} plan below the class needs "
                    f"{format_bytes(figures.peak_bytes)}"
                )
            split = split_plan(jir, orders, num_fwd_outputs=call.num_fwd_outputs)
        except InvalidPlanError as exc:
            return f"; the {self.solver} plan below the class does not run compiled: {exc}"
        sim = figures.simulation
        rng_bytes = RNG_STATE_BYTES * len(split.rng_saved)
        saved = {jir.fx_value[n] for n in split.saved_nodes} & model.forward_values
        self.plans[call.key] = GraphPlan(
            **_about(call, jir),
            predicted_peak_bytes=figures.peak_bytes,
            simulated_peak_bytes=figures.peak_bytes,
            predicted_time_s=sim.total_time_s,
            saved_bytes=sum(model.size[v] for v in saved) + rng_bytes,
            num_saved=len(saved),
            num_recomputed=sim.num_recomputes,
            rng_replayed=tuple(split.rng_replayed),
            fits=True,
            partition=None,
            split=split,
            op_level=True,
        )
        return self.plans[call.key]

    def _attach_compiled(self, key: str, graphs: Sequence[Any]) -> CompiledMemory | None:
        """The graph's figures from inductor's generated code (its forward and backward)."""
        plan = self.plans[key]
        mem = compiled_memory(plan.ir, graphs, num_fwd_outputs=len(plan.ir.fw_outputs))
        if mem is None:
            return None
        self.plans[key] = dataclasses.replace(
            plan,
            predicted_peak_bytes=mem.peak_bytes,
            saved_bytes=mem.saved_bytes,
            fits=mem.peak_bytes <= plan.budget_bytes,
            compiled=mem,
        )
        return mem

    def _graph_budget(self, key: str, static_bytes: int, eager_dynamic_bytes: int) -> int:
        if isinstance(self.budget, float):
            return static_bytes + int(self.budget * eager_dynamic_bytes)
        held = sum(p.static_bytes + p.saved_bytes for k, p in self.plans.items() if k != key)
        return self.budget - held

    # -- figures for the whole step ---------------------------------------------------------

    @property
    def predicted_peak_bytes(self) -> int:
        """The step's simulated peak over all graphs compiled so far (module docstring)."""
        plans = sorted(self.plans.values(), key=lambda p: p.index)
        static = sum(p.static_bytes for p in plans)
        peak = 0
        held = 0
        for p in plans:
            peak = max(peak, held + p.predicted_peak_bytes - p.static_bytes)
            held += p.saved_bytes
        return static + peak

    def check(self) -> bool:
        """Whether the step's predicted peak fits a budget in bytes (True for fractions)."""
        if isinstance(self.budget, float):
            return all(p.fits for p in self.plans.values())
        return self.predicted_peak_bytes <= self.budget

    def reset(self) -> None:
        """Forget the graphs planned so far (after ``torch._dynamo.reset()``)."""
        self.plans.clear()
        self._count = 0
        self._tightened.clear()
        self._memo.clear()


def _graph_key() -> str:
    """The frame being compiled, so a recompilation replaces that graph's entry."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    if cid is None:
        return f"graph-{time.monotonic_ns()}"
    return f"{cid.frame_id}"
