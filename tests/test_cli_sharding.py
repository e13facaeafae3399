"""``remat trace/solve/check --world-size N --fsdp-units ...`` and the service on a sharded graph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import remat
from remat.cli import main
from remat.ir import Graph, SolveResult, eager_plan, simulate
from remat.ir.shard import shard_graph
from remat.ir.sharding import ShardingSpec
from remat.ir.synthetic import transformer


@pytest.fixture
def graph_file(tmp_path: Path) -> Path:
    # parameters dominate (a large width, a short sequence): sharding them pays off
    g = transformer(4, d_model=256, num_heads=4, seq_len=16, batch_size=1, vocab_size=512)
    path = tmp_path / "g.json"
    path.write_text(g.to_json())
    return path


def test_solve_per_rank(
    graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["solve", str(graph_file), "--budget", "100%", "--solver", "rotor", "-q",
            "--world-size", "8", "--fsdp-units", "layers.*", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = SolveResult.model_validate_json(out.read_text())
    assert r.solver == "rotor+checkpoint" and r.fits
    unsharded = Graph.from_json(graph_file.read_text())
    one = simulate(unsharded, eager_plan(unsharded)).peak_bytes
    assert r.peak_bytes is not None and r.peak_bytes < one  # per rank


def test_check_fits_per_rank_where_one_process_does_not(graph_file: Path) -> None:
    g = Graph.from_json(graph_file.read_text())
    s = shard_graph(g, ShardingSpec(world_size=8, units=tuple(f"layers.{i}" for i in range(4))))
    budget = str(remat.solve(s, 10**12, solver="checkpoint-all").peak_bytes)  # per rank only
    base = ["check", str(graph_file), "--budget", budget, "--solver", "checkpoint-all", "-q"]
    assert main(base) == 1
    assert main([*base, "--world-size", "8", "--fsdp-units", "layers.*"]) == 0
    assert main([*base, "--world-size", "8", "--ddp"]) == 1  # DDP holds the whole model


def test_trace_writes_the_sharded_graph(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "g.json"
    argv = ["trace", "examples/models.py:gpt_demo", "-q", "--out", str(out), "--world-size",
            "2", "--fsdp-units", "blocks.*", "--param-dtype", "bfloat16"]  # fmt: skip
    assert main(argv) == 0
    g = Graph.from_json(out.read_text())
    assert g.sharding is not None and g.sharding.param_dtype == "bfloat16"
    assert g.sharding.units and all(u.startswith("blocks.") for u in g.sharding.units)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--fsdp-units", "layers.*"], "--fsdp-units needs --world-size"),
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "2", "--fsdp-units", "nope.*"], "--fsdp-units"),
        (["--world-size", "2", "--fsdp-units", "nope"], "--fsdp-units"),
        (["--world-size", "2", "--param-dtype", "float13"], "--param-dtype"),
        (["--world-size", "2", "--ddp", "--fsdp-units", "layers.0"], "--fsdp-units"),
    ],
)
def test_bad_flags_name_the_flag(
    graph_file: Path, extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["solve", str(graph_file), "--budget", "80%", "-q", *extra]
    assert main(argv) == 2
    assert named in capsys.readouterr().err


def test_service_task_solves_fsdp_in_the_checkpoint_class(graph_file: Path) -> None:
    from remat.api.tasks import run_solve

    g = Graph.from_json(graph_file.read_text())
    s = shard_graph(g, ShardingSpec(world_size=4, units=tuple(f"layers.{i}" for i in range(4))))
    task = {"graph": s.to_json(), "budget": "80%", "solver": "dtr", "time_limit_s": 10,
            "options": {}}  # fmt: skip
    r = SolveResult.model_validate_json(run_solve(task).text)
    assert r.solver == "dtr+checkpoint" and r.plan is not None
    assert json.loads(s.to_json())["sharding"]["world_size"] == 4
