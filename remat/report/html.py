"""One self-contained HTML page for a plan: inline SVG plots and tables, nothing fetched.

The page has no scripts, stylesheets, fonts or images from elsewhere: the plots are inline SVG
with text drawn as paths. Each ``<figure class="plot">`` lists the series it draws and their
colours in ``data-series`` (JSON), which the browser test reads.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

from remat.ir import Graph, format_bytes
from remat.report.data import ModuleRow, Peak, Timeline, module_table, timeline
from remat.report.frontier import FrontierPoint, point_from_result
from remat.report.plots import (
    DrawnSeries,
    frontier_figure,
    frontier_series,
    timeline_figure,
    timeline_series,
    to_svg,
)

PEAK_VALUES_LISTED = 10

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto;
       max-width: 1060px; color: #222; background: #fff; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
p.sub { color: #555; margin-top: 0; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
table.kv th { font-weight: normal; color: #555; }
figure { margin: 8px 0; } figure svg { width: 100%; height: auto; }
.note { color: #555; font-size: 13px; }
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g} s"


def _figure(fig_id: str, svg: str, series: Sequence[DrawnSeries], caption: str) -> str:
    data = json.dumps([{"label": s.label, "colour": s.colour} for s in series])
    return (
        f'<figure class="plot" id="{fig_id}" data-series="{_e(data)}">\n{svg}\n'
        f'<figcaption class="note">{_e(caption)}</figcaption></figure>'
    )


def _kv(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv">{body}</table>'


def _table(head: Sequence[str], rows: Sequence[Sequence[object]], numeric: set[int]) -> str:
    def cell(tag: str, i: int, x: object) -> str:
        cls = ' class="n"' if i in numeric else ""
        return f"<{tag}{cls}>{_e(x)}</{tag}>"

    h = "".join(cell("th", i, x) for i, x in enumerate(head))
    b = "".join("<tr>" + "".join(cell("td", i, x) for i, x in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"


def peak_table(peak: Peak, n: int = PEAK_VALUES_LISTED) -> str:
    rows = [
        (
            v.value_id,
            v.module,
            v.kind,
            "x".join(map(str, v.shape)) if v.shape else "",
            v.dtype or "",
            format_bytes(v.size_bytes),
        )
        for v in peak.largest(n)
    ]
    return _table(["value", "module", "kind", "shape", "dtype", "size"], rows, {5})


def module_rows_table(rows: Sequence[ModuleRow]) -> str:
    body = [
        (
            r.module,
            r.num_values,
            format_bytes(r.size_bytes),
            r.kept,
            r.recomputed,
            r.recomputations,
            format_bytes(r.recomputed_bytes),
            r.offloaded,
            format_bytes(r.offloaded_bytes),
            _secs(r.recompute_time_s) if r.recompute_time_s else "",
        )
        for r in rows
    ]
    head = [
        "module",
        "values",
        "bytes",
        "kept",
        "recomputed",
        "recomputations",
        "recomputed bytes",
        "offloaded",
        "offloaded bytes",
        "recompute time",
    ]
    return _table(head, body, set(range(1, 10)))


def frontier_table(points: Sequence[FrontierPoint]) -> str:
    rows = [
        (
            p.solver,
            p.budget,
            format_bytes(p.budget_bytes),
            p.status,
            "" if p.peak_bytes is None else format_bytes(p.peak_bytes),
            _pct(p.overhead) if p.fits else "",
            _pct(p.bound_overhead) if p.bound_overhead is not None else "",
            f"{p.solve_time_s:.2f}",
        )
        for p in points
    ]
    head = ["solver", "budget", "bytes", "status", "peak", "overhead", "bound", "solve s"]
    return _table(head, rows, {2, 4, 5, 6, 7})


def summary_rows(graph: Graph, result: Any, tl: Timeline) -> list[tuple[str, str]]:
    steps = len(tl.plan.device_bytes)
    rows = [
        ("graph", f"{graph.name or 'graph'}: {graph.num_nodes} nodes, {graph.num_values} values"),
        ("static (params, grads, state)", format_bytes(graph.static_bytes)),
        ("eager peak", f"{format_bytes(tl.eager.peak_bytes)}, step {_secs(tl.eager.total_time_s)}"),
        ("budget", format_bytes(result.budget_bytes)),
        ("solver", f"{result.solver} ({result.status}), solved in {result.solve_time_s:.2f} s"),
        (
            "plan peak",
            f"{format_bytes(tl.plan.peak_bytes)} at step {tl.peak.step} of {steps}",
        ),
        ("plan time", f"{_secs(tl.plan.total_time_s)} (overhead {_pct(tl.overhead)})"),
    ]
    if result.lower_bound_s is not None:
        rows.append(("proven bound", f"{_secs(result.lower_bound_s)} (gap {_pct(result.gap)})"))
    if result.message:
        rows.append(("note", str(result.message)))
    return rows


def render_html(
    graph: Graph,
    result: Any,
    *,
    frontier: Sequence[FrontierPoint] | None = None,
    title: str | None = None,
) -> str:
    """The report page for ``result`` (a :class:`~remat.solver.SolveResult` with a plan) on
    ``graph``, with the frontier when given.

    Raises
    ------
    ValueError
        When the result has no plan.
    InvalidPlanError
        When its plan does not run on ``graph``.
    """
    if result.plan is None:
        raise ValueError("result: it has no plan to report on")
    tl = timeline(graph, result.plan, result.budget_bytes)
    name = title or f"remat report: {graph.name or 'graph'}"
    tl_svg = to_svg(timeline_figure(tl), id_prefix="tl-")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(name)}</h1>",
        f'<p class="sub">{_e(result.solver)} plan at {_e(format_bytes(result.budget_bytes))}: '
        f"peak {_e(format_bytes(tl.plan.peak_bytes))} against "
        f"{_e(format_bytes(tl.eager.peak_bytes))} eager, {_e(_pct(tl.overhead))} time.</p>",
        _kv(summary_rows(graph, result, tl)),
        '<h2 id="sec-memory">Memory timeline</h2>',
        _figure(
            "timeline",
            tl_svg,
            timeline_series(tl),
            "Device bytes (static + dynamic) during each step of the plan (red) and of the "
            "eager step (blue); green dashes: the budget; dotted: where each backward pass "
            "starts; circle: the plan's peak.",
        ),
        f'<h2 id="sec-peak">Alive at the peak ({_e(format_bytes(tl.peak.device_bytes))}, '
        f"step {tl.peak.step})</h2>",
        f'<p class="note">Static {_e(format_bytes(tl.peak.static_bytes))}'
        + (
            f", workspace of {_e(tl.peak.node_id)} {_e(format_bytes(tl.peak.workspace_bytes))}"
            if tl.peak.node_id and tl.peak.workspace_bytes
            else ""
        )
        + f", {len(tl.peak.values)} values; the {min(PEAK_VALUES_LISTED, len(tl.peak.values))} "
        "largest:</p>",
        peak_table(tl.peak),
        _table(
            ["module", "values alive", "bytes"],
            [(m, n, format_bytes(b)) for m, n, b in tl.peak.by_module()[:PEAK_VALUES_LISTED]],
            {1, 2},
        ),
    ]
    points = list(frontier or [])
    if points:
        marked = point_from_result(format_bytes(result.budget_bytes), result)
        fr_svg = to_svg(frontier_figure(points, marked=marked), id_prefix="fr-")
        series = frontier_series(points)
        parts += [
            '<h2 id="sec-frontier">Budget / time frontier</h2>',
            _figure(
                "frontier",
                fr_svg,
                series,
                "Overhead over the eager step against the budget, one line per solver; shaded: "
                "from a proven lower bound up to the plan found, where the solver proves one; "
                "star: this report's plan.",
            ),
            frontier_table(points),
        ]
    parts += [
        '<h2 id="sec-modules">Per module: kept, recomputed, offloaded</h2>',
        '<p class="note">Values each module produces (parameters and their gradients '
        "excluded). Kept: computed once; recomputations: extra computations in all.</p>",
        module_rows_table(module_table(graph, result.plan)),
        "</body></html>",
    ]
    return "\n".join(parts)
