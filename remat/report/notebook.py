"""How a :class:`~remat.ir.SolveResult` shows in a notebook: its memory timeline and figures."""

from __future__ import annotations

import html
import itertools
from typing import TYPE_CHECKING

import matplotlib  # noqa: F401  (an ImportError here sends the caller to its text fallback)

from remat.report.data import timeline
from remat.report.plots import timeline_figure, to_svg

if TYPE_CHECKING:
    from remat.ir import Graph, SolveResult

_ids = itertools.count()


def result_html(result: SolveResult, graph: Graph | None) -> str:
    """The timeline (when the plan and its graph are known) above the figures as text."""
    text = f"<pre>{html.escape(result.summary_text())}</pre>"
    if graph is None or result.plan is None:
        note = "" if result.plan is None else " (the graph is not attached: no timeline)"
        return text.replace("</pre>", html.escape(note) + "</pre>")
    fig = timeline_figure(timeline(graph, result.plan, result.budget_bytes))
    # Each output cell's SVG gets its own id prefix: a notebook shows many on one page.
    svg = to_svg(fig, id_prefix=f"remat{next(_ids)}-")
    return f'<div class="remat-result">{svg}{text}</div>'
