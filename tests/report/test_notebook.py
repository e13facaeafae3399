"""A SolveResult in a notebook: its memory timeline as inline SVG when its graph is known."""

from __future__ import annotations

import re

import remat
from remat.ir import SolveResult, synthetic
from remat.report.plots import TIMELINE_COLOURS


def test_a_solved_result_shows_its_timeline() -> None:
    g = synthetic.chain(6)
    r = remat.solve(g, "70%", solver="rotor")
    page = r._repr_html_()
    assert page.startswith('<div class="remat-result"><svg')
    assert f"stroke: {TIMELINE_COLOURS['plan']}" in page and "rotor (feasible)" in page
    # Two results on one notebook page keep their SVG ids apart.
    ids = re.findall(r'id="([^"]+)"', page + remat.solve(g, "70%", solver="rotor")._repr_html_())
    assert len(ids) == len(set(ids))


def test_a_result_read_back_shows_text_and_stays_equal() -> None:
    g = synthetic.chain(6)
    r = remat.solve(g, "70%", solver="rotor")
    back = SolveResult.model_validate_json(r.model_dump_json())
    assert back == r and "graph" not in r.model_dump_json()
    page = back._repr_html_()
    assert page.startswith("<pre>rotor (feasible)") and "not attached" in page
    assert "<svg" in back.with_graph(g)._repr_html_()
    none = remat.solve(g, "1%", solver="none")
    assert "smallest budget found" in none._repr_html_()
