"""Each solver's options as a strict pydantic model: checked in the server, shown in OpenAPI.

Registered solvers declare a typed, bounded model (``SolverInfo.options_model``), which the
service applies through ``SolverInfo.check_options`` before any work (422 naming the option). A
plugin solver registered without one gets a strict model derived from its keyword parameters
(annotations and defaults): unknown names and wrong types (``"yes"`` for a ``bool``, ``true``
for an ``int``) are refused the same way.
The same model's JSON schema is what ``/openapi.json`` shows for that solver.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from remat import solver as solvers
from remat.api.errors import ApiError


@functools.cache
def options_model(name: str) -> type[BaseModel]:
    """The model of solver ``name``'s options: the solver's own typed, bounded one, or (for a
    plugin registered without one) a strict model derived from its signature."""
    si = solvers.info(name)
    if si.options_model is not None:
        return si.options_model
    try:
        hints = typing.get_type_hints(si.fn)
    except Exception:  # an annotation that does not resolve: no types, names only
        hints = {}
    params = inspect.signature(si.fn).parameters
    fields: dict[str, Any] = {}
    for opt in si.options:
        if opt == solvers.PROGRESS_OPTION or opt not in params:
            continue
        default = params[opt].default
        hint = hints.get(opt, Any)
        fields[opt] = (hint, ... if default is inspect.Parameter.empty else default)
    title = "Options_" + "".join(c if c.isalnum() else "_" for c in name)
    config = ConfigDict(extra="forbid", strict=True, title=title, frozen=True)
    return create_model(title, __config__=config, **fields)


def check(name: str, options: dict[str, Any]) -> None:
    """422 naming the first option of ``options`` that solver ``name`` does not accept (for
    solvers with their own options model, its check runs in the service right after)."""
    if solvers.info(name).options_model is not None:
        return
    try:
        # As JSON, the form it came in: strict, yet a list is a tuple and 1 is a float.
        options_model(name).model_validate_json(json.dumps(options))
    except ValidationError as exc:
        raise ApiError(
            422,
            [
                {
                    "loc": ["body", "options", *e["loc"]],
                    "msg": f"solver {name!r}: {e['msg']}",
                    "type": e["type"],
                }
                for e in exc.errors()
            ],
        ) from None


@functools.cache
def _integer_options(name: str) -> frozenset[str]:
    """Options of solver ``name`` whose schema admits integers and no other numbers."""
    out: set[str] = set()
    for opt, schema in options_model(name).model_json_schema().get("properties", {}).items():
        types = {schema.get("type")} | {a.get("type") for a in schema.get("anyOf", [])}
        if "integer" in types and "number" not in types:
            out.add(opt)
    return frozenset(out)


def whole_numbers(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with each whole-number float (``4.0``) of an integer option made an ``int``.

    JSON Schema, and so the OpenAPI document, counts ``4.0`` as an integer; the solvers'
    strict models would refuse it. Booleans and strings stay refused.
    """
    ints = _integer_options(name)
    return {
        k: int(v) if k in ints and isinstance(v, float) and v.is_integer() else v
        for k, v in options.items()
    }


def schemas() -> dict[str, dict[str, Any]]:
    """JSON schema of each registered solver's options, by solver name."""
    out: dict[str, dict[str, Any]] = {}
    for name in solvers.available():
        schema = options_model(name).model_json_schema()
        schema.pop("title", None)
        schema["description"] = f"Options of solver {name!r} (GET /v1/solvers)."
        out[name] = schema
    return out
