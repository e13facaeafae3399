"""``remat check --baseline``: fail when the smallest budget or the overhead at the budget grew,
naming the modules whose memory grew; ``--json`` writes the next run's baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.cli import main
from remat.ir import Graph, format_bytes, synthetic
from remat.report import module_table
from remat.report.check import check_figures, compare, smallest_budget_bytes


def write(tmp_path: Path, name: str, g: Graph) -> str:
    p = tmp_path / name
    p.write_text(g.to_json())
    return str(p)


def check(*args: str) -> int:
    return main(["check", *args])


def test_own_baseline_passes_and_a_wider_model_fails_naming_modules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = (synthetic.chain(6, heterogeneous=True, seed=s) for s in (0, 1))
    g0, g1 = write(tmp_path, "g0.json", before), write(tmp_path, "g1.json", after)
    base = tmp_path / "base.json"
    assert check(g0, "--budget", "1TiB", "--solver", "rotor", "--json", str(base)) == 0
    recorded = json.loads(base.read_text())["baseline"]
    assert recorded["smallest_budget_bytes"] == smallest_budget_bytes(before)
    assert recorded["overhead"] == 0.0 and recorded["fits"] is True
    assert set(recorded["modules"]) >= {f"stages.{i}" for i in range(6)}
    capsys.readouterr()

    # The same model against its own baseline: nothing grew.
    assert check(g0, "--budget", "1TiB", "--solver", "rotor", "--baseline", str(base)) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "grew" not in out

    s0, s1 = smallest_budget_bytes(before), smallest_budget_bytes(after)
    assert s0 is not None and s1 is not None and s1 > 1.05 * s0  # seed 1 draws wider stages
    code = check(g1, "--budget", "1TiB", "--solver", "rotor", "--baseline", str(base))
    out = capsys.readouterr().out
    assert code == 1
    assert f"smallest budget {format_bytes(s0)} -> {format_bytes(s1)}" in out
    assert "FAIL: regression against" in out
    sizes0 = {r.module: r.size_bytes for r in module_table(before, before_plan(before))}
    sizes1 = {r.module: r.size_bytes for r in module_table(after, before_plan(after))}
    grew = {m for m in sizes1 if sizes1[m] > sizes0.get(m, 0)}
    assert grew
    named = {
        line.split("grew", 1)[1].split(":")[0].strip()
        for line in out.splitlines()
        if "  grew" in line
    }
    assert grew <= named  # every module whose values grew is named
    # A larger allowance lets the same change pass.
    assert (
        check(
            g1,
            "--budget",
            "1TiB",
            "--solver",
            "rotor",
            "--baseline",
            str(base),
            "--max-growth",
            "10",
        )
        == 0
    )


def before_plan(g: Graph):  # the eager plan: the module table of what each module produces
    from remat.ir import eager_plan

    return eager_plan(g)


def test_overhead_growth_in_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = write(tmp_path, "g.json", synthetic.chain(8))
    base = tmp_path / "base.json"
    assert check(g, "--budget", "70%", "--solver", "rotor", "--json", str(base)) == 0
    o0 = json.loads(base.read_text())["baseline"]["overhead"]
    nxt = tmp_path / "next.json"
    code = check(
        g,
        "--budget",
        "70%",
        "--solver",
        "checkpoint-all",
        "--baseline",
        str(base),
        "--json",
        str(nxt),
    )
    out = capsys.readouterr().out
    report = json.loads(nxt.read_text())
    o1 = report["baseline"]["overhead"]
    assert (o1 - o0) * 100 > 5, "checkpoint-all should cost more than rotor here"
    assert code == 1 and "overhead at the budget" in out and "points, allowed +5.0" in out
    assert report["passed"] is False and report["comparison"]["failures"]
    # Allowing that many points passes.
    allow = f"{(o1 - o0) * 100 + 1:.1f}"
    assert (
        check(
            g,
            "--budget",
            "70%",
            "--solver",
            "checkpoint-all",
            "--baseline",
            str(base),
            "--max-overhead-growth",
            allow,
        )
        == 0
    )


def test_compare_reports_a_plan_that_no_longer_fits() -> None:
    g = synthetic.chain(4)
    from remat import solver as solvers

    fits = check_figures(g, solvers.solve(g, "100%", solver="none")).to_json()
    tight = check_figures(g, solvers.solve(g, "50%", solver="none"))
    c = compare(tight, fits)
    assert not c.passed and any("none now" in f for f in c.failures)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not JSON"),
        ('{"target": "x"}', "not a remat check --json file"),
        (
            '{"baseline": {"version": 1, "budget_bytes": 1}}',
            "baseline.smallest_budget_bytes is missing",
        ),
    ],
)
def test_a_bad_baseline_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    g = write(tmp_path, "g.json", synthetic.chain(4))
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert check(g, "--budget", "1TiB", "--solver", "none", "--baseline", str(bad)) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and message in err
