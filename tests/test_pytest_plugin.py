"""The pytest plugin: a test using ``remat_budget.check`` passes when the model fits and fails
with a readable message (smallest budget, overhead, the largest values alive at the peak)."""

from __future__ import annotations

import importlib.metadata
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import tomllib

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

# A small GPT: static bytes (parameters and their gradients) 942 KiB, eager peak 4.87 MiB, the
# quick solvers' smallest plan 2.05 MiB: nothing fits 1.5 MiB.
MODEL = """
import sys

sys.path.insert(0, {root!r})  # the repository's examples/

from examples.models import build_gpt


def build():
    return build_gpt(batch=4, seq=64, vocab=256, d_model=64, n_layers=2, n_heads=2)


def test_over_budget(remat_budget):
    remat_budget.check(*build(), budget="1.5MiB", max_overhead=0.3, time_limit_s=1)


def test_fits(remat_budget):
    result = remat_budget.check(*build(), budget="1GiB", max_overhead=0.3)
    assert result.fits and result.overhead == 0.0
"""


def plugin_args() -> list[str]:
    """Load the plugin by name where the installed metadata does not list it yet (a checkout
    newer than its editable install); CI installs fresh, and the entry point loads it."""
    eps = importlib.metadata.entry_points(group="pytest11")
    if any(ep.value == "remat.pytest_plugin" for ep in eps):
        return []
    return ["-p", "remat.pytest_plugin"]


def test_the_entry_point_is_declared() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"remat": "remat.pytest_plugin"}


def test_over_budget_model_fails_with_a_readable_message(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_model=MODEL.format(root=str(ROOT)))
    res = pytester.runpytest_subprocess(
        *plugin_args(), "-p", "no:cacheprovider", "--junitxml=j.xml"
    )
    res.assert_outcomes(passed=1, failed=1)
    out = res.stdout.str()
    print(out)  # the message, for people reading the test log
    res.stdout.fnmatch_lines(
        [
            "*GPT does not fit 1.50 MiB: no plan found within the budget",
            "*smallest budget found: *MiB",
            "*overhead at the budget: no plan fits (allowed +30.0%)",
            "*times priced by the cpu-local roofline",  # the library's default cost model
            "*the 10 largest values alive at the peak (*MiB, step *, smallest-peak plan found):",
        ]
    )
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "largest values alive at the peak" in line)
    listed = lines[start + 1 : start + 11]
    assert all("iB " in line or " B " in line for line in listed), listed
    assert any(" blocks.1." in line for line in listed), listed  # named by module
    assert "Traceback" not in out and "remat/report" not in out  # no trace into remat
    assert "DEBUG" not in out  # torch's trace channel stays out of the captured log
    suite = ET.parse(pytester.path / "j.xml").getroot()
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    failure = cases["test_over_budget"].find("failure")
    assert failure is not None and "smallest budget found" in (failure.get("message") or "")
    props = {p.get("name"): p.get("value") for p in cases["test_fits"].iter("property")}
    assert props["remat_fits"] == "True" and props["remat_overhead"] == "0.0"


def test_an_overhead_over_the_limit_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_slow="""
        from remat.ir import synthetic

        def test_checkpoint_all_is_too_slow(remat_budget):
            g = synthetic.chain(8)
            remat_budget.check_graph(g, budget="90%", solver="checkpoint-all", max_overhead=0.1)
        """
    )
    res = pytester.runpytest_subprocess(*plugin_args(), "-p", "no:cacheprovider")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(
        [
            "*hom-chain-8 fits * only at +32.3% time, over the allowed +10.0%",
            "*overhead at the budget: +32.3% (allowed +10.0%)",
        ]
    )
