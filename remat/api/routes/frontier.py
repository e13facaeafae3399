"""``/v1/frontier``: the budget/time trade-off curve of a graph."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from remat.api.auth import Owner
from remat.api.body import Parsed, documented, parsed
from remat.api.deps import ERRORS, IdempotencyKey, ServiceDep
from remat.api.schemas import FrontierRequest, FrontierResponse, JobResponse

router = APIRouter(prefix="/v1", tags=["frontier"], responses=ERRORS)


@router.post(
    "/frontier",
    response_model=FrontierResponse,
    responses={
        202: {"model": JobResponse, "description": "Total time limit above the cap: a job"},
        404: {"description": "Unknown graph_id"},
    },
    openapi_extra=documented(FrontierRequest),
)
async def frontier(
    body: Annotated[Parsed, Depends(parsed("frontier"))],
    owner: Owner,
    service: ServiceDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """Solve at each budget (default: 100% down to 10% of the no-remat peak) and return the
    simulator's peak and time for each. ``time_limit_s`` is per budget; when the total exceeds
    ``sync_time_limit_s`` the answer is 202 with a job."""
    assert isinstance(body.request, FrontierRequest)
    prepared = await service.prepare_frontier(owner, body.request, body.graph)
    return await service.answer(owner, prepared, as_job=False, idempotency_key=idempotency_key)
