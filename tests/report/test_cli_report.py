"""``remat report --html/--plot`` and ``remat frontier --plot`` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pages import Page

from remat.cli import main
from remat.ir import synthetic


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    g = tmp_path / "g.json"
    g.write_text(synthetic.chain(8).to_json())
    r = tmp_path / "r.json"
    assert main(["solve", str(g), "--budget", "70%", "--solver", "rotor", "--out", str(r)]) == 0
    return g, r


def test_report_writes_page_and_pictures(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g, r = files
    page, svg, png = tmp_path / "p.html", tmp_path / "t.svg", tmp_path / "t.png"
    args = ["report", str(g), "--result", str(r), "--frontier-solvers", "checkpoint-all,rotor"]
    assert main([*args, "--budgets", "100%,50%", "--html", str(page), "--plot", str(svg)]) == 0
    assert f"wrote          {page}" in capsys.readouterr().out
    assert svg.read_text().startswith("<svg") and "</svg>" in svg.read_text()
    figs = Page(page.read_text()).figures
    assert set(figs) == {"timeline", "frontier"}
    assert [s["label"] for s in json.loads(figs["frontier"]["series"])] == [
        "checkpoint-all",
        "rotor",
    ]
    assert main(["report", str(g), "--result", str(r), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Without a frontier: the page has the timeline only.
    assert (
        main(["report", str(g), "--result", str(r), "--frontier-solvers", "", "--html", str(page)])
        == 0
    )
    assert set(Page(page.read_text()).figures) == {"timeline"}


def test_frontier_json_feeds_the_report(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g, r = files
    plot = tmp_path / "f.png"
    code = main(
        [
            "frontier",
            str(g),
            "--budgets",
            "100%,50%,30%",
            "--solver",
            "sqrt,rotor",
            "--json",
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    points = json.loads(capsys.readouterr().out)
    assert [(p["solver"], p["budget"]) for p in points] == [
        (s, b) for s in ("sqrt", "rotor") for b in ("100%", "50%", "30%")
    ]
    assert {"lower_bound_s", "baseline_time_s", "overhead", "status"} <= set(points[0])
    assert plot.read_bytes()[:4] == b"\x89PNG"
    fr = tmp_path / "fr.json"
    fr.write_text(json.dumps(points))
    page = tmp_path / "p.html"
    assert (
        main(["report", str(g), "--result", str(r), "--frontier", str(fr), "--html", str(page)])
        == 0
    )
    series = json.loads(Page(page.read_text()).figures["frontier"]["series"])
    fitting = {p["solver"] for p in points if p["status"] in ("feasible", "optimal")}
    assert {s["label"] for s in series} == fitting and "rotor" in fitting


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--plot", "t.jpg"], "a plot is written as .svg or .png"),
        (["--html", "p.html", "--no-result"], "--html and --plot draw a plan"),
        (["--html", "p.html", "--frontier", "{graph}"], "not a frontier list"),
        (["--html", "p.html", "--frontier-solvers", "nosuch"], "unknown solver 'nosuch'"),
        (["--html", "p.html", "--budgets", "150%"], "--budgets"),
    ],
)
def test_bad_report_options_exit_2_naming_them(
    files: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    g, r = files
    args = ["report", str(g)]
    if "--no-result" in extra:
        extra = [e for e in extra if e != "--no-result"]
    else:
        args += ["--result", str(r)]
    extra = [
        str(tmp_path / e) if e.endswith((".jpg", ".html")) else e.replace("{graph}", str(g))
        for e in extra
    ]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err
