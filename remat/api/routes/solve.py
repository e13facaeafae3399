"""``/v1/solve``: one graph, one budget; the answer directly, or a job for long solves."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse

from remat.api.auth import Owner
from remat.api.body import documented, parsed
from remat.api.deps import ERRORS, ServiceDep, SettingsDep
from remat.api.schemas import JobResponse, SolveRequest, SolveResponse
from remat.api.service import job_response

router = APIRouter(prefix="/v1", tags=["solve"], responses=ERRORS)


def wrap(graph_id: str, key: str, cached: bool, result_json: str) -> Response:
    """The response body around a stored result, without parsing it again."""
    head = f'{{"graph_id":"{graph_id}","request_key":"{key}","cached":{str(cached).lower()},'
    return Response(head + f'"result":{result_json}}}', media_type="application/json")


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
    req: Annotated[SolveRequest, Depends(parsed(SolveRequest))],
    owner: Owner,
    service: ServiceDep,
    settings: SettingsDep,
) -> Response:
    """Solve a graph (inline or by id) at a budget. Identical requests are answered from the
    store (``cached: true``). A time limit above ``sync_time_limit_s`` answers 202 with a job."""
    gid, key, task, t = await service.prepare_solve(owner, req, settings)
    hit = await service.cached(key)
    if hit is not None:
        return wrap(gid, key, True, hit)
    if t > settings.sync_time_limit_s:
        rec = await service.submit(owner, "solve", gid, key, task, t)
        return JSONResponse(
            job_response(rec).model_dump(mode="json"),
            status_code=202,
            headers={"Location": f"/v1/jobs/{rec.id}"},
        )
    return wrap(gid, key, False, await service.run_now(task, key, t))
