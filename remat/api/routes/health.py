"""``/healthz``: liveness and whether the store can be written; open without a key."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from remat._version import __version__
from remat.api.deps import ServiceDep
from remat.api.errors import RETRY_AFTER_S
from remat.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    response_model=Health,
    responses={503: {"model": Health, "description": "The store cannot be written"}},
)
async def healthz(service: ServiceDep) -> JSONResponse:
    """The worker pool's state, and whether the store can be written (503 when not)."""
    ok, why = service.health.ok, service.health.message
    pool = service.pool
    body = Health(
        status="ok" if ok else "unavailable",
        store="ok" if ok else "unavailable",
        message=why,
        version=__version__,
        workers=pool.size,
        busy_workers=pool.busy,
        queued=pool.waiting,
    )
    headers = {} if ok else {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503, headers=headers)
