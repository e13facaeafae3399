"""The ``remat`` command: exit codes (0 ok, 1 check failed, 2 bad input), outputs, reports."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from remat import solver as solvers
from remat.cli import main
from remat.ir import Graph, eager_plan, resolve_budget, simulate, synthetic
from remat.solver.base import SolveResult


@pytest.fixture(scope="module")
def graph() -> Graph:
    return synthetic.chain(8)


@pytest.fixture
def graph_file(tmp_path: Path, graph: Graph) -> Path:
    p = tmp_path / "g.json"
    p.write_text(graph.to_json())
    return p


def test_solve_writes_the_result_with_its_plan(
    graph: Graph, graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = main(
        [
            "solve",
            str(graph_file),
            "--budget",
            "70%",
            "--solver",
            "checkpoint-all",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    r = SolveResult.model_validate_json(out.read_text())
    local = solvers.get("checkpoint-all")(graph, resolve_budget(graph, "70%"))
    assert r.plan == local.plan and r.peak_bytes == local.peak_bytes
    assert "checkpoint-all (feasible)" in capsys.readouterr().out

    assert main(["solve", str(graph_file), "--budget", "70%", "--solver", "none", "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["status"] == "infeasible" and "plan" not in printed


def test_frontier(graph: Graph, graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "frontier",
            str(graph_file),
            "--budgets",
            "100%,0.5,90000000",
            "--solver",
            "checkpoint-all",
            "--json",
        ]
    )
    assert code == 0
    points = json.loads(capsys.readouterr().out)
    assert [p["budget_bytes"] for p in points] == [
        resolve_budget(graph, b) for b in ("100%", 0.5, 90000000)
    ]


def test_check_pass_fail_and_reports(
    graph: Graph, graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js, xml = tmp_path / "c.json", tmp_path / "c.xml"
    ok = main(
        [
            "check",
            str(graph_file),
            "--budget",
            "70%",
            "--solver",
            "checkpoint-all",
            "--max-overhead",
            "0.5",
            "--json",
            str(js),
            "--junit",
            str(xml),
        ]
    )
    assert ok == 0
    report = json.loads(js.read_text())
    assert report["passed"] is True
    assert report["no_remat_peak_bytes"] == simulate(graph, eager_plan(graph)).peak_bytes
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0"
    assert "PASS" in capsys.readouterr().out

    overhead = solvers.get("checkpoint-all")(graph, 10**12).overhead
    assert overhead is not None and overhead > 0.1
    slow = main(
        [
            "check",
            str(graph_file),
            "--budget",
            "70%",
            "--solver",
            "checkpoint-all",
            "--max-overhead",
            "0.1",
            "--junit",
            str(xml),
        ]
    )
    assert slow == 1
    case = ET.parse(xml).getroot().find("testsuite/testcase")
    assert case is not None and case.find("failure") is not None
    assert "max-overhead" in case.find("failure").get("message", "")  # type: ignore[union-attr]

    too_small = main(["check", str(graph_file), "--budget", "10%", "--json", str(js)])
    assert too_small == 1
    report = json.loads(js.read_text())
    assert report["passed"] is False
    out = capsys.readouterr().out
    assert "FAIL: no plan fits" in out
    # the smallest plan known and the proven floor, in the message and the JSON
    assert "no plan can peak below" in out and "no plan below (proven)" in out
    low = report["result"]["min_budget_lower_bytes"]
    assert low is not None and low <= report["result"]["min_budget_bytes"]


def test_report_replays_the_plan(
    graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    assert (
        main(["solve", str(graph_file), "--budget", "1.0", "--solver", "sqrt", "--out", str(out)])
        == 0
    )
    capsys.readouterr()
    assert main(["report", str(graph_file), "--result", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    r = SolveResult.model_validate_json(out.read_text())
    assert data["plan"]["peak_bytes"] == r.peak_bytes


@pytest.mark.parametrize(
    "argv",
    [
        ["solve", "/no/such/file.json", "--budget", "1GiB"],
        ["solve", "{graph}", "--budget", "12 parsecs"],
        ["solve", "{graph}", "--budget", "-5"],
        ["solve", "{graph}", "--budget", "1GiB", "--solver", "no-such-solver"],
        ["solve", "{bad}", "--budget", "1GiB"],
        ["check", "{graph}"],  # --budget missing
        ["check", "not-a-file-or-spec", "--budget", "1GiB"],
        ["report", "{graph}", "--result", "{graph}"],  # a graph is not a result
        ["frontier", "{bad}"],
        # nothing listens on the discard port: no answer is one line, not httpx's traceback
        ["solve", "{graph}", "--budget", "50%", "--url", "http://127.0.0.1:9"],
        ["solvers", "--url", "http://127.0.0.1:9"],
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    g = json.loads(graph_file.read_text())
    g["nodes"][0]["inputs"] = ["ghost"]
    bad.write_text(json.dumps(g))
    args = [a.format(graph=graph_file, bad=bad) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip()
    if "{bad}" in argv:
        assert "ghost" in err  # the id at fault is named


def test_solvers_lists_the_registry_and_one_solvers_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["solvers", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["default"] == solvers.default_solver()
    assert [e["name"] for e in listed["solvers"]] == solvers.available()
    h = next(e for e in listed["solvers"] if e["name"] == "hierarchical")
    assert h["options"] == list(solvers.info("hierarchical").options)
    assert main(["solvers"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in solvers.available())
    assert main(["solvers", "milp"]) == 0
    text = capsys.readouterr().out
    assert all(opt in text for opt in solvers.info("milp").options)
    assert "'highs'" in text and '(default "highs")' in text
    assert main(["solvers", "milp", "--json"]) == 0
    schema = json.loads(capsys.readouterr().out)["options"]
    assert set(schema["properties"]) == set(solvers.info("milp").options)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["solvers", "no-such"], "'no-such'"),
        (["solvers", "--plugin", "no_such_module"], "--plugin"),
        (["solvers", "milp", "--url", "http://127.0.0.1:9"], "NAME"),
    ],
)
def test_solvers_bad_input_is_named(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_console_script_entry_point(graph_file: Path) -> None:
    # `python -m remat.cli` is what the `remat` script runs.
    out = subprocess.run(
        [sys.executable, "-m", "remat.cli", "check", str(graph_file), "--budget", "100%"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr
    assert "PASS" in out.stdout


MODEL = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    return model, (torch.randn(8, 16),), lambda out: out.square().mean()
"""


def test_trace_and_check_a_model_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    model = tmp_path / "tiny_model.py"
    model.write_text(MODEL)
    spec = f"{model}:build"
    out = tmp_path / "g.json"
    assert main(["trace", spec, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    g = Graph.from_json(out.read_text())
    assert g.num_nodes > 0 and g.static_bytes > 0
    # priced as remat.trace prices by default (the measured roofline of this CPU), not by FLOPs
    # with element-wise ops free, and said so; --cost flops still asks for FLOPs
    from remat.tracer import trace_spec

    library = trace_spec(spec)
    assert g.device is not None and library.device is not None
    assert g.device.name == library.device.name == "cpu-local"
    assert all(n.time_s > 0 for n in g.nodes)  # the roofline prices every op, relu included
    assert "cost model" in printed and "cpu-local roofline" in printed
    assert main(["check", spec, "--budget", "100%"]) == 0
    out_text = capsys.readouterr().out
    assert "PASS" in out_text and "cpu-local roofline" in out_text
    assert main(["trace", spec, "--cost", "flops", "--out", str(out)]) == 0
    flops = Graph.from_json(out.read_text())
    assert flops.device is None and any(n.time_s == 0 for n in flops.nodes)
    assert "none recorded" in capsys.readouterr().out
    assert main(["trace", f"{model}:missing"]) == 2


def test_budget_text_goes_to_the_one_parser(
    graph_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1e9 is bytes for parse_budget, and now for the CLI too (it was refused as a fraction)
    argv = ["solve", str(graph_file), "--solver", "none", "--json", "--budget"]
    assert main([*argv, "1e9"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["budget_bytes"] == 10**9
    # a bare 1 could mean one byte or the whole eager peak: refused, both spellings shown
    assert main([*argv, "1"]) == 2
    err = capsys.readouterr().err
    assert '"1B"' in err and '"100%"' in err and "--budget" in err
    assert main([*argv, "1B"]) == 1  # one byte: nothing fits
    assert json.loads(capsys.readouterr().out)["budget_bytes"] == 1


def test_every_subcommand_runs_with_its_defaults(
    graph: Graph, graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command as a newcomer types it first, with no optional flag: `remat frontier`
    without --solver crashed (AttributeError: remat.solver has no DEFAULT_SOLVER)."""
    assert main(["frontier", str(graph_file), "--budgets", "100%,70%", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    assert solvers.default_solver() in out and "remat frontier" in out and "priced by" in out
    assert main(["solve", str(graph_file), "--budget", "70%", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    assert f"{solvers.default_solver()} (" in out and "cost model" in out
    assert main(["report", str(graph_file)]) == 0
    assert "cost model" in capsys.readouterr().out
    assert main(["solvers"]) == 0
    assert "(default)" in capsys.readouterr().out
    assert main(["check", str(graph_file), "--budget", "100%"]) == 0
    assert "PASS" in capsys.readouterr().out
