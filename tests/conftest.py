"""Shared test setup: ``tests/`` is importable (``import handmade``) and hypothesis profiles."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

# CI: a fixed, small, derandomized profile keeps the suite fast and reproducible.
settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def _session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("remat-cache")


@pytest.fixture
def remat_cache_dir(_session_cache_dir: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``REMAT_CACHE_DIR`` set, for this test, to one directory shared by the tests of a session
    (of an xdist worker) that need the local CPU's profile but not a fresh measurement of it:
    measured once (2-5 s), not per test, and never in the user's own ``~/.cache/remat``."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(_session_cache_dir))
    return _session_cache_dir


@pytest.fixture
def tiny_llama() -> Any:
    """A one-layer Llama from transformers (random weights seeded with 0, grouped-query
    attention, vocabulary 64, 16 positions) in training mode; skipped without transformers."""
    T = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return T.LlamaForCausalLM(cfg).train()
