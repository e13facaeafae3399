"""Tracer tests need torch; ``examples`` is importable from the repository root."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
