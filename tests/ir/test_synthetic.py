"""The synthetic families are whole training steps: forward, loss, derived backward."""

from __future__ import annotations

import pytest

from remat.ir import Graph, eager_plan, simulate
from remat.ir.synthetic import FAMILIES, chain, random_layered_dag, transformer, unet

SMALL = {
    "chain": lambda: chain(4, batch_size=2, width=8),
    "het-chain": lambda: chain(6, heterogeneous=True, batch_size=2, width=8, seed=3),
    "transformer": lambda: transformer(2, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2),
    "unet": lambda: unet(2, base_channels=4, image_size=8, batch_size=1),
    "random-dag": lambda: random_layered_dag(30, seed=5, batch_size=4, max_width=64),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SMALL))
def test_family_is_a_training_step(name: str) -> None:
    g = SMALL[name]()
    assert g.forward_nodes and g.backward_nodes
    params = [v for v in g.values if v.kind == "param"]
    grads = [r for r in g.required if g.value(r).kind == "gradient"]
    assert len(grads) == len(params)  # one gradient per parameter
    assert sum(1 for r in g.required if g.value(r).kind == "loss") == 1
    param_bytes = sum(v.size_bytes for v in params)
    buffers = sum(v.size_bytes for v in g.values if v.kind == "buffer" and v.producer is None)
    assert g.static_bytes == 2 * param_bytes + buffers
    # Every backward node has a forward counterpart's module, every forward value is read.
    for v in g.values:
        p = g.producer_of(v.id)
        if p is not None and p.phase == "forward" and v.kind == "activation":
            assert g.consumers_of(v.id) or v.kind == "buffer", v.id
    sim = simulate(g, eager_plan(g))
    assert sim.total_time_s == pytest.approx(sum(n.time_s for n in g.nodes))
    assert Graph.from_json(g.to_json()) == g


def test_chain_sizes_are_exact() -> None:
    g = chain(4, batch_size=2, width=8)
    # 4 weights of 8x8 float32 = 256 B, doubled for their gradients.
    assert g.static_bytes == 2 * 4 * 256
    assert {v.size_bytes for v in g.values if v.kind == "activation"} == {64}
    assert len(g.forward_nodes) == 2 * 4 + 1  # mm + gelu per stage, and the loss
    # Eager keeps, at the end of the forward pass, x (held) plus 2 saved values per stage.
    sim = simulate(g, eager_plan(g))
    assert sim.peak_dynamic_bytes >= 64 * (1 + 2 * 4)


def test_unet_batch_norm_updates_are_side_effects() -> None:
    g = unet(1, base_channels=4, image_size=4, batch_size=1)
    updates = [n for n in g.nodes if n.op == "aten.running_stats_update"]
    assert updates and all(not n.recomputable for n in updates)
    assert all(g.is_static(o) for n in updates for o in n.outputs)


def test_transformer_marks_dropout_as_rng() -> None:
    g = transformer(1, d_model=16, seq_len=4, batch_size=1, vocab_size=32, num_heads=2)
    rng = [n for n in g.nodes if n.rng]
    assert len(rng) == 3  # embedding, attention and MLP dropout
    assert all(n.phase == "forward" for n in rng)
    no_drop = transformer(
        1, d_model=16, seq_len=4, batch_size=1, vocab_size=32, num_heads=2, dropout=False
    )
    assert not any(n.rng for n in no_drop.nodes)


def test_random_dag_is_deterministic_per_seed() -> None:
    a = random_layered_dag(40, seed=7)
    assert a == random_layered_dag(40, seed=7)
    assert a != random_layered_dag(40, seed=8)
    assert len(a.forward_nodes) == 41  # 40 ops and the loss


def test_standard_families_build() -> None:
    for name, make in FAMILIES.items():
        g = make()
        assert g.num_nodes > 100, name


@pytest.mark.parametrize(
    "bad", [lambda: chain(0), lambda: unet(3, image_size=12), lambda: random_layered_dag(0)]
)
def test_bad_sizes_are_value_errors(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        bad()
