"""A memory test as a project would write it: the training step must fit the budget.

Run with ``pytest examples/ci/test_memory_budget.py``; the ``remat_budget`` fixture comes from
remat's pytest plugin (installed with remat). The budget is the target device's memory: the
step is traced on fake tensors, so this runs on a CPU machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's examples/

from examples.models import gpt_demo

TIME_LIMIT_S = float(os.environ.get("REMAT_TIME_LIMIT", "60"))


def test_gpt_fits_half_its_activation_memory(remat_budget) -> None:  # type: ignore[no-untyped-def]
    model, inputs, loss_fn = gpt_demo()
    remat_budget.check(
        model, inputs, loss_fn, budget="50%", max_overhead=0.5, time_limit_s=TIME_LIMIT_S
    )
