"""Reports people look at: the memory timeline, the frontier, per-module tables, progress.

* :func:`timeline`, :func:`module_table`, :func:`peak_of` (:mod:`remat.report.data`): the
  simulator's figures for a plan, without plotting.
* :func:`compute_frontier`, :func:`load_frontier` (:mod:`remat.report.frontier`).
* :func:`render_html` (:mod:`remat.report.html`): one self-contained page.
* :mod:`remat.report.plots`: the matplotlib figures (imported on first use).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from remat.ir.result import set_html_view
from remat.report.data import (
    AliveValue,
    ModuleRow,
    Peak,
    Series,
    Timeline,
    module_of,
    module_table,
    peak_of,
    timeline,
)
from remat.report.frontier import (
    DEFAULT_BUDGETS,
    QUICK_SOLVERS,
    FrontierPoint,
    compute_frontier,
    dump_frontier,
    load_frontier,
    point_from_result,
)

__all__ = [
    "DEFAULT_BUDGETS",
    "QUICK_SOLVERS",
    "AliveValue",
    "FrontierPoint",
    "ModuleRow",
    "Peak",
    "Series",
    "Timeline",
    "compute_frontier",
    "dump_frontier",
    "load_frontier",
    "module_of",
    "module_table",
    "notebook_html",
    "peak_of",
    "point_from_result",
    "render_html",
    "timeline",
]


if TYPE_CHECKING:
    from remat.ir import Graph, SolveResult


def notebook_html(result: SolveResult, graph: Graph | None) -> str:
    """A result's notebook view: its memory timeline when matplotlib is installed (the
    :mod:`remat.report.notebook` page), else its figures as text."""
    try:
        from remat.report.notebook import result_html  # lazily: matplotlib
    except ImportError:
        return f"<pre>{html.escape(result.summary_text())}</pre>"
    return result_html(result, graph)


# The core (remat.ir) draws nothing; this layer gives its results their notebook view.
set_html_view(notebook_html)


def __getattr__(name: str) -> Any:
    # The page and the plots need matplotlib: load them on first use.
    if name == "render_html":
        from remat.report.html import render_html

        return render_html
    raise AttributeError(f"module 'remat.report' has no attribute {name!r}")
