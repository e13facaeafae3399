"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from remat.api.service import Service


def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]

# Error answers documented on the routes (the bodies follow remat.api.errors).
ERRORS: dict[int | str, dict[str, str]] = {
    401: {"description": "API key missing or invalid"},
    413: {"description": "Body larger than max_body_bytes"},
    415: {"description": "The body is not JSON (Content-Type: application/json)"},
    422: {"description": "A field is invalid; `detail[].loc` names it"},
    429: {"description": "Queue full (max_queue)"},
    503: {"description": "The store is unavailable just now; retry after Retry-After seconds"},
}
