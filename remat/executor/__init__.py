"""Run plans on real models, and measure the memory of real training steps.

``measure`` loads torch; this package is imported lazily by ``remat``.
"""

from remat.executor.measure import LiveStorageTracker, MemoryMeasurement, measure

__all__ = ["LiveStorageTracker", "MemoryMeasurement", "measure"]
