"""The sharded step (remat.ir.sharding, remat.ir.shard): a hand-built two-unit graph whose
per-rank figures are worked out by hand, the window rule, validation, JSON, DDP."""

from __future__ import annotations

import pydantic
import pytest

import remat
from remat.ir import Graph, InvalidPlanError, Node, Plan, Value, compute, eager_plan, free, simulate
from remat.ir.device_profile import Interconnect
from remat.ir.shard import recompute_windows, shard_graph
from remat.ir.sharding import ShardingSpec, collective_time_s
from remat.ir.synthetic import transformer

LINK = Interconnect(bandwidth_bytes_per_s=1e3, latency_s=0.5)


def _two_units() -> Graph:
    """x -> fa (module a, param pa 3x2) -> ha -> fb (module b, param pb 2x2) -> loss."""
    f4 = "float32"
    return Graph(
        name="two-units",
        values=[
            Value(id="x", size_bytes=8, kind="input"),
            Value(id="pa", size_bytes=24, kind="param", shape=(3, 2), dtype=f4),
            Value(id="pb", size_bytes=16, kind="param", shape=(2, 2), dtype=f4),
            Value(id="ha", size_bytes=40),
            Value(id="loss", size_bytes=4, kind="loss"),
            Value(id="dha", size_bytes=40, kind="gradient"),
            Value(id="dpa", size_bytes=24, kind="gradient", shape=(3, 2), dtype=f4),
            Value(id="dpb", size_bytes=16, kind="gradient", shape=(2, 2), dtype=f4),
        ],
        nodes=[
            Node(id="fa", module="a", inputs=("x", "pa"), outputs=("ha",), time_s=1.0),
            Node(id="fb", module="b", inputs=("ha", "pb"), outputs=("loss",), time_s=1.0),
            Node(
                id="gb",
                module="b",
                phase="backward",
                inputs=("loss", "ha", "pb"),
                outputs=("dha", "dpb"),
                time_s=1.0,
            ),
            Node(
                id="ga",
                module="a",
                phase="backward",
                inputs=("dha", "x"),
                outputs=("dpa",),
                time_s=1.0,
            ),
        ],
        required=["loss", "dpa", "dpb"],
        static_bytes=80,
    )


SPEC = ShardingSpec(world_size=2, units=("a", "b"), interconnect=LINK)


def test_per_rank_step_worked_by_hand() -> None:
    s = shard_graph(_two_units(), SPEC)
    # shards: pa 2 of its 3 padded-to-4 rows (16 B), pb 1 of 2 rows (8 B); grads alike
    assert s.static_bytes == 2 * (16 + 8)
    assert [n.id for n in s.nodes] == [
        "fsdp.all_gather.forward:a",
        "fa",
        "fsdp.reshard.forward:a",
        "fsdp.all_gather.forward:b",
        "fb",
        "fsdp.reshard.forward:b",
        "fsdp.all_gather.backward:b",
        "fsdp.all_gather.backward:a",  # FSDP2's implicit backward prefetch
        "gb",
        "fsdp.reshard.backward:b",
        "fsdp.reduce_scatter:b",
        "ga",
        "fsdp.reshard.backward:a",
        "fsdp.reduce_scatter:a",
        "fsdp.done.backward:<root>",
    ]
    assert s.value("fsdp.unsharded.forward:a").size_bytes == 32  # 4 padded rows x 2 x 4 B
    assert s.node("fsdp.all_gather.forward:a").workspace_bytes == 32  # the flat AG buffer
    assert not s.is_static("dpa") and s.is_required("fsdp.done")
    sim = simulate(s, eager_plan(s))
    # at gb: x 8, ha 40, loss 4, both units gathered (16 + 32), dha 40 and dpb 16 made
    assert sim.peak_dynamic_bytes == 156
    assert sim.peak_bytes == 48 + 156
    # ring all-gather of n bytes on 2 ranks: 1 step of latency + n/2 over the link
    assert s.node("fsdp.all_gather.forward:a").time_s == pytest.approx(0.5 + 16 / 1e3)
    assert s.node("fsdp.reduce_scatter:a").time_s == pytest.approx(0.5 + 16 / 1e3)
    assert sim.total_time_s == pytest.approx(4 + 6 * 0.5 + (16 + 8 + 8 + 16 + 8 + 16) / 1e3)


def test_mixed_precision_gathers_in_param_dtype() -> None:
    spec = SPEC.model_copy(update={"param_dtype": "bfloat16"})
    s = shard_graph(_two_units(), spec)
    assert s.value("fsdp.unsharded.forward:a").size_bytes == 16
    assert s.value("dpa").size_bytes == 12  # unsharded gradients in the parameter dtype
    assert s.value("fsdp.reduce_scatter_input:a").size_bytes == 16  # reduce dtype: bf16
    assert s.static_bytes == 48  # shards keep the parameters' own dtype


def test_recomputation_only_inside_the_units_backward_window() -> None:
    s = shard_graph(_two_units(), SPEC)
    assert recompute_windows(s) == {
        "fa": ("fsdp.all_gather.backward:a", "fsdp.reshard.backward:a"),
        "fb": ("fsdp.all_gather.backward:b", "fsdp.reshard.backward:b"),
    }
    ids = [n.id for n in s.nodes]
    inside = [
        *ids[:5],
        "fsdp.reshard.forward:b",
        "fsdp.all_gather.backward:b",
        "fsdp.all_gather.backward:a",
        "fa",
        *ids[8:],
    ]
    steps = []
    for nid in inside:
        steps.append(compute(nid))
        if nid == "fb":
            steps.append(free("ha"))
    simulate(s, Plan(steps=steps))  # ha freed after fb and made again in a's window: valid
    early = [*ids[:5], "fa", *ids[5:]]  # before a's backward all-gather
    steps = [compute(i) for i in early[:5]] + [free("ha")] + [compute(i) for i in early[5:]]
    with pytest.raises(InvalidPlanError, match="parameter window"):
        simulate(s, Plan(steps=steps))
    # unsharded, the same plan is fine
    simulate(
        _two_units(),
        Plan(
            steps=[
                compute("fa"),
                compute("fb"),
                free("ha"),
                compute("fa"),
                compute("gb"),
                compute("ga"),
            ]
        ),
    )


def test_no_reshard_after_forward_keeps_one_window() -> None:
    spec = SPEC.model_copy(update={"reshard_after_forward": False})
    s = shard_graph(_two_units(), spec)
    assert not any(n.id.startswith("fsdp.all_gather.backward") for n in s.nodes)
    assert recompute_windows(s)["fa"] == ("fsdp.all_gather.forward:a", "fsdp.reshard.backward:a")
    # both units' parameters are held from the forward to their backward
    assert simulate(s, eager_plan(s)).peak_dynamic_bytes == 156


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "strategy": "zero"}, "strategy"),
        ({"world_size": 2, "units": ("a.",)}, "units"),
        ({"world_size": 2, "units": ("a", "a")}, "units"),
        ({"world_size": 2, "param_dtype": "float13"}, "param_dtype"),
        ({"world_size": 2, "strategy": "ddp", "units": ("a",)}, "units"),
        ({"world_size": 2, "bucket_cap_bytes": 0}, "bucket_cap_bytes"),
        # Bounds, so that no valid spec overflows the arithmetic of shard_graph or the service.
        ({"world_size": 2**20 + 1}, "world_size"),
        ({"world_size": 2.5}, "world_size"),
        ({"world_size": 2, "bucket_cap_bytes": 2**60 + 1}, "bucket_cap_bytes"),
        (
            {"world_size": 2, "first_bucket_bytes": 17511237789001022595701956711284736},
            "first_bucket_bytes",
        ),
        ({"world_size": 2, "units": tuple(f"l.{i}" for i in range(4097))}, "units"),
        ({"world_size": 2, "units": ("x" * 1001,)}, "units"),
        ({"world_size": 2, "reduce_dtype": "torch.torch.float32"}, "reduce_dtype"),
        (
            {"world_size": 2, "interconnect": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e307}},
            "latency_s",
        ),
        ({"world_size": 2, "interconnect": {"bandwidth_bytes_per_s": 0.5}}, "bandwidth"),
        ({"world_size": 2, "interconnect": {"bandwidth_bytes_per_s": 1e31}}, "bandwidth"),
        ({"world_size": 2, "interconnect": {"bandwidth_bytes_per_s": float("inf")}}, "bandwidth"),
        (
            {"world_size": 2, "interconnect": {"bandwidth_bytes_per_s": 1e9, "latency_s": -1.0}},
            "latency_s",
        ),
    ],
)
def test_bad_spec_names_the_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=named):
        ShardingSpec.model_validate(fields)


def test_json_schema_states_what_the_validators_check() -> None:
    # A client (or a fuzzer) generating from the schema gets specs the service accepts.
    import re

    schema = ShardingSpec.model_json_schema()
    props = schema["properties"]
    assert props["world_size"]["maximum"] == 2**20
    assert props["bucket_cap_bytes"]["maximum"] == 2**60
    unit = props["units"]["items"]
    assert props["units"]["uniqueItems"] and props["units"]["maxItems"] == 4096
    for path in ("a.", ".a", "a..b", "a b", ""):
        assert not re.search(unit["pattern"], path)
        with pytest.raises(pydantic.ValidationError, match="units"):
            ShardingSpec(world_size=2, units=(path,))
    assert re.search(unit["pattern"], "model.layers.3")
    dtype = props["param_dtype"]["anyOf"][0]["pattern"]
    assert re.search(dtype, "torch.bfloat16") and not re.search(dtype, "bfloat17")
    assert "anyOf" in schema  # DDP lists no units
    link = schema["$defs"]["Interconnect"]["properties"]
    assert link["latency_s"]["maximum"] == 1.0
    assert link["bandwidth_bytes_per_s"]["minimum"] == 1.0


def test_extreme_but_valid_specs_give_finite_graphs() -> None:
    # The largest group on the slowest, highest-latency link: every collective is a finite time.
    slow = Interconnect(bandwidth_bytes_per_s=1.0, latency_s=1.0)
    for spec in (
        ShardingSpec(world_size=2**20, units=("a", "b"), interconnect=slow),
        ShardingSpec(
            world_size=2**20,
            strategy="ddp",
            bucket_cap_bytes=2**60,
            first_bucket_bytes=2**60,
            interconnect=slow,
        ),
    ):
        s = shard_graph(_two_units(), spec)
        assert all(0 <= n.time_s < float("inf") for n in s.nodes)
        sim = simulate(s, eager_plan(s))
        assert sim.peak_bytes >= s.static_bytes and sim.total_time_s < float("inf")


def test_collective_time_refuses_an_infinite_time() -> None:
    slow = Interconnect(bandwidth_bytes_per_s=1.0)
    with pytest.raises(ValueError, match="finite"):
        collective_time_s("all_reduce", 10**400, 2, slow)


def test_unknown_unit_and_twice_sharded() -> None:
    with pytest.raises(ValueError, match="units: 'c'"):
        shard_graph(_two_units(), ShardingSpec(world_size=2, units=("a", "c")))
    s = shard_graph(_two_units(), SPEC)
    with pytest.raises(ValueError, match="sharded already"):
        shard_graph(s, SPEC)


def test_json_round_trip_and_unsharded_json_unchanged() -> None:
    g = _two_units()
    assert "sharding" not in g.to_json() and "interconnect" not in g.to_json()
    s = shard_graph(g, SPEC)
    back = Graph.from_json(s.to_json())
    assert back == s and back.sharding == SPEC
    assert back.content_hash() == s.content_hash() != g.content_hash()


def test_collective_times() -> None:
    link = Interconnect(bandwidth_bytes_per_s=1e9, latency_s=1e-5)
    assert collective_time_s("all_gather", 8_000, 8, link) == pytest.approx(7e-5 + 7e-6)
    assert collective_time_s("all_reduce", 8_000, 8, link) == pytest.approx(2 * (7e-5 + 7e-6))
    assert collective_time_s("reduce_scatter", 8_000, 1, link) == 0.0


def test_ddp_buckets_and_bucket_view() -> None:
    g = _two_units()
    spec = ShardingSpec(world_size=4, strategy="ddp", first_bucket_bytes=16,
                        bucket_cap_bytes=10**6, interconnect=LINK)  # fmt: skip
    s = shard_graph(g, spec)
    assert s.static_bytes == 80 + 40  # the buckets: a second copy of the gradients
    view = shard_graph(g, spec.model_copy(update={"gradient_as_bucket_view": True}))
    assert view.static_bytes == 80
    # dpb (16 B, made first) fills the first bucket, dpa the second
    reduce = [n for n in s.nodes if n.op == "ddp.all_reduce"]
    assert [n.inputs for n in reduce] == [("dpb",), ("dpa",)]
    assert reduce[1].time_s == pytest.approx(2 * (3 * 0.5 + 0.75 * 24 / 1e3))
    assert (
        simulate(s, eager_plan(s)).peak_dynamic_bytes
        == simulate(g, eager_plan(g)).peak_dynamic_bytes
    )


def test_solve_on_fsdp_runs_the_checkpoint_class() -> None:
    g = transformer(2, d_model=64, num_heads=2, seq_len=64, batch_size=2, vocab_size=128)
    s = shard_graph(g, ShardingSpec(world_size=8, units=("layers.0", "layers.1")))
    assert s.device is not None and s.device.interconnect is not None  # the a100's NVLink
    with pytest.raises(ValueError, match="executor"):
        remat.solve(s, "80%", executor="op")
    full = remat.solve(s, "100%", solver="none")
    r = remat.solve(s, "80%", solver="rotor")
    assert r.solver.endswith("+checkpoint") and r.plan is not None
    assert remat.ir.checkpoint_class.in_class(s, r.plan)
    assert r.fits and r.peak_bytes < full.peak_bytes
