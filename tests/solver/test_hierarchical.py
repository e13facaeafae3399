"""``hierarchical``: blocks solved exactly once per distinct block, rotor's DP across them.

Against the exhaustive oracle on random small steps (never below the optimum, always within
its budget), against rotor (never worse: rotor's class is contained), and the block machinery
on its own (identical blocks share one solve, each frontier trades bytes for time)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _graphs import random_step
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle

from remat import solver
from remat.ir import Graph, eager_plan, simulate
from remat.ir.chain import chain_view
from remat.ir.synthetic import chain, transformer, unet
from remat.solver.blocks import (
    CAP_FRACTIONS,
    BlockOption,
    _block_of,
    _by_milp,
    _enumerated,
    boundary_keep_plan,
    stage_options,
)

FRACS = st.sampled_from([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])


def frac_budget(g: Graph, frac: float) -> int:
    return g.static_bytes + int(frac * simulate(g, eager_plan(g)).peak_dynamic_bytes)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), ops=st.integers(2, 4), frac=FRACS)
def test_never_below_the_oracle_and_always_within_budget(seed: int, ops: int, frac: float) -> None:
    g = random_step(seed, ops)
    b = frac_budget(g, frac)
    # the oracle searches recompute-only plans: offloading (on by default here) is left out
    r = solver.get("hierarchical")(g, b, time_limit_s=20, offload=False)
    o = oracle(g, b, ordered=False)
    if r.status in ("optimal", "feasible"):
        assert r.plan is not None
        sim = simulate(g, r.plan)
        assert sim.peak_bytes <= b
        assert o is not None  # a plan fits, so the oracle finds one
        assert sim.total_time_s >= o.time_s * (1 - 1e-9)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), stages=st.integers(2, 6), frac=FRACS)
def test_never_worse_than_rotor_on_chains(seed: int, stages: int, frac: float) -> None:
    g = chain(stages, heterogeneous=True, seed=seed, batch_size=4, width=16)
    b = frac_budget(g, frac)
    rot = solver.get("rotor")(g, b)
    h = solver.get("hierarchical")(g, b)
    if rot.status == "feasible":
        assert h.status == "feasible"
        assert (h.total_time_s or 0) <= (rot.total_time_s or 0) * (1 + 1e-9)


@pytest.mark.parametrize("frac", [0.7, 0.5, 0.3])
def test_beats_rotor_on_a_transformer(frac: float) -> None:
    g = transformer(6)
    b = frac_budget(g, frac)
    rot = solver.get("rotor")(g, b)
    h = solver.get("hierarchical")(g, b, time_limit_s=20)
    if rot.status == "feasible":
        assert h.status == "feasible" and h.plan is not None
        assert simulate(g, h.plan).peak_bytes <= b
        assert (h.total_time_s or 0) <= (rot.total_time_s or 0)
        if frac == 0.5:  # partial saves pay off: strictly faster than rotor here
            assert (h.total_time_s or 0) < (rot.total_time_s or 0) * 0.97


def test_identical_blocks_are_solved_once() -> None:
    g = transformer(6)
    ch = chain_view(g, cuts="blocks")
    so = stage_options(g, ch.stages)
    assert so.complete and len(so.options) == ch.num_stages
    assert so.distinct_blocks <= ch.num_stages - 5  # six identical layers: one solve
    # the layers' frontiers are the same, and each trades kept bytes for extra time
    sizes = [len(st.forward_nodes) for st in ch.stages]
    layers = [o for o, n in zip(so.options, sizes, strict=True) if n == max(sizes)]
    assert len(layers) == 6 and all(o == layers[0] for o in layers)
    front = layers[0]
    assert len(front) >= 3
    keeps = [o.keep_bytes for o in front]
    extras = [o.extra_time_s for o in front]
    assert keeps == sorted(keeps) and extras == sorted(extras, reverse=True)
    assert all(o.drop_bytes > 0 and o.rerun for o in front)


def test_boundary_keep_plan_fits_or_says_none() -> None:
    g = transformer(4)
    for frac in (0.7, 0.3, 0.0):
        b = frac_budget(g, frac)
        plan = boundary_keep_plan(g, b)
        if plan is not None:
            assert simulate(g, plan).peak_bytes <= b
    assert boundary_keep_plan(g, 0) is None


def test_listed_with_its_options() -> None:
    assert "hierarchical" in solver.available()
    si = solver.info("hierarchical")
    assert si.kind == "dag" and "mem_slots" in si.options
    with pytest.raises(ValueError, match="mem_slots"):
        solver.get("hierarchical")(transformer(1), 10**12, mem_slots=0)


def test_op_names_outside_ascii() -> None:
    # networkx hashes block labels as ASCII; an op named "aten.rélu" (or any name a client
    # sends) made hierarchical raise UnicodeEncodeError, which the service showed as a 422 on
    # "options". Found by schemathesis.
    g = transformer(3)
    renamed = Graph.model_validate(
        {
            **g.model_dump(mode="json"),
            "nodes": [{**n.model_dump(mode="json"), "op": n.op + "ü"} for n in g.nodes],
        }
    )
    so = stage_options(renamed, chain_view(renamed, cuts="blocks").stages)
    assert so.complete
    r = solver.get("hierarchical")(renamed, frac_budget(renamed, 0.6), time_limit_s=20)
    assert r.status in ("optimal", "feasible")


def test_stops_trying_block_sizes_once_good_enough() -> None:
    from remat.solver.problem import Problem

    g = transformer(6)
    b = frac_budget(g, 0.5)
    phases: list[str] = []
    p = Problem.build(g, b, on_progress=lambda pr: phases.append(pr.phase))
    quick = solver.info("hierarchical").run(p, good_enough_s=float("inf"))
    # rotor's plan fits, so no block size is tried
    assert quick.fits and not any(ph.startswith("blocks of") for ph in phases)
    phases.clear()
    full = solver.info("hierarchical").run(p)
    assert sum(ph.startswith("blocks of") for ph in phases) >= 3
    assert full.fits and (full.total_time_s or 0) < (quick.total_time_s or 0)


def _best_within(options: tuple[BlockOption, ...], cap: float) -> float:
    return min([o.extra_time_s for o in options if o.keep_bytes <= cap], default=-1.0)


def _compare_block_options(g: Graph, every: int = 1) -> int:
    """Each block's options without a MILP against its MILP, cap by cap; the blocks compared."""
    static = {v.id for v in g.values if g.is_static(v.id)}
    compared = 0
    for stage in chain_view(g, cuts="blocks", every=every).stages:
        block = _block_of(g, stage, static)
        saved = [i for i, (_, _, s) in enumerate(block.values) if s]
        total = sum(block.values[i][1] for i in saved)
        if not saved or total == 0:
            continue
        fast = _enumerated(block, saved, total)
        if fast is None:  # dependent reruns of a large block: the MILP alone answers
            continue
        by_milp = _by_milp(block, saved, total, None)
        for frac in CAP_FRACTIONS:
            a = _best_within(tuple(fast.values()), frac * total)
            b = _best_within(tuple(by_milp.values()), frac * total)
            assert a == pytest.approx(b, rel=1e-9, abs=1e-15), (stage, frac, a, b)
        compared += 1
    return compared


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), ops=st.integers(2, 6))
def test_enumerated_block_options_are_the_milps(seed: int, ops: int) -> None:
    # small blocks are enumerated (every set of nodes run again) instead of solved by one
    # MILP per cap: at each cap the fastest option within it is the MILP's optimum
    _compare_block_options(random_step(seed, ops))


@pytest.mark.parametrize(
    ("build", "every"),
    [
        (lambda: unet(2, image_size=32, batch_size=1), 1),
        (lambda: chain(6, heterogeneous=True, seed=3), 1),
        # eight stages a block: 16 nodes may run again, none needing another: the Pareto DP
        (lambda: chain(24, heterogeneous=True, seed=5), 8),
    ],
)
def test_block_options_without_milp_match_it(build: Callable[[], Graph], every: int) -> None:
    assert _compare_block_options(build(), every) >= 1
