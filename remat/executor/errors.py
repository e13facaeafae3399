"""The executors' one error type."""

from __future__ import annotations

from remat.ir import RematError


class ExecutorError(RematError, ValueError):
    """A plan cannot be run on this model (the message says why and what to do)."""
