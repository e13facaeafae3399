"""``/v1/solvers``: the registry, as the service sees it."""

from __future__ import annotations

from fastapi import APIRouter

from remat.api.auth import Owner
from remat.api.deps import ERRORS
from remat.api.schemas import SolverList
from remat.api.tasks import solver_list

router = APIRouter(prefix="/v1", tags=["solvers"], responses=ERRORS)


@router.get("/solvers", response_model=SolverList)
async def list_solvers(owner: Owner) -> SolverList:
    """Registered solvers with what they model and the options they accept."""
    return solver_list()
