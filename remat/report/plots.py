"""The report's pictures, drawn with matplotlib: the memory timeline and the frontier.

Figures are built with :class:`matplotlib.figure.Figure` directly (no pyplot: no global state, no
GUI backend) and written as SVG (text as paths: nothing to fetch) or PNG. Every series has a
fixed colour of its own, listed in :data:`TIMELINE_COLOURS` and :data:`SOLVER_COLOURS`, so a
test can find each drawn series in a screenshot by its colour.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from remat.ir import format_bytes
from remat.report.data import Timeline
from remat.report.frontier import FrontierPoint

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TIMELINE_COLOURS = {"eager": "#1f77b4", "plan": "#d62728", "budget": "#2ca02c"}
"""Eager step blue, the plan red, the budget line green."""
SOLVER_COLOURS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#000080")
"""One per solver on the frontier, in the order the solvers first appear."""
STATIC_FILL = "#e6e6e6"
PEAK_VALUES_SHOWN = 5
"""Values named in the peak's note on the timeline (the HTML page lists ten)."""


@dataclass(frozen=True)
class DrawnSeries:
    """A series a figure draws: its label and its colour (for legends and for tests)."""

    label: str
    colour: str


def _unit(max_bytes: float) -> tuple[str, float]:
    for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= scale:
            return name, float(scale)
    return "B", 1.0


def _new_figure(width_in: float, height_in: float) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    return fig


def timeline_series(tl: Timeline) -> list[DrawnSeries]:
    out = [
        DrawnSeries(tl.eager.label, TIMELINE_COLOURS["eager"]),
        DrawnSeries(tl.plan.label, TIMELINE_COLOURS["plan"]),
    ]
    if tl.budget_bytes is not None:
        out.append(DrawnSeries("budget", TIMELINE_COLOURS["budget"]))
    return out


def timeline_figure(tl: Timeline, *, title: str | None = None) -> Figure:
    """Device bytes per step of the plan and of the eager step, the budget, the start of the
    backward pass of each, and the plan's peak with the largest values alive there."""
    top = max([*tl.eager.device_bytes, *tl.plan.device_bytes, tl.budget_bytes or 0, 1])
    unit, scale = _unit(top)
    fig = _new_figure(10, 4.8)
    ax = fig.add_subplot()
    ax.axhspan(0, tl.static_bytes / scale, color=STATIC_FILL, lw=0, zorder=0)
    if tl.static_bytes:
        ax.text(
            0.005,
            tl.static_bytes / scale,
            f"static {format_bytes(tl.static_bytes)}",
            transform=ax.get_yaxis_transform(),
            ha="left",
            va="bottom",
            fontsize=8,
            color="#555555",
        )
    for key, s in (("eager", tl.eager), ("plan", tl.plan)):
        colour = TIMELINE_COLOURS[key]
        ys = [b / scale for b in s.device_bytes]
        ax.step(
            range(len(ys)),
            ys,
            where="post",
            color=colour,
            lw=1.8,
            label=f"{s.label}: peak {format_bytes(s.peak_bytes)}",
            zorder=3 if key == "plan" else 2,
        )
        if s.backward_step is not None:
            ax.axvline(s.backward_step, color=colour, ls=":", lw=1.2, zorder=1)
            ax.text(
                s.backward_step,
                0.97,
                f"backward ({key}) ",
                transform=ax.get_xaxis_transform(),
                rotation=90,
                va="top",
                ha="right",
                fontsize=8,
                color="#444444",
            )
    if tl.budget_bytes is not None:
        ax.axhline(
            tl.budget_bytes / scale,
            color=TIMELINE_COLOURS["budget"],
            ls="--",
            lw=1.6,
            label=f"budget {format_bytes(tl.budget_bytes)}",
            zorder=2,
        )
    pk = tl.peak
    # The peak's note goes to the side with more room, the legend to the other.
    right = pk.step < 0.55 * max(len(tl.plan.device_bytes), 1)
    if pk.step >= 0:
        y = pk.device_bytes / scale
        ax.plot([pk.step], [y], marker="o", ms=7, mfc="none", mec="black", mew=1.5, zorder=4)
        lines = [f"plan peak {format_bytes(pk.device_bytes)} at step {pk.step}"]
        if pk.node_id:
            lines[0] += f" ({pk.node_id})"
        for v in pk.largest(PEAK_VALUES_SHOWN):
            lines.append(f"{format_bytes(v.size_bytes):>10}  {v.module}  {v.value_id}")
        more = len(pk.values) - PEAK_VALUES_SHOWN
        if more > 0:
            lines.append(f"... {more} more values alive")
        ax.annotate(
            "\n".join(lines),
            xy=(pk.step, y),
            xytext=(0.98 if right else 0.02, 0.97),
            textcoords="axes fraction",
            ha="right" if right else "left",
            va="top",
            multialignment="left",
            fontsize=7.5,
            family="monospace",
            bbox={"boxstyle": "round,pad=0.4", "fc": "white", "ec": "#999999", "alpha": 0.95},
            arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8},
            zorder=5,
        )
    ax.set_ylim(0, top / scale * 1.45)
    ax.set_xlim(0, max(len(tl.eager.device_bytes), len(tl.plan.device_bytes)))
    ax.set_xlabel("step of the schedule (compute, free, offload, prefetch)")
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(title or f"memory timeline: {tl.graph_name}", fontsize=11)
    ax.legend(loc="upper left" if right else "upper right", fontsize=8, framealpha=0.95)
    ax.grid(axis="y", color="#eeeeee", lw=0.6)
    return fig


def frontier_series(points: Sequence[FrontierPoint]) -> list[DrawnSeries]:
    """The solvers with at least one plan that fits, each with its colour."""
    names: list[str] = []
    for p in points:
        if p.fits and p.solver not in names:
            names.append(p.solver)
    return [DrawnSeries(n, SOLVER_COLOURS[i % len(SOLVER_COLOURS)]) for i, n in enumerate(names)]


def frontier_figure(
    points: Sequence[FrontierPoint],
    *,
    marked: FrontierPoint | None = None,
    title: str | None = None,
) -> Figure:
    """Overhead against budget for each solver; a proven bound drawn as a band from the bound
    up to the solver's overhead; ``marked`` (the report's plan) as a red star."""
    series = frontier_series(points)
    all_b = [p.budget_bytes for p in points] + ([marked.budget_bytes] if marked else [])
    unit, scale = _unit(max(all_b, default=1))
    fig = _new_figure(10, 4.2)
    ax = fig.add_subplot()
    for s in series:
        pts = sorted(
            (p for p in points if p.solver == s.label and p.fits), key=lambda p: p.budget_bytes
        )
        xs = [p.budget_bytes / scale for p in pts]
        ys = [100 * (p.overhead or 0.0) for p in pts]
        ax.plot(xs, ys, color=s.colour, marker="o", ms=4, lw=1.6, label=s.label, zorder=3)
        bounded = [p for p in pts if p.bound_overhead is not None]
        if bounded:
            ax.fill_between(
                [p.budget_bytes / scale for p in bounded],
                [100 * (p.bound_overhead or 0.0) for p in bounded],
                [100 * (p.overhead or 0.0) for p in bounded],
                color=s.colour,
                alpha=0.18,
                lw=0,
                label=f"{s.label}: proven bound to plan",
                zorder=1,
            )
    if marked is not None and marked.fits:
        ax.plot(
            [marked.budget_bytes / scale],
            [100 * (marked.overhead or 0.0)],
            marker="*",
            ms=14,
            color=TIMELINE_COLOURS["plan"],
            mec="black",
            mew=0.6,
            ls="none",
            label=f"this plan ({marked.solver})",
            zorder=4,
        )
    if not series and not (marked and marked.fits):
        ax.text(0.5, 0.5, "no plan fits at any budget asked", transform=ax.transAxes, ha="center")
    ax.set_xlabel(f"budget, device memory in all ({unit})")
    ax.set_ylabel("overhead over the eager step (%)")
    ax.set_title(title or "budget / time frontier", fontsize=11)
    ax.set_ylim(bottom=0)
    ax.grid(color="#eeeeee", lw=0.6)
    if series or marked:
        ax.legend(fontsize=8, framealpha=0.95)
    return fig


_ID = re.compile(r'\bid="([^"]+)"')


def to_svg(fig: Figure, *, id_prefix: str = "") -> str:
    """The figure as an ``<svg>`` element for inlining in HTML: no XML prolog, no metadata,
    element ids prefixed with ``id_prefix`` so that two figures on one page keep apart."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "remat", "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    if id_prefix:
        ids = set(_ID.findall(text))
        text = _ID.sub(lambda m: f'id="{id_prefix}{m.group(1)}"', text)
        text = re.sub(
            r"(#)([^\s\"')]+)",
            lambda m: m.group(1) + (id_prefix + m.group(2) if m.group(2) in ids else m.group(2)),
            text,
        )
    return text


def to_png(fig: Figure, *, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def save(fig: Figure, path: str | Path) -> None:
    """Write ``fig`` as SVG or PNG, chosen by the file's suffix.

    Raises
    ------
    ValueError
        For another suffix, naming it.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".svg":
        p.write_text(to_svg(fig))
    elif suffix == ".png":
        p.write_bytes(to_png(fig))
    else:
        raise ValueError(
            f"{path}: a plot is written as .svg or .png, not {suffix or 'no suffix'!r}"
        )
