"""``/v1/solvers``: the registry, as the service sees it."""

from __future__ import annotations

from fastapi import APIRouter

from remat import solver as solvers
from remat.api.auth import Owner
from remat.api.deps import ERRORS
from remat.api.schemas import SolverDescription, SolverList
from remat.api.tasks import PROGRESS_OPTION

router = APIRouter(prefix="/v1", tags=["solvers"], responses=ERRORS)


@router.get("/solvers", response_model=SolverList)
async def list_solvers(owner: Owner) -> SolverList:
    """Registered solvers with what they model and the options they accept."""
    names = solvers.available()
    default = solvers.default_solver()
    out = []
    for name in names:
        si = solvers.info(name)
        out.append(
            SolverDescription(
                name=name,
                kind=si.kind,
                exact=si.exact,
                summary=si.summary,
                options=[o for o in si.options if o != PROGRESS_OPTION],
            )
        )
    return SolverList(default=default, solvers=out)
