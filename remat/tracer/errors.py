"""The tracer's error type."""

from __future__ import annotations

from remat.ir.errors import RematError


class TraceError(RematError, ValueError):
    """The model could not be traced. ``op`` and ``module`` name where, when known."""

    def __init__(self, message: str, *, op: str | None = None, module: str | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.module = module
