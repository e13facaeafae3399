"""Request bodies parsed and validated off the event loop.

FastAPI validates a declared body on the event loop; a large graph (tens of MB, up to
``max_body_bytes``) takes long enough to stall every other request, health checks included.
Routes that take a graph therefore read the raw body and validate it in a thread with
:func:`parsed`, and document it with :func:`documented` so the OpenAPI document still shows the
schema (clients and fuzzers rely on it). Errors keep FastAPI's shape: 422 with ``loc`` starting
at ``"body"``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

M = TypeVar("M", bound=BaseModel)

_DOCUMENTED: list[type[BaseModel]] = []


def parsed(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A dependency that returns the request body as ``model``, validated in a thread."""

    async def dependency(request: Request) -> M:
        raw = await request.body()
        try:
            return await asyncio.to_thread(model.model_validate_json, raw)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            raise RequestValidationError(errors) from None

    dependency.__name__ = f"parse_{model.__name__}"
    return dependency


def documented(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    if model not in _DOCUMENTED:
        _DOCUMENTED.append(model)
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` include the schemas of the documented bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        _, defs = models_json_schema(
            [(m, "validation") for m in _DOCUMENTED], ref_template="#/components/schemas/{model}"
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
