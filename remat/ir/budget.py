"""Budgets and byte quantities: ``"12GiB"``, ``"70%"``, ``0.7`` or a plain number of bytes."""

from __future__ import annotations

import math
import re

from remat.ir.graph import Graph

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

BudgetSpec = int | float | str


def parse_bytes(text: str | int) -> int:
    """``"12GiB"`` -> 12884901888; ``"1.5 GB"`` -> 1500000000; an int is returned unchanged.

    Raises
    ------
    ValueError
        When the text is not a non-negative quantity with a known unit.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a byte quantity: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte quantity must be >= 0, got {text}")
        return text
    m = _QUANTITY.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"not a byte quantity: {text!r} (use e.g. 1073741824, '1GiB', '512MiB', '2GB')"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"byte quantity too large: {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Binary units, three significant digits: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_BARE_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+\.)\s*$")


def _bare_number(text: str) -> int | float | None:
    """A budget written as a bare number (no unit, no ``%``): bytes when it is above 1, a
    fraction when it is below 1 or written ``1.0``; ``"1"`` could mean either and is refused.
    None when ``text`` is not a bare number."""
    m = _BARE_NUMBER.match(text)
    if not m:
        return None
    t = m.group(1)
    value = int(t) if t.isdigit() else float(t)
    if value == 1 and "." not in t:
        raise ValueError(
            f"budget: {text!r} could mean 1 byte or all of the eager peak; "
            'write "1B" for one byte or "100%" for the eager peak'
        )
    if 0 < value <= 1:
        return float(value)
    if value != int(value) or not math.isfinite(value):
        raise ValueError(
            f"budget: {text!r} is not a whole number of bytes "
            "(write a unit, e.g. '1.5GB', or a percentage, e.g. '70%')"
        )
    return int(value)


def parse_budget(spec: BudgetSpec) -> int | float:
    """Check a budget spec without its graph: bytes as an ``int``, or a fraction as a ``float``.

    ``12884901888``, ``"12GiB"``, ``"1e9"`` -> bytes; ``0.7``, ``"0.7"``, ``"70%"`` -> the
    fraction 0.7. Text without a unit is bytes when above 1 and a fraction when below 1 (or
    written ``"1.0"``); ``"1"``, which could mean either, is refused. What a fraction means
    needs the graph: see :func:`resolve_budget`.

    Raises
    ------
    ValueError
        Naming the spec when it is negative, out of range, ambiguous or unparseable.
    """
    if isinstance(spec, bool):
        raise ValueError(f"budget: not a budget: {spec!r}")
    if isinstance(spec, float):
        frac = spec
    elif isinstance(spec, str) and spec.strip().endswith("%"):
        try:
            frac = float(spec.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"budget: not a percentage: {spec!r}") from None
    else:
        if isinstance(spec, str):
            bare = _bare_number(spec)
            if isinstance(bare, int):
                return bare
            if bare is not None:
                return bare  # a fraction in (0, 1]
        try:
            return parse_bytes(spec)
        except ValueError as exc:
            raise ValueError(f"budget: {exc}") from None
    if not (math.isfinite(frac) and 0 < frac <= 1):
        raise ValueError(f"budget: a fraction must be in (0, 1], got {spec!r}")
    return frac


def resolve_budget(graph: Graph, spec: BudgetSpec) -> int:
    """Turn a budget spec into total device bytes (static + dynamic) for ``graph``.

    * an ``int`` or a quantity string (``"12GiB"``): that many bytes of device memory in all;
    * a fraction (a ``float`` in (0, 1], or a string ``"70%"``): the static bytes plus that
      fraction of the dynamic peak of the no-remat (eager) schedule. Fractions apply to the part a
      schedule can change, so ``1.0`` is exactly the eager peak.

    Raises
    ------
    ValueError
        Naming the spec when it is negative, out of range or unparseable.
    """
    budget = parse_budget(spec)
    if isinstance(budget, int):
        return budget
    from remat.ir.plan_builders import eager_plan
    from remat.ir.simulate import simulate

    return fraction_bytes(graph, budget, simulate(graph, eager_plan(graph)).peak_dynamic_bytes)


def fraction_bytes(graph: Graph, fraction: float, eager_peak_dynamic_bytes: int) -> int:
    """Total device bytes of a budget given as a fraction of the eager dynamic peak."""
    return graph.static_bytes + int(fraction * eager_peak_dynamic_bytes)
