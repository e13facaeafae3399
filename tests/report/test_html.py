"""The HTML report's structure, read without a browser: self-contained, two inline SVG plots
whose drawn series match what each figure declares, the peak and module tables."""

from __future__ import annotations

import json
import re

import pytest
from _pages import Page, Planned

from remat.ir import format_bytes
from remat.report import module_table, render_html, timeline
from remat.report.plots import SOLVER_COLOURS, TIMELINE_COLOURS

NAMESPACES = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}


@pytest.fixture(scope="module")
def page_text(planned: Planned) -> str:
    return render_html(planned.graph, planned.result, frontier=planned.frontier)


def stroke_colours(svg: str) -> set[str]:
    return {c.lower() for c in re.findall(r"stroke: (#[0-9a-fA-F]{6})", svg)}


def test_page_is_self_contained(page_text: str) -> None:
    page = Page(page_text)
    tags = {t for t, _ in page.tags}
    assert not tags & {"script", "link", "img", "iframe", "object", "embed", "image"}
    for _, attrs in page.tags:
        assert "src" not in attrs
        href = attrs.get("href") or attrs.get("xlink:href")
        assert href is None or href.startswith("#"), href
    assert set(re.findall(r"https?://[^\"'\s)]+", page_text)) <= NAMESPACES
    assert "@import" not in page_text and "url(http" not in page_text
    ids = [a["id"] for _, a in page.tags if a.get("id")]
    assert len(ids) == len(set(ids)), "element ids repeat across the two plots"


def test_timeline_draws_eager_plan_and_budget(planned: Planned, page_text: str) -> None:
    fig = Page(page_text).figures["timeline"]
    series = json.loads(fig["series"])
    assert [s["label"] for s in series] == ["eager (no remat)", "plan", "budget"]
    assert [s["colour"] for s in series] == list(TIMELINE_COLOURS.values())
    assert fig["svg"].count("<svg") == 1
    # Every declared series is drawn, and no series colour is drawn that is not declared.
    palette = set(TIMELINE_COLOURS.values()) | set(SOLVER_COLOURS)
    assert stroke_colours(fig["svg"]) & palette == {s["colour"] for s in series}
    # The budget is a dashed line; the eager and plan curves are solid.
    assert re.search(
        r"stroke-dasharray[^\"]*\"?[^>]*stroke: #2ca02c|stroke: #2ca02c[^\"]*dasharray", fig["svg"]
    )


def test_frontier_draws_one_line_per_solver_and_the_bound_band(page_text: str) -> None:
    fig = Page(page_text).figures["frontier"]
    series = json.loads(fig["series"])
    assert [s["label"] for s in series] == ["checkpoint-all", "rotor", "bounded"]
    assert stroke_colours(fig["svg"]) & set(SOLVER_COLOURS) == {s["colour"] for s in series}
    band = re.findall(r'style="fill: (#[0-9a-f]{6}); fill-opacity: 0\.18', fig["svg"])
    # remat.frontier answers a budget the eager plan fits with it, bound by the eager time:
    # every solver has a (zero-width) band there; only "bounded" has one below 100%.
    assert series[2]["colour"] in set(band), "the solver with a proven bound has a band"
    assert "fill: " + TIMELINE_COLOURS["plan"] in fig["svg"]  # the report's plan: a star


def test_peak_and_module_tables(planned: Planned, page_text: str) -> None:
    page = Page(page_text)
    tl = timeline(planned.graph, planned.result.plan, planned.result.budget_bytes)
    peak = next(t for t in page.tables if t[0][:2] == ["value", "module"])
    rows = peak[1:]
    assert len(rows) == min(10, len(tl.peak.values))
    assert [r[0] for r in rows] == [v.value_id for v in tl.peak.values[:10]]
    assert [r[1] for r in rows] == [v.module for v in tl.peak.values[:10]]
    assert rows[0][5] == format_bytes(max(v.size_bytes for v in tl.peak.values))
    modules = next(t for t in page.tables if t[0][:3] == ["module", "values", "bytes"])
    expected = module_table(planned.graph, planned.result.plan)
    assert [r[0] for r in modules[1:]] == [m.module for m in expected]
    assert sum(int(r[5]) for r in modules[1:]) == sum(m.recomputations for m in expected) > 0
    frontier = next(t for t in page.tables if t[0][:2] == ["solver", "budget"])
    assert len(frontier) - 1 == len(planned.frontier)


def test_a_result_without_a_plan_is_refused(planned: Planned) -> None:
    with pytest.raises(ValueError, match="no plan"):
        render_html(planned.graph, planned.result.model_copy(update={"plan": None}))
