"""torch.compile with remat's partition: ``torch.compile(model, backend=remat.backend(budget))``.

* :class:`RematBackend` (``remat.backend(...)`` builds one with a remat solver as its seed,
  :mod:`remat.torch_compile`): AOT autograd with remat's partition function. Each
  joint graph is mapped to the IR (:mod:`~remat.executor.compile.joint`), solved under the
  budget in the class the partitioner can express (which forward values are saved for the
  backward; the rest is recomputed there, :mod:`~remat.executor.compile.partition`), split into
  forward and backward graphs with torch's helpers (:mod:`~remat.executor.compile.split`) and
  compiled by inductor, ``aot_eager`` or the user's compiler. Where no saved set fits, the
  seed's op-level plan runs as the two graphs (:mod:`~remat.executor.compile.plan_split`:
  values recomputed several times, where the plan places them).
* :class:`RematKnapsack`: the same search as a ``CustomKnapsackSolver`` for torch's own
  partitioner (``torch._functorch.config.activation_memory_budget_solver``).
* :func:`measure_compiled`: the CPU storage tracker on compiled code.
"""

from remat.executor.compile.dynamo import GraphPlan, RematBackend, RematCompileWarning, SeedFn
from remat.executor.compile.knapsack import RematKnapsack
from remat.executor.compile.memory import CompiledStorageTracker, measure_compiled

__all__ = [
    "CompiledStorageTracker",
    "GraphPlan",
    "RematBackend",
    "RematCompileWarning",
    "RematKnapsack",
    "SeedFn",
    "measure_compiled",
]
