"""Request bodies: JSON only, checked against the limits, parsed off the event loop.

FastAPI validates a declared body on the event loop; a large graph (tens of MB, up to
``max_body_bytes``) takes long enough to stall every other request, health checks included.
Routes that take a body therefore read it raw and hand it to :func:`parsed`, which refuses
anything but JSON (415: a browser's ``text/plain`` or form post never reaches a route) and has
:mod:`remat.api.parse` check and parse it in a parser process; :func:`documented` keeps the
schema in the OpenAPI document. Errors keep FastAPI's shape: 422 with ``loc`` starting at
``"body"``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from remat.api.errors import ApiError
from remat.api.parse import INLINE_BYTES, BodyKind, GraphPayload, parse_body
from remat.api.pool import QueueFull, WorkerCrashed, WorkerTimeout
from remat.api.schemas import FrontierRequest, SolveRequest

_DOCUMENTED: list[type[BaseModel]] = []
PARSE_TIME_LIMIT_S = 60.0


@dataclass(frozen=True)
class Parsed:
    """A checked body: the request without its inline graph (which ``graph`` then holds)."""

    request: SolveRequest | FrontierRequest | None
    graph: GraphPayload | None


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def require_json(request: Request) -> None:
    """415 unless the body is declared as JSON."""
    ct = request.headers.get("content-type", "")
    if not is_json(ct):
        raise ApiError(
            415,
            f"the body must be JSON (Content-Type: application/json), not {ct or 'undeclared'!r}",
        )


def parsed(kind: BodyKind) -> Callable[[Request], Awaitable[Parsed]]:
    """A dependency that returns the checked body of a ``kind`` request."""

    async def dependency(request: Request) -> Parsed:
        require_json(request)
        # The chunks as they came, never joined here: a join copies the whole body on the event
        # loop (Request.body() does, even for one chunk), and the parser process joins them.
        chunks = [c async for c in request.stream() if c]
        service = request.app.state.service
        s = service.settings
        if sum(map(len, chunks)) <= INLINE_BYTES:
            out = parse_body(kind, b"".join(chunks), s.max_nodes, s.max_values)
        else:
            task = {
                "kind": "parse",
                "body_kind": kind,
                "body": chunks,
                "max_nodes": s.max_nodes,
                "max_values": s.max_values,
            }
            try:
                out = await service.parser.run(task, time_limit_s=PARSE_TIME_LIMIT_S)
            except QueueFull as exc:
                raise ApiError(429, str(exc), {"Retry-After": "1"}) from None
            except WorkerCrashed as exc:
                raise ApiError(500, f"parsing the body failed: {exc}") from None
            except WorkerTimeout:
                raise ApiError(413, "the body took too long to parse") from None
        if "error" in out:  # the parser ran out of memory (worker_memory_bytes)
            raise ApiError(413, str(out["error"]["msg"]))
        if "invalid" in out:
            raise ApiError(422, out["invalid"])
        graph = None if out["graph"] is None else GraphPayload(**out["graph"])
        req: SolveRequest | FrontierRequest | None = None
        if out["request"] is not None:
            model = SolveRequest if kind == "solve" else FrontierRequest
            req = model.model_validate(out["request"])
        return Parsed(req, graph)

    dependency.__name__ = f"parse_{kind}"
    return dependency


def documented_models() -> list[type[BaseModel]]:
    return list(_DOCUMENTED)


def documented(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    if model not in _DOCUMENTED:
        _DOCUMENTED.append(model)
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
