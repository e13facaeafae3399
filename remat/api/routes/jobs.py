"""``/v1/jobs``: submit a solve to run in the background, poll it, list, cancel."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Response

from remat.api.auth import Owner
from remat.api.body import Parsed, documented, parsed
from remat.api.deps import ERRORS, IdempotencyKey, ServiceDep
from remat.api.schemas import JobList, JobResponse, SolveRequest
from remat.api.service import job_json, job_response

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERRORS)

JobId = Annotated[str, Path(max_length=200)]
NOT_FOUND: dict[int | str, dict[str, str]] = {404: {"description": "No such job (for this key)"}}


@router.post(
    "",
    response_model=JobResponse,
    status_code=202,
    responses=NOT_FOUND,
    openapi_extra=documented(SolveRequest),
)
async def create_job(
    body: Annotated[Parsed, Depends(parsed("solve"))],
    owner: Owner,
    service: ServiceDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """Accept a solve as a job whatever its time limit; poll ``GET /v1/jobs/{id}``."""
    assert isinstance(body.request, SolveRequest)
    prepared = await service.prepare_solve(owner, body.request, body.graph)
    return await service.answer(owner, prepared, as_job=True, idempotency_key=idempotency_key)


@router.get("", response_model=JobList)
async def list_jobs(
    owner: Owner, service: ServiceDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> JobList:
    """The caller's jobs, newest first (without results; fetch one job for its result)."""
    recs = await service.jobs(owner, limit)
    return await asyncio.to_thread(
        lambda: JobList(jobs=[job_response(r, full=False) for r in recs])
    )


@router.get("/{job_id}", response_model=JobResponse, responses=NOT_FOUND)
async def read_job(job_id: JobId, owner: Owner, service: ServiceDep) -> Response:
    """Status; while running, the best plan so far with its bound and gap; when done, the
    result; when failed, the reason."""
    return job_json(await service.job(owner, job_id))


@router.delete(
    "/{job_id}",
    response_model=JobResponse,
    responses={**NOT_FOUND, 409: {"description": "The job has already finished"}},
)
async def cancel_job(job_id: JobId, owner: Owner, service: ServiceDep) -> Response:
    """Cancel a queued or running job (its solver is stopped on whichever worker runs it)."""
    return job_json(await service.cancel(owner, job_id))
