"""The checks that need a GPU, as one script for a lent device: each prints one JSON line and
all are written to ``$OUT/gpu.json`` (or ``/tmp``).

* ``apply_50`` / ``op_30``: transformers' GPT-2 (4 layers, 256 wide, batch 8 x 256 tokens) on
  CUDA, ``remat.verify`` of ``auto``'s plan with ``remat.apply`` at 50% and the op executor at
  30%: predicted against measured peak (``torch.cuda.max_memory_allocated``), gradients.
* ``checkpoint_offload_40``: the checkpoint class with offloaded blocks (pinned host memory,
  the copy streams of ``remat.executor.offload_blocks``), traced for the ``h100`` profile.
* ``inductor_30_gpt2`` / ``inductor_30_llama``: ``remat.backend`` with inductor (Triton) at 30%
  on ``benchmarks/compile.py``'s models: the replay of the generated code against the measured
  peak, the tries, gradients.

Run from the repository root: ``python benchmarks/gpu_check.py`` (``SMALL=1`` for tiny models,
``NOCOMPILE=1`` to skip the inductor cases; on the CPU it checks the script itself). Where the
GPU machine lacks remat's dependencies, carry them as wheels (pydantic, pydantic-core,
annotated-types, typing-inspection, typing-extensions, pulp, highspy) and put them on
``PYTHONPATH``. Each case is reported, errors included; nothing is asserted.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import remat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = bool(os.environ.get("SMALL"))
OUT = Path(os.environ.get("OUT", "/tmp"))
results: dict[str, Any] = {}


def check(name: str, case: Callable[[], dict[str, Any]]) -> None:
    """Run one case; record its figures or its error, and save all so far."""
    t0 = time.perf_counter()
    try:
        got = case()
    except Exception as exc:
        got = {"error": repr(exc)[:800], "traceback": traceback.format_exc()[-2500:]}
    got["seconds"] = round(time.perf_counter() - t0, 1)
    results[name] = got
    print(name, json.dumps(got, default=str)[:1500], flush=True)
    (OUT / "gpu.json").write_text(json.dumps(results, indent=1, default=str))


def gpt2() -> tuple[nn.Module, tuple[torch.Tensor], None]:
    from examples.models import build_causal_lm

    layers, embd, vocab, batch, seq = (2, 64, 512, 2, 32) if SMALL else (4, 256, 8192, 8, 256)
    model, (ids,), _ = build_causal_lm(
        "gpt2", batch=batch, seq=seq, vocab=vocab, hidden=embd, layers=layers, positions=seq
    )
    return model.to(DEVICE), (ids.to(DEVICE),), None


def verify_case(budget: str, run_with: str, **solve_kw: Any) -> dict[str, Any]:
    model, inputs, loss_fn = gpt2()
    target = {"target": "h100"} if run_with == "checkpoint" else {}
    graph = remat.trace(model, inputs, loss_fn, **target)
    result = remat.solve(graph, budget, time_limit_s=10, **solve_kw)
    report = remat.verify(model, inputs, loss_fn, result, executor=run_with)
    return {
        "ok": report.ok(),
        "predicted_peak_bytes": report.predicted_peak_bytes,
        "measured_peak_bytes": report.measured_peak_bytes,
        "dynamic_error": report.dynamic_error,
        "budget_bytes": result.budget_bytes,
        "status": str(result.status),
        "message": str(result.message)[:300],
        "report": str(report),
    }


def compile_case(name: str) -> dict[str, Any]:
    from compile import MODELS

    from remat.executor.compile.run import compiled_step, eager_reference

    model, inputs, loss_fn = MODELS[name]()
    model = model.to(DEVICE)
    inputs = tuple(x.to(DEVICE) for x in inputs)
    ref = eager_reference(model, inputs, loss_fn, time_repeats=3)
    budget = ref.memory.static_bytes + int(0.3 * ref.memory.peak_dynamic_bytes)
    be = remat.backend(budget, compiler="inductor", time_limit_s=30, cost="h100")
    run = compiled_step(model, inputs, loss_fn, be, ref, time_repeats=3)
    (plan,) = be.plans.values()
    return {
        "budget": budget,
        "measured": run.memory.peak_bytes,
        "predicted": plan.predicted_peak_bytes,
        "fx_sim": plan.simulated_peak_bytes,
        "fits": run.memory.peak_bytes <= budget,
        "grad_diff": run.max_grad_diff,
        "op_level": plan.op_level,
        "tries": plan.inductor_tries,
        "eager_peak": ref.memory.peak_bytes,
        "step_x": run.step_time_s / ref.step_time_s if ref.step_time_s else None,
    }


def main() -> None:
    warnings.simplefilter("ignore")
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    results["env"] = {"torch": torch.__version__, "device": name}
    print(results["env"], flush=True)
    check("apply_50", lambda: verify_case("50%", "apply"))
    check("op_30", lambda: verify_case("30%", "op"))
    check(
        "checkpoint_offload_40",
        lambda: verify_case("40%", "checkpoint", executor="checkpoint", offload=True),
    )
    if not os.environ.get("NOCOMPILE"):
        check("inductor_30_gpt2", lambda: compile_case("gpt2"))
        check("inductor_30_llama", lambda: compile_case("llama"))
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
