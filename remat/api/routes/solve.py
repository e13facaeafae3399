"""``/v1/solve``: one graph, one budget; the answer directly, or a job for long solves."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response

from remat.api.auth import Owner
from remat.api.body import Parsed, documented, parsed
from remat.api.deps import ERRORS, IdempotencyKey, ServiceDep
from remat.api.schemas import JobResponse, SolveRequest, SolveResponse

router = APIRouter(prefix="/v1", tags=["solve"], responses=ERRORS)


@router.post(
    "/solve",
    response_model=SolveResponse,
    responses={
        202: {"model": JobResponse, "description": "Time limit above the synchronous cap: a job"},
        404: {"description": "Unknown graph_id"},
    },
    openapi_extra=documented(SolveRequest),
)
async def solve(
    body: Annotated[Parsed, Depends(parsed("solve"))],
    owner: Owner,
    service: ServiceDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """Solve a graph (inline or by id) at a budget. Identical requests are answered from the
    store (``cached: true``). A time limit above ``sync_time_limit_s`` answers 202 with a job."""
    assert isinstance(body.request, SolveRequest)
    prepared = await service.prepare_solve(owner, body.request, body.graph)
    return await service.answer(owner, prepared, as_job=False, idempotency_key=idempotency_key)
