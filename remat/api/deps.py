"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from remat.api.service import Service


def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description=(
            "A key the client makes for one request (a UUID): sent again with the same "
            "request, it answers with the job the first one made, never a second job, so a "
            "request whose answer was lost can be sent again safely"
        ),
    ),
]

# Error answers documented on the routes (the bodies follow remat.api.errors).
ERRORS: dict[int | str, dict[str, str]] = {
    401: {"description": "API key missing or invalid"},
    413: {"description": "Body larger than max_body_bytes"},
    415: {"description": "The body is not JSON (Content-Type: application/json)"},
    422: {"description": "A field is invalid; `detail[].loc` names it"},
    429: {"description": "Queue full (max_queue)"},
    503: {"description": "The store is unavailable just now; retry after Retry-After seconds"},
}
