"""Judge any partition of a joint graph with remat's simulator: torch's own included.

:class:`PartitionRecorder` wraps a partition function (torch's
``min_cut_rematerialization_partition`` by default, which honours
``activation_memory_budget`` and its knapsack solver), lets it split each joint graph, maps the
joint graph to the IR and replays the forward and backward orders it produced in the simulator,
so that torch's partitions and remat's are compared by one judge. Use it as AOT autograd's
``partition_fn`` (``compiler="aot_eager"``) or as inductor's ``custom_partitioner_fn``
(:func:`torch_backend`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from remat.executor.compile.inductor_memory import capture_graphs, compiled_memory
from remat.executor.compile.joint import JointIR, joint_to_ir
from remat.executor.compile.partition import PartitionModel
from remat.executor.compile.split import RNG_STATE_BYTES
from remat.ir import simulate
from remat.ir.plan_builders import eager_plan


@dataclass(frozen=True)
class JudgedPartition:
    """The simulator's figures for one partition a partitioner made."""

    num_nodes: int
    static_bytes: int
    eager_peak_bytes: int
    predicted_peak_bytes: int
    """With inductor, its generated code replayed; otherwise :attr:`simulated_peak_bytes`."""
    simulated_peak_bytes: int
    """The simulator on the FX graphs the partitioner made."""
    baseline_time_s: float
    predicted_time_s: float
    num_saved: int
    saved_bytes: int
    num_recomputed: int
    num_fwd_outputs: int = 0
    ir: JointIR | None = field(default=None, repr=False, compare=False)

    @property
    def predicted_overhead(self) -> float:
        return self.predicted_time_s / self.baseline_time_s - 1 if self.baseline_time_s else 0.0


def judge(
    joint: torch.fx.GraphModule,
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Sequence[int] = (),
    cost: str = "cpu",
) -> JudgedPartition:
    """Simulate the step that ``forward`` and ``backward`` (split from ``joint``) run."""
    jir = joint_to_ir(
        joint,
        num_fwd_outputs=num_fwd_outputs,
        static_input_indices=static_lifetime_input_indices,
        cost=cost,
    )
    model = PartitionModel(jir.graph)
    fw_calls = [n for n in forward.graph.nodes if n.op == "call_function"]
    bw_calls = [n for n in backward.graph.nodes if n.op == "call_function"]
    fw_order = [n.name for n in fw_calls if n.name in jir.node_fx]
    bw_order = [n.name for n in bw_calls if n.name in jir.node_fx]
    out = next(n for n in forward.graph.nodes if n.op == "output")
    saved = {
        jir.fx_value[o.name]
        for o in list(out.args[0])[num_fwd_outputs:]
        if isinstance(o, torch.fx.Node) and o.name in jir.fx_value
    } & model.forward_values
    rng_states = sum(1 for n in bw_calls if "run_with_rng_state" in str(n.target))
    sim = simulate(jir.graph, model.plan_for_orders(fw_order, bw_order, saved))
    eager = simulate(jir.graph, eager_plan(jir.graph))
    fw = set(model.forward)
    simulated = sim.peak_bytes + RNG_STATE_BYTES * rng_states
    return JudgedPartition(
        num_nodes=jir.graph.num_nodes,
        static_bytes=jir.graph.static_bytes,
        eager_peak_bytes=eager.peak_bytes,
        predicted_peak_bytes=simulated,
        simulated_peak_bytes=simulated,
        baseline_time_s=eager.total_time_s,
        predicted_time_s=sim.total_time_s,
        num_saved=len(saved),
        saved_bytes=sum(model.size[v] for v in saved),
        num_recomputed=sum(1 for n in bw_order if n in fw),
        num_fwd_outputs=num_fwd_outputs,
        ir=jir,
    )


class PartitionRecorder(CustomPartitionerFn):
    """A partition function that records the simulator's figures of each partition made."""

    def __init__(
        self, partition_fn: Callable[..., Any] | None = None, *, cost: str = "cpu"
    ) -> None:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.partition_fn = partition_fn or min_cut_rematerialization_partition
        self.cost = cost
        self.judged: list[JudgedPartition] = []

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        kwargs.setdefault("compiler", "inductor")
        calls = _knapsack_calls()
        fw, bw = self.partition_fn(gm, joint_inputs, **kwargs)
        judged = judge(
            gm,
            fw,
            bw,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices") or (),
            cost=self.cost,
        )
        self.judged.append(judged)
        if _knapsack_calls() > calls:
            _check_knapsack(judged.simulated_peak_bytes)
        return fw, bw

    def attach_compiled(self, graphs: Sequence[Any]) -> None:
        """The last partition's peak from inductor's code for it (its forward and backward
        graphs, as :func:`~remat.executor.compile.inductor_memory.capture_graphs` saw them)."""
        last = self.judged[-1]
        if last.ir is None:
            return
        mem = compiled_memory(last.ir, graphs, num_fwd_outputs=last.num_fwd_outputs)
        if mem is not None:
            self.judged[-1] = dataclasses.replace(last, predicted_peak_bytes=mem.peak_bytes)

    def __deepcopy__(self, memo: dict[int, Any]) -> PartitionRecorder:
        return self

    def uuid(self) -> Any | None:
        return None


def _knapsack_calls() -> int:
    from remat.executor.compile.knapsack import RematKnapsack

    solver = torch._functorch.config.activation_memory_budget_solver
    return solver.calls if isinstance(solver, RematKnapsack) else 0


def _check_knapsack(peak_bytes: int) -> None:
    """Torch's min cut decides the saved set after its knapsack: say when it exceeds the
    bytes a :class:`~remat.executor.compile.knapsack.RematKnapsack` was given."""
    from remat.executor.compile.knapsack import RematKnapsack

    solver = torch._functorch.config.activation_memory_budget_solver
    if not isinstance(solver, RematKnapsack) or solver.last_budget_bytes is None:
        return
    if peak_bytes > solver.last_budget_bytes:
        import warnings

        from remat.executor.compile.dynamo import RematCompileWarning
        from remat.ir.budget import format_bytes

        warnings.warn(
            f"RematKnapsack: torch's min cut made a partition of {format_bytes(peak_bytes)}, "
            f"over the knapsack's {format_bytes(solver.last_budget_bytes)} (torch saved other "
            "values than the knapsack chose)",
            RematCompileWarning,
            stacklevel=3,
        )


def torch_backend(recorder: PartitionRecorder, *, compiler: str = "inductor") -> Any:
    """A torch.compile backend with torch's partitioner (its budget settings as they are set
    in ``torch._functorch.config`` when it compiles), whose partitions ``recorder`` judges."""

    def compile_fn(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        if compiler == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            before = len(recorder.judged)
            with (
                capture_graphs() as graphs,
                inductor_config.patch(
                    custom_partitioner_fn=recorder, fx_graph_cache=False, fallback_random=True
                ),
                torch._functorch.config.patch(
                    force_non_lazy_backward_lowering=True, enable_autograd_cache=False
                ),
            ):
                compiled = compile_fx(gm, example_inputs)
            if len(recorder.judged) > before:
                recorder.attach_compiled(graphs)
            return compiled
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        def partition(joint: torch.fx.GraphModule, inputs: Any, **kw: Any) -> Any:
            return recorder(joint, inputs, **kw)

        return aot_autograd(
            fw_compiler=boxed_nop,
            bw_compiler=boxed_nop,
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    return compile_fn
