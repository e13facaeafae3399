"""Run plans on real models, and measure the memory of real training steps.

``measure`` loads torch; this package is imported lazily by ``remat``.
"""

from remat.executor.autograd import PlannedStep, apply, planned_steps
from remat.executor.measure import LiveStorageTracker, MemoryMeasurement, measure
from remat.executor.module import ModuleLevelWarning, apply_checkpoint, module_plan, remove
from remat.executor.opexec import CompiledStep, ExecutorError, compile_step
from remat.executor.verify import VerifyReport, verify

__all__ = ["LiveStorageTracker", "MemoryMeasurement", "measure"]
__all__ += ["CompiledStep", "ExecutorError", "VerifyReport", "compile_step", "verify"]
__all__ += ["ModuleLevelWarning", "PlannedStep", "apply", "apply_checkpoint", "module_plan"]
__all__ += ["planned_steps", "remove"]
