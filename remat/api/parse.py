"""Request bodies checked against the limits before they are parsed, and parsed in a worker.

A body that carries a graph is parsed in a parser process of its own pool (not on the server's
event loop, not in one of its threads, which would hold the GIL): there the node and value
counts are read from the raw bytes first (``"op":`` and ``"size_bytes":`` keys, which nothing
but nodes and values has, cannot occur unescaped inside a JSON string), so an oversized graph is
refused before anything is built. Only then is the body validated, strictly (``true`` is not an
integer), and the graph checked for magnitudes, hashed and summarised. The server gets back
small things: the request without its graph, the graph's id, canonical text and summary.

Bodies of at most :data:`INLINE_BYTES` take the same path in the server itself: at that size
the whole job costs well under a millisecond, less than the round trip to a parser.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from remat.api.schemas import FrontierRequest, SolveRequest, check_magnitudes
from remat.ir import Graph, eager_plan, simulate

BodyKind = Literal["graph", "solve", "frontier"]
INLINE_BYTES = 8 * 1024

_MODELS: dict[str, type[BaseModel]] = {
    "graph": Graph,
    "solve": SolveRequest,
    "frontier": FrontierRequest,
}
_NODE_KEY = re.compile(rb'"op"\s*:')
_VALUE_KEY = re.compile(rb'"size_bytes"\s*:')


@dataclass(frozen=True)
class GraphPayload:
    """A validated graph as the store keeps it: content hash, canonical JSON, summary."""

    id: str
    text: str
    summary: dict[str, Any]


def graph_summary(graph: Graph) -> dict[str, Any]:
    """The stored summary of a graph, with the no-remat (eager) peak."""
    s = graph.summary()
    s["no_remat_peak_bytes"] = simulate(graph, eager_plan(graph)).peak_bytes
    return s


def _error(loc: list[str | int], msg: str, type_: str) -> dict[str, Any]:
    return {"loc": loc, "msg": msg, "type": type_}


def _counts(body: bytes, at: list[str | int], max_nodes: int, max_values: int) -> list[Any]:
    nodes = len(_NODE_KEY.findall(body))
    if nodes > max_nodes:
        msg = f"the graph has {nodes} nodes, more than the limit max_nodes={max_nodes}"
        return [_error([*at, "nodes"], msg, "limit.max_nodes")]
    values = len(_VALUE_KEY.findall(body))
    if values > max_values:
        msg = f"the graph has {values} values, more than the limit max_values={max_values}"
        return [_error([*at, "values"], msg, "limit.max_values")]
    return []


def _whole_float_ints(exc: ValidationError) -> list[tuple[Any, ...]]:
    """Where strict parsing refused a whole-number float (``2.0``) for an integer field."""
    return [
        tuple(e["loc"])
        for e in exc.errors()
        if e["type"] == "int_type" and isinstance(e.get("input"), float) and e["input"].is_integer()
    ]


def _validate(model: type[BaseModel], body: bytes) -> BaseModel:
    """Strict validation (``true`` is no integer, ``"1"`` no number), except that a whole-number
    float is an integer, as JSON Schema (and so the OpenAPI document) has it: ``4096.0`` for
    ``size_bytes`` is 4096. Such a body is rare, so only a refused one is read a second time,
    with those numbers made integers."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        locs = _whole_float_ints(exc)
        if not locs:
            raise
        doc = json.loads(body)
        for loc in locs:
            *path, last = loc
            at = doc
            for k in path:
                at = at[k]
            at[last] = int(at[last])
        return model.model_validate_json(json.dumps(doc), strict=True)


def parse_body(kind: BodyKind, body: bytes, max_nodes: int, max_values: int) -> dict[str, Any]:
    """Check and parse one body: ``{"invalid": [field errors]}`` or ``{"request": dict | None,
    "graph": {"id", "text", "summary"} | None}`` (the request without its inline graph, which
    it then names by ``graph_id``)."""
    at: list[str | int] = ["body"] if kind == "graph" else ["body", "graph"]
    errs = _counts(body, at, max_nodes, max_values)
    if errs:
        return {"invalid": errs}
    try:
        obj = _validate(_MODELS[kind], body)
    except ValidationError as exc:
        return {
            "invalid": [
                _error(["body", *e["loc"]], str(e["msg"]), str(e["type"])) for e in exc.errors()
            ]
        }
    graph = obj if isinstance(obj, Graph) else getattr(obj, "graph", None)
    payload: dict[str, Any] | None = None
    if graph is not None:
        problems = check_magnitudes(graph, tuple(str(p) for p in at))
        if problems:
            return {"invalid": [p.model_dump() for p in problems]}
        text = graph.canonical_json()
        payload = {
            "id": hashlib.sha256(text.encode()).hexdigest(),
            "text": text,
            "summary": graph_summary(graph),
        }
    request = None
    if not isinstance(obj, Graph):
        request = obj.model_dump(mode="json", exclude={"graph"})
        if payload is not None:
            request["graph_id"] = payload["id"]
    return {"request": request, "graph": payload}
