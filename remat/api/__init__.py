"""The remat service: POST a graph, get a schedule.

    from remat.api import Settings, create_app
    app = create_app(Settings(db_url="sqlite:///remat.db", workers=4))

Routes live under ``/v1`` (graphs, solve, jobs, frontier, solvers) plus ``/healthz`` and the
OpenAPI document. ``remat serve`` runs it with uvicorn. Imports neither torch nor (until
``create_app`` or ``Settings`` is used) FastAPI, so :mod:`remat.api.schemas` serves the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remat.api.app import create_app
    from remat.api.settings import Settings, get_settings

__all__ = ["Settings", "create_app", "get_settings"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from remat.api.app import create_app

        return create_app
    if name in ("Settings", "get_settings"):
        from remat.api import settings

        return getattr(settings, name)
    raise AttributeError(f"module 'remat.api' has no attribute {name!r}")
