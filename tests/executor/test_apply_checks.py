"""What remat.apply can tell when it is called, before any step: a plan applied to another
model, with another loss_fn than the trace's, or in checkpoint mode over a cache it cannot
replay is refused with the fix, never at the first backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.executor import ExecutorError


def _mlp(hidden: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


X = torch.randn(2, 4)


def test_a_result_knows_its_graph_and_apply_uses_it() -> None:
    model = _mlp()
    graph = remat.trace(model, X, loss_fn)
    assert graph.traced_with_loss_fn is True
    result = remat.solve(graph, "100%")
    assert result.graph is graph
    remat.apply(model, result, loss_fn=loss_fn)  # no graph passed: the result's is used
    loss = model(X)
    loss.backward()
    assert loss.shape == () and all(p.grad is not None for p in model.parameters())


def test_a_loss_fn_other_than_the_traces_is_refused_at_apply() -> None:
    model = _mlp()
    with_loss = remat.solve(remat.trace(model, X, loss_fn), "100%")
    with pytest.raises(ExecutorError, match=r"traced with a loss_fn.*pass the same loss_fn="):
        remat.apply(model, with_loss)
    without = remat.solve(remat.trace(model, X), "100%")
    assert without.graph is not None and without.graph.traced_with_loss_fn is False
    with pytest.raises(ExecutorError, match="traced without a loss_fn"):
        remat.apply(model, without, loss_fn=loss_fn)
    # a graph read back from JSON does not know: the first call's capture checks the step
    back = remat.Graph.from_json(with_loss.graph.to_json())  # type: ignore[union-attr]
    assert back.traced_with_loss_fn is None


def test_another_model_is_refused_at_apply() -> None:
    result = remat.solve(remat.trace(_mlp(), X, loss_fn), "100%")
    with pytest.raises(ExecutorError, match=r"another model.*only in the model \[\(3, 5\)"):
        remat.apply(_mlp(hidden=5), result, loss_fn=loss_fn)


def test_checkpoint_mode_refuses_a_cache_it_cannot_replay(tiny_llama: Any) -> None:
    """transformers decoders default to use_cache=True and pass a DynamicCache to each layer
    even in training; a checkpoint region that recomputes would append to it again."""
    model = tiny_llama
    assert model.config.use_cache  # the default
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}

    def own_loss(out: Any) -> torch.Tensor:
        return out.loss

    graph = remat.trace(model, batch, own_loss)
    result = remat.solve(graph, "90%", executor="checkpoint")
    assert result.fits and result.figures is not None and result.figures.recompute_time_s > 0
    remat.apply(model, result, mode="checkpoint")
    with pytest.raises(ExecutorError, match=r"key/value cache.*use_cache = False"):
        model(input_ids=ids, labels=ids)  # the config's default: a cache is built
    model(**batch).loss.backward()  # with the cache off the same plan trains
