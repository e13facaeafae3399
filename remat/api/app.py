"""The FastAPI application: :func:`create_app` wires settings, store, worker pool and routers."""

from __future__ import annotations

import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from remat._version import __version__
from remat.api import errors
from remat.api.jobs_worker import make_pool
from remat.api.limits import BodyLimit
from remat.api.openapi import install_openapi
from remat.api.queue import open_queue
from remat.api.routes import frontier, graphs, health, jobs, solve, solvers
from remat.api.service import Service
from remat.api.settings import Settings
from remat.api.store_factory import open_store

log = logging.getLogger("remat.api")

DESCRIPTION = """\
Post the graph of one training step, get back the cheapest keep/recompute/offload schedule that
fits a device-memory budget. Graphs are the JSON form of `remat.ir.Graph`; results are
`remat.solver.SolveResult`, whose figures are the simulator's.
"""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service, with its store opened and its worker pool started at application start-up.

    Parameters
    ----------
    settings
        Limits, database URL, API keys, worker count (default: :meth:`Settings.from_env`).

    Raises
    ------
    ValueError
        When ``settings.db_url`` names no supported store, or a plugin cannot be imported.
    """
    settings = settings if settings is not None else Settings.from_env()
    for name in settings.plugins:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"plugins: cannot import {name!r}: {exc}") from None
    store = open_store(settings.db_url, timeout_s=settings.store_timeout_s)
    pool = make_pool(settings)
    parser = make_pool(settings, settings.parse_workers)
    service = Service(settings, store, pool, open_queue(settings, store, pool), parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(
        title="remat",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.service = service
    errors.install(app)
    install_openapi(app, settings)
    for module in (graphs, solve, jobs, frontier, solvers, health):
        app.include_router(module.router)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        max_held_bytes=settings.held_body_limit_bytes,
    )
    if settings.cors_origins:  # off unless origins are listed: no browser page may call us
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "X-API-Key", "Content-Type"],
        )
    return app
