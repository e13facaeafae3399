"""``/healthz``: liveness, open without a key."""

from __future__ import annotations

from fastapi import APIRouter

from remat import __version__
from remat.api.deps import ServiceDep
from remat.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz(service: ServiceDep) -> Health:
    pool = service.pool
    return Health(
        status="ok",
        version=__version__,
        workers=pool.size,
        busy_workers=pool.busy,
        queued=pool.waiting,
    )
