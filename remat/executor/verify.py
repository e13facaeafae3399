"""``remat.verify``: run a plan for real and compare it with what the simulator promised.

One call runs the unmodified model and the plan (op-level by default, ``executor="module"`` for
:func:`remat.apply`) from the same parameters, buffers and random state, on copies of the model
(the model passed in is not modified), and reports

* predicted vs measured peak bytes, static and dynamic (``remat.executor.measure`` definitions:
  exact on the CPU, allocator statistics on a GPU), and the host bytes of offloaded copies;
* the gradients' largest absolute difference from the unmodified model's (0.0 and
  ``grads_bitwise_equal`` when every gradient matches bit for bit);
* the step-time ratio (median of ``repeats`` steps, remat over eager) next to the predicted one.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.executor.measure import measure
from remat.executor.opexec import ExecutorError, capture_for, compile_step, plan_to_run
from remat.ir import Graph, Plan, PlanFigures, SolveResult, eager_plan, simulate
from remat.ir.budget import format_bytes

LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class VerifyReport:
    """Predicted vs measured figures of one plan on one model."""

    executor: str
    solver: str
    status: str
    budget_bytes: int | None
    predicted: PlanFigures
    """The simulator's figures for the plan on this device (on the CPU with a free host link:
    offloads there are plain copies that finish at once)."""
    measured_peak_bytes: int
    measured_static_bytes: int
    measured_dynamic_bytes: int
    eager_peak_bytes: int
    """The plain eager step (the unmodified model, ``loss.backward()``), measured."""
    eager_dynamic_bytes: int
    predicted_host_bytes: int
    measured_host_bytes: int
    grad_max_abs_diff: float
    grads_bitwise_equal: bool
    loss_abs_diff: float
    predicted_time_ratio: float | None
    """Simulated step time over the simulated eager step time."""
    measured_time_ratio: float | None
    """Median remat step time over median eager step time (None when not timed)."""
    remat_step_s: float | None
    eager_step_s: float | None
    eager_predicted_dynamic_bytes: int = 0
    """The eager (``none``) plan's simulated dynamic peak: what remat takes the plain eager
    step to need (the base of percentage budgets)."""

    @property
    def eager_error(self) -> float:
        """Plain eager measured against the eager plan's prediction, relative to the latter."""
        if self.eager_predicted_dynamic_bytes == 0:
            return 0.0 if self.eager_dynamic_bytes == 0 else math.inf
        return self.eager_dynamic_bytes / self.eager_predicted_dynamic_bytes - 1.0

    @property
    def eager_mismatch(self) -> bool:
        """The plain eager step differs from the eager plan's prediction by more than 1%."""
        return abs(self.eager_error) > 0.01

    @property
    def predicted_peak_bytes(self) -> int:
        return self.predicted.peak_bytes

    @property
    def predicted_static_bytes(self) -> int:
        return self.predicted.static_bytes

    @property
    def predicted_dynamic_bytes(self) -> int:
        return self.predicted.peak_dynamic_bytes

    @property
    def dynamic_error(self) -> float:
        """Relative error of the measured dynamic peak against the predicted one."""
        if self.predicted_dynamic_bytes == 0:
            return 0.0 if self.measured_dynamic_bytes == 0 else math.inf
        return self.measured_dynamic_bytes / self.predicted_dynamic_bytes - 1.0

    @property
    def within_budget(self) -> bool:
        return self.budget_bytes is None or self.measured_peak_bytes <= self.budget_bytes

    def ok(self, tolerance: float = 0.05) -> bool:
        """Bit-exact gradients and a measured dynamic peak within ``tolerance`` of the plan's."""
        return self.grads_bitwise_equal and abs(self.dynamic_error) <= tolerance

    def __str__(self) -> str:
        def fb(n: int) -> str:
            return format_bytes(n)

        lines = [
            f"plan: {self.solver} ({self.status}), {self.executor}-level executor",
            f"  peak     predicted {fb(self.predicted_peak_bytes):>12}   measured "
            f"{fb(self.measured_peak_bytes):>12}   eager {fb(self.eager_peak_bytes)}",
            f"  dynamic  predicted {fb(self.predicted_dynamic_bytes):>12}   measured "
            f"{fb(self.measured_dynamic_bytes):>12}   ({self.dynamic_error:+.2%})",
            f"  static   predicted {fb(self.predicted_static_bytes):>12}   measured "
            f"{fb(self.measured_static_bytes):>12}",
            f"  eager    plain eager measured {fb(self.eager_dynamic_bytes)}, eager plan "
            f"predicted {fb(self.eager_predicted_dynamic_bytes)} ({self.eager_error:+.2%}), "
            f"plan measured {fb(self.measured_dynamic_bytes)}"
            + ("   EAGER MISMATCH (> 1%)" if self.eager_mismatch else ""),
        ]
        if self.budget_bytes is not None:
            lines.append(
                f"  budget   {fb(self.budget_bytes):>12}   "
                + ("measured peak within it" if self.within_budget else "EXCEEDED")
            )
        if self.predicted_host_bytes or self.measured_host_bytes:
            lines.append(
                f"  host     predicted {fb(self.predicted_host_bytes):>12}   measured "
                f"{fb(self.measured_host_bytes):>12}"
            )
        lines.append(
            f"  grads    max |diff| {self.grad_max_abs_diff:.3g}"
            + ("  (bit for bit equal)" if self.grads_bitwise_equal else "  (NOT bit-exact)")
        )
        if self.measured_time_ratio is not None:
            pred = (
                f"{self.predicted_time_ratio:.2f}x"
                if self.predicted_time_ratio is not None
                else "?"
            )
            lines.append(
                f"  time     predicted {pred} of eager   measured {self.measured_time_ratio:.2f}x "
                f"({self.remat_step_s * 1e3:.1f} ms vs {self.eager_step_s * 1e3:.1f} ms)"
                if self.remat_step_s is not None and self.eager_step_s is not None
                else ""
            )
        return "\n".join(lines)


def _forward(model: nn.Module, inputs: Any) -> Any:
    """``model`` called on example inputs as the tracer reads them (tensor, tuple/list, dict)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _eager_step(
    model: nn.Module, inputs: Any, loss_fn: LossFn | None
) -> Callable[[], torch.Tensor]:
    """``loss.backward()`` of the plain model; returns the detached loss."""

    def step() -> torch.Tensor:
        out = _forward(model, inputs)
        loss = loss_fn(out) if loss_fn is not None else out
        del out
        loss.backward()
        return loss.detach()

    return step


def _interleaved_step_s(
    runs: list[tuple[Callable[[], Any], nn.Module]], repeats: int, seed: int
) -> list[float]:
    """Median seconds of each step, timed in turns (eager, remat, eager, ...) after one warm-up
    round, so that load from other processes hits both alike."""
    device = next(runs[0][1].parameters()).device
    samples: list[list[float]] = [[] for _ in runs]
    for r in range(repeats + 1):
        for k, (run, model) in enumerate(runs):
            for p in model.parameters():
                p.grad = None
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                t0 = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if r:
                    samples[k].append(time.perf_counter() - t0)
    return [statistics.median(s) for s in samples]


def verify(
    model: nn.Module,
    inputs: Any,
    loss_fn: LossFn | None,
    result: SolveResult | Plan,
    *,
    executor: str = "op",
    capture: Any = None,
    seed: int = 0,
    repeats: int = 3,
) -> VerifyReport:
    """Run ``result``'s plan on copies of ``model`` and compare with the prediction.

    Parameters
    ----------
    model, inputs, loss_fn
        The model and step the plan was solved for (as given to :func:`remat.trace`).
    result
        A :class:`~remat.ir.SolveResult` (or a bare :class:`~remat.ir.Plan`).
    executor
        ``"op"`` (:func:`remat.compile_step`, the closed step), ``"apply"``
        (:func:`remat.apply`: the plan op by op inside autograd) or ``"checkpoint"`` (also
        ``"module"``: ``remat.apply(..., mode="checkpoint")``, ``torch.utils.checkpoint``
        regions and saved-tensor hooks).
    capture
        A capture of this step, to skip capturing again.
    seed
        Both runs start from ``torch.manual_seed(seed)`` (dropout draws the same numbers).
    repeats
        Steps timed for the time ratio (0: no timing).

    Returns
    -------
    VerifyReport
        ``str(report)`` is a short table; ``report.ok()`` checks bit-exact gradients and a
        dynamic peak within 5% of the prediction.
    """
    if executor not in ("op", "apply", "checkpoint", "module"):
        raise ValueError(
            f"executor must be 'op', 'apply' or 'checkpoint' ('module'), got {executor!r}"
        )
    plan = plan_to_run(result)
    if capture is None:
        capture = capture_for(model, inputs, loss_fn, plan=plan)
    if getattr(capture, "output", None) is not None:
        raise ExecutorError(
            "verify runs a step that owns its loss, and this model returns an output without "
            "one: pass the loss_fn your loop computes (its step then ends at the loss)"
        )
    graph: Graph = capture.graph
    device = next(model.parameters()).device
    # Offloads on the CPU are plain copies that finish at once: predict with a free host link.
    bandwidth = math.inf if device.type == "cpu" else None
    sim = simulate(graph, plan, host_bandwidth_bytes_per_s=bandwidth)
    eager_sim = simulate(graph, eager_plan(graph))
    rng_devices = [device] if device.type == "cuda" else []

    losses: dict[str, torch.Tensor] = {}

    def keeping_loss(key: str, run: Callable[[], Any]) -> Callable[[], None]:
        def step() -> None:
            losses[key] = run()

        return step

    ref = copy.deepcopy(model)
    ref_step = _eager_step(ref, inputs, loss_fn)
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        ref_mem = measure(ref, inputs, loss_fn, step=keeping_loss("eager", ref_step))
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    run_model = copy.deepcopy(model)
    host: Any
    if executor == "op":
        step = compile_step(run_model, inputs, loss_fn, plan, capture=capture)
        run: Callable[[], Any] = step
        host = step.host
    elif executor == "apply":
        from remat.executor.autograd import apply, planned_steps

        apply(
            run_model, result, graph, example_inputs=inputs, loss_fn=loss_fn, allow_over_budget=True
        )  # verify measures and reports whether the step stayed within the budget
        run = _eager_step(run_model, inputs, None)  # forward returns the loss
        host = planned_steps(run_model)[0].host
    else:
        from remat.executor.module import applied_plan, apply_checkpoint

        apply_checkpoint(run_model, result, graph)
        run = _eager_step(run_model, inputs, loss_fn)
        host = None
        blocks_host = applied_plan(run_model).hosts  # type: ignore[union-attr]
    if host is not None:
        host.reset_peak()
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        mem = measure(run_model, inputs, loss_fn, step=keeping_loss("remat", run))
    if host is not None:
        host_peak = host.peak_bytes
    elif executor == "checkpoint":  # offloaded blocks: their host memory, made at first use
        host_peak = sum(h.peak_bytes for h in blocks_host.values())
    else:
        host_peak = 0
    loss, ref_loss = losses.get("remat"), losses.get("eager")
    diff, equal = _grad_diff(ref_grads, dict(run_model.named_parameters()))
    loss_diff = (
        float((loss.detach() - ref_loss.detach()).abs().max())
        if loss is not None and ref_loss is not None
        else math.nan
    )

    remat_s = eager_s = None
    if repeats > 0:
        eager_s, remat_s = _interleaved_step_s([(ref_step, ref), (run, run_model)], repeats, seed)
    if isinstance(result, Plan):
        solver, status, budget = "plan", "", None
        baseline, total = eager_sim.total_time_s, sim.total_time_s
    else:
        solver, status, budget = result.solver, result.status, result.budget_bytes
        baseline = result.baseline_time_s or eager_sim.total_time_s
        total = sim.total_time_s if result.total_time_s is None else result.total_time_s
    return VerifyReport(
        executor=executor,
        solver=solver,
        status=status,
        budget_bytes=budget,
        predicted=PlanFigures.of(sim),
        measured_peak_bytes=mem.peak_bytes,
        measured_static_bytes=mem.static_bytes,
        measured_dynamic_bytes=mem.peak_dynamic_bytes,
        eager_peak_bytes=ref_mem.peak_bytes,
        eager_dynamic_bytes=ref_mem.peak_dynamic_bytes,
        eager_predicted_dynamic_bytes=eager_sim.peak_dynamic_bytes,
        predicted_host_bytes=_host_bytes(graph, plan),
        measured_host_bytes=host_peak,
        grad_max_abs_diff=diff,
        grads_bitwise_equal=equal,
        loss_abs_diff=loss_diff,
        predicted_time_ratio=(total / baseline) if baseline else None,
        measured_time_ratio=(remat_s / eager_s) if remat_s and eager_s else None,
        remat_step_s=remat_s,
        eager_step_s=eager_s,
    )


def _grad_diff(
    ref: dict[str, torch.Tensor | None], params: dict[str, torch.Tensor]
) -> tuple[float, bool]:
    worst = 0.0
    equal = True
    for name, g_ref in ref.items():
        g = params[name].grad
        if g_ref is None or g is None:
            if (g_ref is None) != (g is None):
                equal = False
                worst = math.inf
            continue
        if not torch.equal(g_ref, g):
            equal = False
        worst = max(worst, float((g_ref - g).abs().max()) if g.numel() else 0.0)
    return worst, equal


def _host_bytes(graph: Graph, plan: Any) -> int:
    """Peak bytes of host copies the plan holds (a copy lives from its offload to its last
    prefetch; a value offloaded and never prefetched keeps it to the end)."""
    sizes = {v.id: v.size_bytes for v in graph.values}
    last_prefetch: dict[str, int] = {}
    for i, s in enumerate(plan.steps):
        if s.op == "prefetch":
            last_prefetch[s.id] = i
    live: set[str] = set()
    cur = peak = 0
    for i, s in enumerate(plan.steps):
        if s.op == "offload" and s.id not in live and last_prefetch.get(s.id, -1) > i:
            live.add(s.id)
            cur += sizes[s.id]
            peak = max(peak, cur)
        elif s.op == "prefetch" and last_prefetch.get(s.id) == i and s.id in live:
            live.discard(s.id)
            cur -= sizes[s.id]
    return peak


__all__ = ["ExecutorError", "VerifyReport", "verify"]
