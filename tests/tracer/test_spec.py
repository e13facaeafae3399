"""``trace_spec("MODULE:FUNCTION")`` (what ``remat trace`` calls) and optimizer state sizing."""

from __future__ import annotations

import os

import pytest
import torch

from examples.models import build_mlp
from remat.tracer import load_spec, optimizer_state_bytes, trace, trace_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "examples", "models.py")


def test_spec_by_file_path_and_by_module(monkeypatch) -> None:
    by_path = trace_spec(f"{MODELS}:build_mlp")
    monkeypatch.chdir(ROOT)
    by_module = trace_spec("examples.models:build_mlp")
    assert by_path.content_hash() == by_module.content_hash()
    assert by_path.name == "MLP"


def test_spec_functions_may_return_two_items(tmp_path) -> None:
    src = tmp_path / "selfloss.py"
    src.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.w = torch.nn.Parameter(torch.ones(3))\n"
        "    def forward(self, x):\n"
        "        return (self.w * x).pow(2).sum()\n"
        "def build():\n"
        "    return M(), (torch.randn(3),)\n"
    )
    g = trace_spec(f"{src}:build")
    assert len(g.required) == 2
    _model, inputs, loss_fn = load_spec(f"{src}:build")
    assert loss_fn is None and isinstance(inputs, tuple)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("examples/models.py", "MODULE:FUNCTION"),
        ("no/such/file.py:build", "no such file"),
        ("remat_no_such_module:build", "cannot import"),
        (f"{MODELS}:no_such_function", "no function"),
        (f"{MODELS}:BUILDERS", "no function"),
    ],
)
def test_bad_specs_are_value_errors(spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        load_spec(spec)


def test_spec_must_return_a_model(tmp_path) -> None:
    src = tmp_path / "bad.py"
    src.write_text("def build():\n    return 1, 2\n")
    with pytest.raises(ValueError, match=r"not an nn\.Module"):
        load_spec(f"{src}:build")


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_optimizer_state_is_static(optimizer: type[torch.optim.Optimizer]) -> None:
    # AdamW's defaults hold Adam's decoupled_weight_decay, which AdamW() refused (TraceError)
    model, inputs, loss_fn = build_mlp(batch=4, in_features=8, hidden=16, depth=2)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    opt = optimizer(model.parameters(), lr=1e-3)
    estimated = optimizer_state_bytes(opt, model)
    # What one real step creates: exp_avg and exp_avg_sq per parameter plus a step counter.
    loss_fn(model(*inputs)).backward()
    opt.step()
    real = sum(
        t.untyped_storage().nbytes()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    assert estimated == real
    assert 2 * param_bytes <= real <= 2 * param_bytes + 8 * len(list(model.parameters()))
    plain = trace(model, inputs, loss_fn)
    with_opt = trace(model, inputs, loss_fn, optimizer=opt)
    assert with_opt.static_bytes == plain.static_bytes + real
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert optimizer_state_bytes(sgd, model) == param_bytes
