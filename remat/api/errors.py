"""How the service answers problems: one JSON shape, the field or limit named, never a trace.

``{"detail": "message"}`` for 401/404/409/413/415/429/5xx (503 with ``Retry-After`` while the
store is unavailable) and ``{"detail": [{"loc": [...], "msg":
..., "type": ...}]}`` for 422, the shape FastAPI uses for its own validation errors.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from remat.api.store import StoreUnavailable

log = logging.getLogger("remat.api")

RETRY_AFTER_S = 5


class ApiError(Exception):
    """An answer other than success; ``detail`` is a message or a list of field errors."""

    def __init__(
        self,
        status_code: int,
        detail: str | list[dict[str, Any]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail if isinstance(detail, str) else str(detail))
        self.status_code = status_code
        self.detail = detail
        self.headers = headers


def field_error(loc: Sequence[str | int], msg: str, type_: str = "value_error") -> ApiError:
    """A 422 naming one field (``loc`` is its path, starting with ``"body"`` or ``"path"``)."""
    return ApiError(422, [{"loc": list(loc), "msg": msg, "type": type_}])


def _clean(errors: Sequence[Any]) -> list[dict[str, Any]]:
    # FastAPI echoes the offending input, which may be a whole graph: keep loc, msg and type.
    return [
        {
            "loc": list(e.get("loc", ())),
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in errors
    ]


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method the OpenAPI document lists at this request's path."""
    table: list[tuple[re.Pattern[str], list[str]]] | None = getattr(app.state, "allow", None)
    if table is None:
        table = []
        for path, item in app.openapi().get("paths", {}).items():
            rx = re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(path)) + "$")
            table.append((rx, sorted(m.upper() for m in item if m != "parameters")))
        app.state.allow = table
    return sorted({m for rx, ms in table if rx.match(request.url.path) for m in ms})


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the shapes above."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            {"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(StoreUnavailable)
    async def _store(request: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("store unavailable on %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse(
            {"detail": "the store is unavailable just now; retry later"},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _clean(exc.errors())}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names the methods of the first route matching the path only.
            headers["Allow"] = ", ".join(allowed_methods(app, request))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500
        )
