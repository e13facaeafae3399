"""``/healthz``: liveness and whether the store can be written; open without a key."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from remat import __version__
from remat.api.deps import ServiceDep
from remat.api.errors import RETRY_AFTER_S
from remat.api.schemas import Health
from remat.api.service import Service
from remat.api.store import StoreUnavailable

router = APIRouter(tags=["health"])

_PROBE_EVERY_S = 1.0  # at most one write probe a second, however often health is asked


async def _store_ok(service: Service) -> tuple[bool, str]:
    cached = getattr(service, "_health_probe", None)
    now = time.monotonic()
    if cached is not None and now - cached[0] < _PROBE_EVERY_S:
        return cached[1], cached[2]
    try:
        await asyncio.wait_for(
            asyncio.to_thread(service.store.ping), service.settings.store_timeout_s + 1
        )
        ok, why = True, ""
    except (StoreUnavailable, TimeoutError) as exc:
        ok, why = False, str(exc) or "the store did not answer in time"
    service._health_probe = (time.monotonic(), ok, why)  # type: ignore[attr-defined]
    return ok, why


@router.get(
    "/healthz",
    response_model=Health,
    responses={503: {"model": Health, "description": "The store cannot be written"}},
)
async def healthz(service: ServiceDep) -> JSONResponse:
    """The worker pool's state, and whether the store can be written (503 when not)."""
    ok, why = await _store_ok(service)
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
