"""What ``remat check`` and the pytest fixture judge: does a model fit, and did it get worse.

:func:`check_figures` turns a graph and a solve result into the figures a CI run records (the
smallest budget found, the overhead at the budget, memory per module, what is alive at the
peak); :func:`compare` holds them against a previous run's (``remat check --json`` output used
as ``--baseline``); :func:`failure_message` words a failure for a person.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.ir import Graph, Plan, RematError, eager_plan, format_bytes, simulate
from remat.report.data import Peak, module_table, peak_of
from remat.report.frontier import QUICK_SOLVERS

DEFAULT_MAX_GROWTH = 0.05
"""``--max-growth``: the smallest budget may grow by 5% before a check fails."""
DEFAULT_MAX_OVERHEAD_GROWTH_POINTS = 5.0
"""``--max-overhead-growth``: the overhead at the budget may grow by 5 percentage points."""
PEAK_VALUES_NAMED = 10
BASELINE_VERSION = 1


@dataclass(frozen=True)
class ModuleMemory:
    """One module's memory: the bytes of the values it produces, and those alive at the peak."""

    size_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class CheckFigures:
    """The figures of one check, and of its baseline file."""

    budget_bytes: int
    fits: bool
    overhead: float | None
    """Extra time of the plan at the budget (None: no plan fits)."""
    smallest_budget_bytes: int | None
    """The smallest peak of any plan found: the solve's own and the quick solvers' at zero
    room (an upper bound on the true minimum)."""
    eager_peak_bytes: int
    static_bytes: int
    peak: Peak
    """What is alive at the peak of the plan judged (the smallest-peak plan when none fits)."""
    modules: dict[str, ModuleMemory] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": BASELINE_VERSION,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "overhead": self.overhead,
            "smallest_budget_bytes": self.smallest_budget_bytes,
            "eager_peak_bytes": self.eager_peak_bytes,
            "static_bytes": self.static_bytes,
            "peak_values": [
                {"value": v.value_id, "module": v.module, "size_bytes": v.size_bytes}
                for v in self.peak.largest(PEAK_VALUES_NAMED)
            ],
            "modules": {
                m: {"size_bytes": mm.size_bytes, "peak_bytes": mm.peak_bytes}
                for m, mm in sorted(self.modules.items())
            },
        }


def smallest_budget_bytes(graph: Graph, solvers: Sequence[str] = QUICK_SOLVERS) -> int | None:
    """The smallest peak the quick solvers reach when asked for no room at all."""
    from remat import solver as registry

    best: int | None = None
    for name in solvers:
        try:
            r = registry.solve(graph, graph.static_bytes, solver=name)
        except (RematError, ValueError):
            continue  # a chain method on a graph it cannot see as a chain
        found = r.peak_bytes if r.fits else r.min_budget_bytes
        if found is not None and (best is None or found < best):
            best = found
    return best


def check_figures(graph: Graph, result: Any, *, search_smallest: bool = True) -> CheckFigures:
    """The figures of ``result`` (a :class:`~remat.solver.SolveResult`) on ``graph``."""
    plan: Plan = result.plan if result.plan is not None else eager_plan(graph)
    sim = simulate(graph, plan)
    peak = peak_of(graph, plan, sim)
    candidates = [result.min_budget_bytes, result.peak_bytes if result.fits else None]
    if search_smallest:
        candidates.append(smallest_budget_bytes(graph))
    found = [c for c in candidates if c is not None]
    alive: dict[str, int] = {}
    for v in peak.values:
        alive[v.module] = alive.get(v.module, 0) + v.size_bytes
    modules = {
        row.module: ModuleMemory(row.size_bytes, alive.get(row.module, 0))
        for row in module_table(graph, plan)
    }
    for m, b in alive.items():  # inputs are alive but no module produces them
        modules.setdefault(m, ModuleMemory(0, b))
    return CheckFigures(
        budget_bytes=result.budget_bytes,
        fits=result.fits,
        overhead=result.overhead if result.fits else None,
        smallest_budget_bytes=min(found) if found else None,
        eager_peak_bytes=simulate(graph, eager_plan(graph)).peak_bytes,
        static_bytes=graph.static_bytes,
        peak=peak,
        modules=modules,
    )


@dataclass(frozen=True)
class ModuleGrowth:
    module: str
    size_bytes_before: int
    size_bytes_now: int
    peak_bytes_before: int
    peak_bytes_now: int


@dataclass(frozen=True)
class Comparison:
    """A check held against its baseline: what grew, and whether that fails the check."""

    failures: tuple[str, ...]
    notes: tuple[str, ...]
    grown: tuple[ModuleGrowth, ...]
    """Modules whose values or whose memory at the peak grew, most growth first."""

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {
            "failures": list(self.failures),
            "notes": list(self.notes),
            "grown": growth_lines(self.grown, limit=len(self.grown)),
        }


@dataclass(frozen=True)
class Verdict:
    """``remat check``'s pass or fail, and the reason in words."""

    passed: bool
    reason: str


def verdict(result: Any, max_overhead: float | None) -> Verdict:
    """Pass when a plan fits the budget within ``max_overhead`` extra time."""
    budget = format_bytes(result.budget_bytes)
    if not result.fits:
        need = result.min_budget_bytes
        lower = getattr(result, "min_budget_lower_bytes", None)
        notes = ([f"smallest found: {format_bytes(need)}"] if need is not None else []) + (
            [f"no plan can peak below {format_bytes(lower)}"] if lower is not None else []
        )
        found = f" ({'; '.join(notes)})" if notes else ""
        return Verdict(False, f"no plan fits {budget}{found}")
    overhead = result.overhead or 0.0
    if max_overhead is not None and overhead > max_overhead:
        return Verdict(
            False,
            f"the plan fits but costs {overhead * 100:+.1f}% time, over --max-overhead "
            f"{max_overhead * 100:+.1f}%",
        )
    return Verdict(True, f"fits {budget} at {overhead * 100:+.1f}% time")


def read_baseline(text: str, *, source: str) -> Mapping[str, Any]:
    """The baseline part of a ``remat check --json`` file's text; ``ValueError`` naming
    ``source``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not JSON ({exc})") from None
    base = data.get("baseline") if isinstance(data, dict) else None
    if not isinstance(base, dict) or base.get("version") != BASELINE_VERSION:
        raise ValueError(
            f"{source}: not a remat check --json file (no 'baseline' of version "
            f"{BASELINE_VERSION}); write one with remat check --json PATH"
        )
    for key in ("budget_bytes", "smallest_budget_bytes", "overhead", "modules"):
        if key not in base:
            raise ValueError(f"{source}: baseline.{key} is missing")
    if not isinstance(base["modules"], dict):
        raise ValueError(f"{source}: baseline.modules is not an object")
    return base


def compare(
    now: CheckFigures,
    before: Mapping[str, Any],
    *,
    max_growth: float = DEFAULT_MAX_GROWTH,
    max_overhead_growth_points: float = DEFAULT_MAX_OVERHEAD_GROWTH_POINTS,
) -> Comparison:
    """Fail when the smallest budget grew by more than ``max_growth`` (relative) or the overhead
    at the budget by more than ``max_overhead_growth_points`` percentage points."""
    failures: list[str] = []
    notes: list[str] = []
    b0, b1 = before.get("smallest_budget_bytes"), now.smallest_budget_bytes
    if b0 and b1 is not None:
        growth = b1 / b0 - 1
        line = (
            f"smallest budget {format_bytes(b0)} -> {format_bytes(b1)} ({growth * 100:+.1f}%, "
            f"allowed +{max_growth * 100:.1f}%)"
        )
        (failures if growth > max_growth else notes).append(line)
    if before.get("budget_bytes") != now.budget_bytes:
        notes.append(
            f"the budget changed ({format_bytes(before.get('budget_bytes') or 0)} -> "
            f"{format_bytes(now.budget_bytes)}): overheads compared as they are"
        )
    o0, o1 = before.get("overhead"), now.overhead
    if o0 is not None and o1 is None:
        failures.append(
            f"overhead at the budget: a plan fitted before (+{o0 * 100:.1f}%), none now"
        )
    elif o0 is not None and o1 is not None:
        points = (o1 - o0) * 100
        line = (
            f"overhead at the budget {o0 * 100:+.1f}% -> {o1 * 100:+.1f}% ({points:+.1f} points, "
            f"allowed +{max_overhead_growth_points:.1f})"
        )
        (failures if points > max_overhead_growth_points else notes).append(line)
    grown: list[ModuleGrowth] = []
    mods: Mapping[str, Any] = before.get("modules") or {}
    for m in sorted(set(mods) | set(now.modules)):
        old = mods.get(m) or {}
        new = now.modules.get(m, ModuleMemory(0, 0))
        s0, p0 = int(old.get("size_bytes", 0)), int(old.get("peak_bytes", 0))
        if new.size_bytes > s0 or new.peak_bytes > p0:
            grown.append(ModuleGrowth(m, s0, new.size_bytes, p0, new.peak_bytes))
    grown.sort(
        key=lambda g: (
            -max(g.size_bytes_now - g.size_bytes_before, g.peak_bytes_now - g.peak_bytes_before),
            g.module,
        )
    )
    return Comparison(tuple(failures), tuple(notes), tuple(grown))


def growth_lines(grown: Sequence[ModuleGrowth], limit: int = 10) -> list[str]:
    """One line per module whose memory grew (values produced, and alive at the peak)."""
    out = []
    for g in grown[:limit]:
        parts = []
        if g.size_bytes_now != g.size_bytes_before:
            parts.append(
                f"values {format_bytes(g.size_bytes_before)} -> {format_bytes(g.size_bytes_now)}"
            )
        if g.peak_bytes_now != g.peak_bytes_before:
            parts.append(
                f"at the peak {format_bytes(g.peak_bytes_before)} -> "
                f"{format_bytes(g.peak_bytes_now)}"
            )
        out.append(f"{g.module}: {', '.join(parts)}")
    if len(grown) > limit:
        out.append(f"... and {len(grown) - limit} more modules")
    return out


def peak_lines(peak: Peak, n: int = PEAK_VALUES_NAMED) -> list[str]:
    """The ``n`` largest values alive at the peak, one line each, module and size named."""
    vals = peak.largest(n)
    width = max((len(v.module) for v in vals), default=0)
    return [
        f"{format_bytes(v.size_bytes):>11}  {v.module:<{width}}  {v.value_id}"
        + (f" {v.kind} {'x'.join(map(str, v.shape))}" if v.shape else f" {v.kind}")
        for v in vals
    ]


def cost_model_text(graph: Graph) -> str:
    """Which cost model priced a graph's times, for everything that prints a time figure: the
    device profile the tracer recorded (``cpu-local``: the measured roofline), else none."""
    if graph.device is not None:
        return f"{graph.device.name} roofline"
    return "none recorded (FLOP counts only, or times given in the graph file)"


def failure_message(
    what: str,
    figures: CheckFigures,
    result: Any,
    *,
    max_overhead: float | None,
    cost_model: str | None = None,
) -> str | None:
    """Why ``result`` fails the check, in words, or None when it passes."""
    budget = format_bytes(figures.budget_bytes)
    if not result.fits:
        head = f"{what} does not fit {budget}: no plan found within the budget"
    elif max_overhead is not None and (result.overhead or 0.0) > max_overhead:
        head = (
            f"{what} fits {budget} only at {result.overhead * 100:+.1f}% time, over the allowed "
            f"{max_overhead * 100:+.1f}%"
        )
    else:
        return None
    small = figures.smallest_budget_bytes
    lines = [
        head,
        "  smallest budget found: "
        + (format_bytes(small) if small is not None else "none (no plan at any budget)"),
        "  overhead at the budget: "
        + (f"{result.overhead * 100:+.1f}%" if result.fits else "no plan fits")
        + ("" if max_overhead is None else f" (allowed {max_overhead * 100:+.1f}%)"),
        *([] if cost_model is None else [f"  times priced by the {cost_model}"]),
        f"  eager peak {format_bytes(figures.eager_peak_bytes)}, static "
        f"{format_bytes(figures.static_bytes)}; solver {result.solver} ({result.status})",
        f"  the {min(PEAK_VALUES_NAMED, len(figures.peak.values))} largest values alive at the "
        f"peak ({format_bytes(figures.peak.device_bytes)}, step {figures.peak.step}"
        + ("" if result.fits else ", smallest-peak plan found")
        + "):",
        *("   " + line for line in peak_lines(figures.peak)),
    ]
    return "\n".join(lines)


def junit_xml(
    target: str, passed: bool, reason: str, rows: list[tuple[str, str]], time_s: float
) -> str:
    """The JUnit XML of one ``remat check``: a test case that failed with ``reason`` or passed,
    the report's rows as its output."""
    suite = ET.Element(
        "testsuite",
        name="remat.check",
        tests="1",
        failures="0" if passed else "1",
        errors="0",
        time=f"{time_s:.3f}",
    )
    case = ET.SubElement(
        suite, "testcase", classname="remat.check", name=target, time=f"{time_s:.3f}"
    )
    if not passed:
        fail = ET.SubElement(case, "failure", message=reason, type="RematCheckFailed")
        fail.text = "\n".join(f"{k}: {v}" for k, v in rows)
    out = ET.SubElement(case, "system-out")
    out.text = "\n".join(f"{k}: {v}" for k, v in rows)
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)
