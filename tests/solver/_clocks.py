"""Clocks for deadline tests: time that advances with each reading, not with the wall."""

from __future__ import annotations


class CountingClock:
    """Advances one unit per reading; counts the readings."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads)
