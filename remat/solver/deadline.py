"""Deadlines that solver internals check as they work, with a clock that tests can replace.

A solver turns its time limit into a :class:`Deadline` once and hands it (or a share of it)
to every step that can take long: the chain DP checks it per sub-chain end, the MILP's start
scan every thousand steps, the LP rounding between roundings. A step that runs out raises
:class:`Expired`; the solver then returns the best it has. Tests inject a clock that advances
per call (counted work), so time limits are tested without wall-clock thresholds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]

SIM_S_PER_NODE = 4e-4
"""Seconds to expand and simulate one plan, per node of the graph, on a loaded core (measured
on the 192-layer synthetic transformer): what a solver keeps back from its search for that."""


def judging_s(num_nodes: int, plans: int = 2) -> float:
    """Time to keep for building and simulating ``plans`` plans of a graph of ``num_nodes``."""
    return plans * SIM_S_PER_NODE * num_nodes


class Expired(Exception):
    """A step ran past its deadline."""


@dataclass(frozen=True)
class Deadline:
    """A point in time on ``clock`` (None: no limit)."""

    at: float | None
    clock: Clock = field(default=time.monotonic, compare=False)

    @classmethod
    def after(cls, limit_s: float | None, clock: Clock = time.monotonic) -> Deadline:
        """The deadline ``limit_s`` seconds from now on ``clock`` (None: no limit)."""
        return cls(None if limit_s is None else clock() + limit_s, clock)

    def left_s(self) -> float:
        """Seconds left (``inf`` without a limit; negative once passed)."""
        return math.inf if self.at is None else self.at - self.clock()

    def expired(self) -> bool:
        return self.at is not None and self.clock() >= self.at

    def check(self, what: str) -> None:
        """Raise :class:`Expired` (naming ``what``) once the deadline has passed."""
        if self.expired():
            raise Expired(f"{what} ran past its deadline")

    def share(self, fraction: float, *, reserve_s: float = 0.0) -> Deadline:
        """A deadline ``fraction`` of the time left from now, less ``reserve_s`` (kept for the
        work after the step: expanding and simulating its plan)."""
        if self.at is None:
            return self
        now = self.clock()
        left = max(0.0, self.at - now - reserve_s)
        return Deadline(now + fraction * left, self.clock)

    def earlier(self, other: Deadline) -> Deadline:
        """The earlier of two deadlines on the same clock."""
        if other.at is None:
            return self
        if self.at is None or other.at < self.at:
            return other
        return self
