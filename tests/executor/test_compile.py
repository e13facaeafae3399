"""remat's torch.compile backend on the CPU: gradients, measured peak against the budget and
the prediction, monotone peaks; the partition class on a hand-made graph."""

from __future__ import annotations

import pytest
import torch
from handmade import partition_chain

from examples.models import build_causal_lm, build_gpt
from remat.executor.compile import RematBackend
from remat.executor.compile.dynamo import infeasible_cause
from remat.executor.compile.partition import PartitionModel
from remat.executor.compile.run import compiled_step, eager_reference
from remat.executor.compile.search import search_partition
from remat.ir import InfeasibleBudgetError
from remat.torch_compile import backend

FIVE_BUDGETS = ("100%", "85%", "70%", "60%", "50%")
COST = "h100"
"""A datasheet profile, not the measured CPU one: the node times, and so the plans, are the same
on every run (a CPU profile measured under load changes which partition is fastest at each
budget, and so the peaks compared across budgets). The search's time limit (``LIMIT_S``) is
far above what it needs (under 10 s per graph here), so the deadline never decides a plan."""
LIMIT_S = 600


@pytest.fixture(scope="module")
def gpt():
    model, inputs, loss_fn = build_gpt(batch=2, seq=32, vocab=256, d_model=64, n_layers=2)
    return model, inputs, loss_fn, eager_reference(model, inputs, loss_fn)


def _run(gpt, budget, compiler="aot_eager"):
    model, inputs, loss_fn, ref = gpt
    be = backend(budget, compiler=compiler, solver="greedy", time_limit_s=LIMIT_S, cost=COST)
    run = compiled_step(model, inputs, loss_fn, be, ref)
    (plan,) = be.plans.values()
    return be, plan, run


def test_aot_eager_gpt_five_budgets_exact_and_monotone(gpt):
    peaks = []
    for budget in FIVE_BUDGETS:
        _, plan, run = _run(gpt, budget)
        measured = run.memory.peak_bytes
        # Dropout is replayed in the recomputation: the eager step's gradients, bit for bit.
        assert run.max_grad_diff == 0.0, budget
        assert measured <= plan.budget_bytes, budget
        assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes
        peaks.append(measured)
    assert peaks == sorted(peaks, reverse=True), peaks
    # The lowest budget needed recomputation (the class is exercised, not only "save all"),
    # dropout included: its random numbers were replayed (the gradients above are exact).
    assert plan.num_recomputed > 0
    assert plan.rng_replayed


@pytest.mark.slow
def test_recomputed_dropout_replays_the_random_numbers(gpt):
    _, plan, run = _run(gpt, "55%")
    assert plan.rng_replayed, "expected a recomputed dropout at this budget"
    assert run.max_grad_diff == 0.0


def _inductor_five_budgets(model, inputs, loss_fn, ref):
    """Inductor: the gradients within float tolerance (its kernels sum in another order; the
    random numbers are eager's), the measured peak within the budget, within 5% of the
    prediction (inductor's generated code replayed), monotone over five budgets."""
    peaks = []
    for budget in FIVE_BUDGETS:
        be = backend(budget, compiler="inductor", solver="greedy", time_limit_s=LIMIT_S, cost=COST)
        run = compiled_step(model, inputs, loss_fn, be, ref)
        (plan,) = be.plans.values()
        measured = run.memory.peak_bytes
        error = measured / plan.predicted_peak_bytes - 1
        print(
            f"inductor {budget}: measured {measured} predicted {plan.predicted_peak_bytes} "
            f"({error:+.2%}) simulated on the FX graphs {plan.simulated_peak_bytes} "
            f"budget {plan.budget_bytes} grad diff {run.max_grad_diff:.2g}"
        )
        assert plan.compiled is not None, budget
        assert run.max_grad_diff < 1e-4, budget
        assert measured <= plan.budget_bytes, budget
        assert abs(error) <= 0.05, (budget, measured, plan.predicted_peak_bytes)
        # Fusion never allocates more than the FX graphs' simulation, on these models.
        assert plan.predicted_peak_bytes <= plan.simulated_peak_bytes, budget
        assert be.check()
        peaks.append(measured)
    assert peaks == sorted(peaks, reverse=True), peaks


@pytest.mark.slow
def test_inductor_gpt_five_budgets_within_budget_prediction_and_monotone(gpt):
    _inductor_five_budgets(*gpt)


@pytest.mark.slow
def test_inductor_transformers_gpt2_five_budgets():
    pytest.importorskip("transformers")
    model, ids = _gpt2()
    _inductor_five_budgets(model, (ids,), _identity, eager_reference(model, (ids,), _identity))


@pytest.mark.slow
def test_infeasible_budget_names_the_smallest(gpt):
    model, inputs, loss_fn, ref = gpt
    be = backend(1000, compiler="aot_eager", solver="greedy", time_limit_s=5)
    with pytest.raises(Exception) as info:
        compiled_step(model, inputs, loss_fn, be, ref)
    inner = infeasible_cause(info.value)
    assert isinstance(inner, InfeasibleBudgetError)
    assert inner.min_budget_bytes and inner.min_budget_bytes > 1000


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"budget": "lots"}, "budget"),
        ({"budget": "50%", "solver": "nope"}, "solver"),
        ({"budget": "50%", "time_limit_s": 0}, "time_limit_s"),
        ({"budget": "50%", "compiler": "tvm"}, "compiler"),
    ],
)
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        backend(**kwargs)


@pytest.mark.slow
def test_auto_seed_and_short_form(gpt):
    """remat.compile with the default solver: the seed plan is used, the plan fits."""
    import remat

    model, inputs, loss_fn, ref = gpt
    step = remat.compile(
        lambda *x: loss_fn(model(*x)), "60%", compiler="aot_eager", time_limit_s=10
    )
    be = step.remat_backend
    assert isinstance(be, RematBackend) and be.seed is not None
    run = compiled_step(model, inputs, loss_fn, be, ref)
    (plan,) = be.plans.values()
    assert run.max_grad_diff == 0.0
    assert run.memory.peak_bytes <= plan.budget_bytes


class _TwoGraphs(torch.nn.Module):
    """Two blocks with a graph break between them: two joint graphs in one step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
        )
        self.b = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h).sum()


@pytest.mark.slow
def test_graph_breaks_share_one_budget_in_bytes():
    model = _TwoGraphs()
    x = torch.randn(512, 64)
    inputs = (x,)
    ref = eager_reference(model, inputs, lambda out: out)
    budget = ref.memory.peak_bytes
    be = backend(budget, compiler="aot_eager", solver="greedy", time_limit_s=10)
    run = compiled_step(model, inputs, lambda out: out, be, ref)
    plans = sorted(be.plans.values(), key=lambda p: p.index)
    assert len(plans) == 2
    first, second = plans
    # The second graph is planned under what the first leaves while it runs.
    assert second.budget_bytes == budget - first.static_bytes - first.saved_bytes
    assert be.check() and be.predicted_peak_bytes <= budget
    assert run.memory.peak_bytes == be.predicted_peak_bytes
    assert run.max_grad_diff == 0.0
    # Less: the first graph takes the fastest plan within the budget, the second cannot fit in
    # what it leaves; the error says so.
    tight = backend(int(budget * 0.97), compiler="aot_eager", solver="greedy", time_limit_s=10)
    with pytest.raises(Exception, match="held by the graphs compiled before it"):
        compiled_step(model, inputs, lambda out: out, tight, ref)


# -- the class on a hand-made graph -------------------------------------------------------------


def test_partition_recomputes_what_is_not_saved():
    model = PartitionModel(partition_chain())
    assert model.read_by_backward == ["a", "b", "d"]
    part = model.partition({"a", "d"})
    assert part.recomputed == ("fb",)
    assert part.backward_order == ("bd", "fb", "bb", "ba")
    full = model.partition({"a", "b", "d"})
    assert full.recomputed == ()
    # Saving all: a, b, d, the loss and d's gradient at the first backward op (324 bytes with
    # the input); recomputing b: the forward's a, b, d at fd (310 bytes) is the peak.
    assert (full.peak_bytes, part.peak_bytes) == (324, 310)
    assert part.total_time_s == pytest.approx(full.total_time_s + 1.0)


def test_search_prefers_recomputing_the_cheap_value():
    model = PartitionModel(partition_chain())
    full = model.partition({"a", "b", "d"})
    best, _ = search_partition(model, full.peak_bytes - 1, time_limit_s=5)
    assert best.peak_bytes <= full.peak_bytes - 1
    assert "a" in best.saved  # recompute b or d (1 s), never a (10 s)
    assert best.total_time_s == pytest.approx(full.total_time_s + 1.0)


# -- the knapsack hook and torch's partitioner ---------------------------------------------------


def test_knapsack_uuid_is_stable_and_names_its_settings():
    from remat.executor.compile import RematKnapsack

    assert RematKnapsack("8GiB").uuid() == RematKnapsack("8GiB").uuid()
    assert RematKnapsack("8GiB").uuid() != RematKnapsack("4GiB").uuid()
    with pytest.raises(ValueError, match="budget"):
        RematKnapsack("lots")


@pytest.mark.slow
def test_knapsack_in_torchs_partitioner_judged_by_the_simulator(gpt):
    from remat.executor.compile import RematKnapsack
    from remat.executor.compile.evaluate import PartitionRecorder, torch_backend

    model, inputs, loss_fn, ref = gpt
    knapsack = RematKnapsack("60%", time_limit_s=10)
    recorder = PartitionRecorder()
    with torch._functorch.config.patch(
        activation_memory_budget=0.5, activation_memory_budget_solver=knapsack
    ):
        run = compiled_step(
            model, inputs, loss_fn, torch_backend(recorder, compiler="aot_eager"), ref
        )
    (judged,) = recorder.judged
    assert knapsack.last_budget_bytes is not None
    assert run.memory.peak_bytes <= judged.eager_peak_bytes
    # The knapsack judged its choice by the min cut torch then ran for it: the partition torch
    # made is the one the knapsack predicted, and it fits the knapsack's bytes.
    assert judged.simulated_peak_bytes == knapsack.last_predicted_peak_bytes
    assert judged.simulated_peak_bytes <= knapsack.last_budget_bytes
    # The simulator on the partition torch made predicts what the step measures.
    assert abs(run.memory.peak_bytes - judged.predicted_peak_bytes) <= 0.05 * run.memory.peak_bytes


@pytest.mark.slow
def test_knapsack_over_its_bytes_says_so(gpt):
    """Torch's min cut decides after the knapsack: with bytes nothing fits, the knapsack says
    so, and the recorder says the partition torch made is over them."""
    from remat.executor.compile import RematCompileWarning, RematKnapsack
    from remat.executor.compile.evaluate import PartitionRecorder, torch_backend

    model, inputs, loss_fn, ref = gpt
    knapsack = RematKnapsack(1000, time_limit_s=5)
    recorder = PartitionRecorder()
    with (
        pytest.warns(RematCompileWarning) as got,
        torch._functorch.config.patch(
            activation_memory_budget=0.01, activation_memory_budget_solver=knapsack
        ),
    ):
        compiled_step(model, inputs, loss_fn, torch_backend(recorder, compiler="aot_eager"), ref)
    messages = [str(w.message) for w in got if issubclass(w.category, RematCompileWarning)]
    assert knapsack.calls == 1
    assert any("no choice among torch's" in m for m in messages), messages
    assert any("torch's min cut made a partition" in m for m in messages), messages


def _gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    """transformers' GPT-2 (2 layers, hidden 64, vocabulary 512) with the user's own next-token
    loss, and a batch of 2 x 32 tokens."""
    model, (ids,), _ = build_causal_lm("gpt2", batch=2, seq=32, vocab=512, hidden=64, positions=64)
    return model, ids


def _identity(loss: torch.Tensor) -> torch.Tensor:
    return loss


@pytest.mark.slow
def test_transformers_gpt2_five_budgets_exact_and_monotone():
    pytest.importorskip("transformers")
    model, ids = _gpt2()
    ref = eager_reference(model, (ids,), lambda loss: loss)
    peaks = []
    for budget in FIVE_BUDGETS:
        be = backend(budget, compiler="aot_eager", solver="greedy", time_limit_s=LIMIT_S, cost=COST)
        run = compiled_step(model, (ids,), lambda loss: loss, be, ref)
        (plan,) = be.plans.values()
        assert run.max_grad_diff == 0.0, budget
        assert run.memory.peak_bytes <= plan.budget_bytes, budget
        assert abs(run.memory.peak_bytes - plan.predicted_peak_bytes) <= (
            0.05 * plan.predicted_peak_bytes
        )
        peaks.append(run.memory.peak_bytes)
    assert peaks == sorted(peaks, reverse=True), peaks


# -- the search's own judge and the search on a synthetic transformer ----------------------------


def test_figures_equal_the_simulator_on_random_saved_sets():
    import random

    from remat.ir import synthetic

    model = PartitionModel(synthetic.transformer(2), rng_state_bytes=5000)
    rnd = random.Random(0)
    for _ in range(30):
        p = rnd.random()
        saved = {v for v in model.candidates if rnd.random() < p}
        fig, part = model.figures(saved), model.partition(saved)
        assert (fig.peak_bytes, fig.saved, fig.recomputed) == (
            part.peak_bytes,
            part.saved,
            part.recomputed,
        )
        assert fig.total_time_s == pytest.approx(part.total_time_s, rel=1e-12)
        dynamic = model.static | model.inputs
        assert fig.live_at_peak - dynamic == model.live_at_peak(part) - dynamic


def test_search_fits_a_falling_budget_with_rising_time():
    from remat.ir import synthetic

    model = PartitionModel(synthetic.transformer(2))
    full = model.figures(model.read_by_backward)
    static = model.graph.static_bytes
    times = []
    for share in (0.95, 0.85, 0.7):
        budget = static + int(share * (full.peak_bytes - static))
        best, _ = search_partition(model, budget, time_limit_s=20)
        assert best.peak_bytes <= budget, share
        times.append(best.total_time_s)
    assert times == sorted(times), times
    assert times[0] > full.total_time_s


def test_floor_bounds_every_saved_set_from_below():
    """The proven floor: the chain's forward with nothing saved holds x, a, b at fb (210
    bytes); no backward op needs more. Every saved set of a synthetic transformer, and the
    search's lowest, stay at or above it."""
    import random

    from remat.ir import synthetic

    assert PartitionModel(partition_chain()).floor_bytes() == 210
    model = PartitionModel(synthetic.transformer(2))
    floor = model.floor_bytes()
    assert floor > model.graph.static_bytes
    rnd = random.Random(1)
    for _ in range(30):
        saved = {v for v in model.candidates if rnd.random() < rnd.random()}
        assert model.figures(saved).peak_bytes >= floor
    _, lowest = search_partition(model, 0, time_limit_s=5)
    assert floor <= lowest.peak_bytes


def test_replay_counts_each_storage_once_until_its_last_name_goes():
    """The replay of inductor's wrapper lines: a reuse renames a storage, a view keeps its
    base alive, a storage outside the counted set never counts."""
    from remat.executor.compile.inductor_memory import _Replay

    r = _Replay()
    r.new("buf0", 100)
    r.new("buf1", 50)
    r.bind("buf2", r.names["buf0"])  # buf2 = buf0; del buf0  (reuse)
    r.drop("buf0")
    r.new("buf3", 30)  # peak: 180
    r.bind("view", r.names["buf3"])  # a reinterpreted view of buf3
    r.drop("buf3")  # still alive through the view
    r.drop("buf1")
    r.new("buf4", 60)  # 100 + 30 + 60 = 190
    r.drop("view")
    r.drop("buf2")
    assert r.peak(set(r.sizes), 0) == 190
    assert r.peak(set(r.sizes) - {r.names["buf4"]}, 5) == 185
    assert [alloc for alloc, _ in r.events] == [True, True, True, False, True, False, False]
