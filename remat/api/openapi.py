"""The OpenAPI document as the running service behaves.

* The schemas of the bodies that :mod:`remat.api.body` parses itself are added (FastAPI does
  not see them, since those routes read the raw body).
* The API-key schemes are declared, on the ``/v1`` routes, only when the service has keys:
  a keyless service asks for none, and a client generated from its document sends none.
* "``graph`` or ``graph_id``, exactly one" is stated in the request schemas as a ``oneOf``;
  ``solver`` is one of the registered names and ``options`` are that solver's (one ``Options_*``
  schema per solver, from :mod:`remat.api.options`).
* The bounds the service enforces on a graph's numbers are stated on their fields.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from remat import solver as solvers
from remat.api import options as solver_options
from remat.api.body import documented_models
from remat.api.schemas import MAX_BYTES, MAX_FLOPS, MAX_TIME_S
from remat.api.settings import Settings

# The bounds the service enforces on a graph's numbers (remat.api.schemas.check_magnitudes),
# stated where a client can see them.
_BOUNDS: dict[tuple[str, str], dict[str, Any]] = {
    ("Graph", "static_bytes"): {"minimum": 0, "maximum": MAX_BYTES},
    ("Value", "size_bytes"): {"minimum": 0, "maximum": MAX_BYTES},
    ("Node", "workspace_bytes"): {"minimum": 0, "maximum": MAX_BYTES},
    ("Node", "time_s"): {"minimum": 0, "maximum": MAX_TIME_S},
    ("Node", "flops"): {"minimum": 0, "maximum": MAX_FLOPS},
    ("DeviceProfile", "memory_bandwidth_bytes_per_s"): {"exclusiveMinimum": 0, "maximum": 1e30},
    ("DeviceProfile", "host_bandwidth_bytes_per_s"): {"exclusiveMinimum": 0, "maximum": 1e30},
    ("HostLink", "device_to_host_bytes_per_s"): {"exclusiveMinimum": 0, "maximum": 1e30},
    ("HostLink", "host_to_device_bytes_per_s"): {"exclusiveMinimum": 0, "maximum": 1e30},
    ("HostLink", "latency_s"): {"minimum": 0, "maximum": MAX_TIME_S},
    ("HostLink", "host_memory_bytes"): {"minimum": 0, "maximum": MAX_BYTES},
}

_ONE_GRAPH = {
    "oneOf": [
        {"required": ["graph"], "not": {"required": ["graph_id"]}},
        {"required": ["graph_id"], "not": {"required": ["graph"]}},
    ]
}


def _per_solver_options(schemas: dict[str, Any]) -> None:
    """``solver`` is one of the registered names, and ``options`` are that solver's."""
    by_solver = solver_options.schemas()
    for name, schema in by_solver.items():
        schemas[_ref_name(name)] = schema
    default = solvers.default_solver()
    variants: list[dict[str, Any]] = [
        {
            "properties": {
                "solver": {"const": name},
                "options": {"$ref": f"#/components/schemas/{_ref_name(name)}"},
            },
            "required": ["solver"],
        }
        for name in by_solver
    ]
    variants.append(
        {
            "properties": {
                "solver": {"type": "null"},
                "options": {"$ref": f"#/components/schemas/{_ref_name(default)}"},
            }
        }
    )
    for model in ("SolveRequest", "FrontierRequest"):
        if model not in schemas:
            continue
        props = schemas[model]["properties"]
        props["solver"] = {
            "anyOf": [{"type": "string", "enum": sorted(by_solver)}, {"type": "null"}],
            "default": None,
            "description": f"A registered solver (GET /v1/solvers); default {default!r}.",
        }
        props["options"] = {
            "type": "object",
            "default": {},
            "description": "Options of the named solver: see the Options_* schemas.",
        }
        rules = [{"oneOf": schemas[model].pop("oneOf")}] if "oneOf" in schemas[model] else []
        schemas[model]["allOf"] = [*rules, {"oneOf": variants}]


def _limits(schemas: dict[str, Any], settings: Settings) -> None:
    """The request limits of this service's settings."""
    for model in ("SolveRequest", "FrontierRequest"):
        t = schemas.get(model, {}).get("properties", {}).get("time_limit_s")
        if t is not None:
            for alt in t.get("anyOf", []):
                if alt.get("type") == "number":
                    alt.update({"exclusiveMinimum": 0, "maximum": settings.max_time_limit_s})
    budgets = schemas.get("FrontierRequest", {}).get("properties", {}).get("budgets")
    if budgets is not None:
        for alt in budgets.get("anyOf", []):
            if alt.get("type") == "array":
                alt.update({"minItems": 1, "maxItems": settings.max_frontier_points})


def _ref_name(solver: str) -> str:
    return "Options_" + "".join(c if c.isalnum() else "_" for c in solver)


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Make ``app.openapi()`` describe the service as configured by ``settings``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        _, defs = models_json_schema(
            [(m, "validation") for m in documented_models()],
            ref_template="#/components/schemas/{model}",
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        for name in ("SolveRequest", "FrontierRequest"):
            if name in schemas:
                schemas[name].update(_ONE_GRAPH)
                props = schemas[name]["properties"]
                # Absent or set, never null (remat.api.schemas.GraphRef).
                props["graph"] = {"$ref": "#/components/schemas/Graph"}
                props["graph_id"] = next(
                    (v for v in props["graph_id"].get("anyOf", []) if v.get("type") == "string"),
                    props["graph_id"],
                )
        _per_solver_options(schemas)
        _limits(schemas, settings)
        for (model, field), bounds in _BOUNDS.items():
            if model in schemas and field in schemas[model].get("properties", {}):
                schemas[model]["properties"][field].update(bounds)
        device = schemas.get("DeviceProfile", {}).get("properties", {})
        if "peak_flops_per_s" in device:
            device["peak_flops_per_s"]["additionalProperties"] = {
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": 1e30,
            }
        if not settings.api_keys:
            doc["components"].pop("securitySchemes", None)
            for item in doc.get("paths", {}).values():
                for op in item.values():
                    if isinstance(op, dict):
                        op.pop("security", None)
                        op.get("responses", {}).pop("401", None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
