"""``remat solvers``: the registered solvers, locally (plugins included) or a service's."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from remat.cli_common import EXIT_OK, BadInput, print_table, service_client


def cmd_solvers(args: argparse.Namespace) -> int:
    """The registered solvers (locally, or a service's with --url); one solver's options."""
    import importlib

    from remat.solver import solver_listing

    if args.url:
        if args.name:
            raise BadInput("NAME: a solver's options are listed locally only (drop --url)")
        with service_client(args) as c:
            listed = c.solvers().model_dump()
    else:
        for module in args.plugin or ():
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise BadInput(f"--plugin: cannot import {module!r}: {exc}") from None
        if args.name:
            return _solver_options(args.name, args.json)
        listed = solver_listing()
    if args.json:
        print(json.dumps(listed, indent=1))
        return EXIT_OK
    entries = listed["solvers"]
    width = max(len(e["name"]) for e in entries)
    for e in entries:
        mark = " (default)" if e["name"] == listed["default"] else ""
        exact = ", exact" if e["exact"] else ""
        print(f"  {e['name']:<{width}}  [{e['kind']}{exact}] {e['summary']}{mark}")
        if e["options"]:
            print(f"  {'':<{width}}  options: {', '.join(e['options'])}")
    return EXIT_OK


def _solver_options(name: str, as_json: bool) -> int:
    """``remat solvers NAME``: the solver's options with their defaults and descriptions."""
    from remat import solver as solvers

    if name not in solvers.available():
        raise BadInput(f"NAME: no solver {name!r} (registered: {', '.join(solvers.available())})")
    si = solvers.info(name)
    model = si.options_model
    schema = model.model_json_schema() if model is not None else {"properties": {}}
    if as_json:
        print(json.dumps({"name": name, "summary": si.summary, "options": schema}, indent=1))
        return EXIT_OK
    print(f"remat solvers: {name} ({si.kind}{', exact' if si.exact else ''}): {si.summary}")
    props: dict[str, Any] = schema.get("properties", {})
    if not props:
        opts = solvers.user_options(si)
        print("  options: " + (", ".join(opts) if opts else "none"))
        return EXIT_OK
    rows = []
    for opt, spec in props.items():
        text = spec.get("description", "")
        if spec.get("default") is not None:
            text += f" (default {json.dumps(spec['default'])})"
        rows.append((opt, text))
    print_table(rows, sys.stdout)
    return EXIT_OK
