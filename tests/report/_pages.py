"""Helpers of the report tests: a planned graph, and a parser for the report page."""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any

from remat.ir import Graph
from remat.report import FrontierPoint


@dataclass(frozen=True)
class Planned:
    graph: Graph
    result: Any
    frontier: list[FrontierPoint]


class Page(HTMLParser):
    """Tags, ids, figures with their SVG text, and table rows of an HTML page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.figures: dict[str, dict[str, str]] = {}
        self.tables: list[list[list[str]]] = []
        self._fig: str | None = None
        self._cell: list[str] | None = None
        self.feed(text)
        # The SVG text of each figure, cut from the source (HTMLParser does not keep it).
        for m in re.finditer(r'<figure class="plot" id="([^"]+)".*?</figure>', text, re.S):
            self.figures[m.group(1)]["svg"] = m.group(0)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "figure":
            self._fig = a["id"] or ""
            self.figures[self._fig] = {"series": a.get("data-series") or "[]"}
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
