"""``/v1/graphs``: store a graph by content hash, read its summary."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from remat.api.auth import Owner
from remat.api.body import Parsed, documented, parsed
from remat.api.deps import ERRORS, ServiceDep
from remat.api.schemas import GraphSummary
from remat.ir import Graph

router = APIRouter(prefix="/v1/graphs", tags=["graphs"], responses=ERRORS)


@router.post(
    "",
    response_model=GraphSummary,
    status_code=201,
    responses={200: {"model": GraphSummary, "description": "Already stored: the same id"}},
    openapi_extra=documented(Graph),
)
async def create_graph(
    body: Annotated[Parsed, Depends(parsed("graph"))],
    owner: Owner,
    service: ServiceDep,
    response: Response,
) -> GraphSummary:
    """Store a graph under the sha256 of its canonical JSON; posting it again returns the same
    id (status 200 instead of 201)."""
    assert body.graph is not None
    gid = body.graph.id
    summary, created = await service.put_graph(owner, body.graph)
    if not created:
        response.status_code = 200
    response.headers["Location"] = f"/v1/graphs/{gid}"
    return GraphSummary(id=gid, created=created, **summary)


@router.get(
    "/{graph_id}", response_model=GraphSummary, responses={404: {"description": "No such graph"}}
)
async def read_graph(
    graph_id: Annotated[str, Path(max_length=200)], owner: Owner, service: ServiceDep
) -> GraphSummary:
    """The summary of a stored graph: nodes, values, static bytes, no-remat peak."""
    summary = await service.graph_summary(owner, graph_id)
    return GraphSummary(id=graph_id, **summary)
