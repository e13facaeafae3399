"""schemathesis hooks: generated graphs obey the rules JSON Schema cannot state.

A graph's ids refer to each other (a node's ``inputs`` and ``outputs``, ``required``, a value's
``producer`` and ``eager_free_after``), ids are unique, a value is made by one node before it is read, and only leaves
(inputs, parameters) and buffers have no producer. The OpenAPI document states every rule on
single fields, but none of these, so a schema-valid graph from a generator is almost never a
graph; the service refuses it with a 422 naming the id, and schemathesis's
``positive_data_acceptance`` would count that as a schema-valid request rejected.

For *positive* cases only, :func:`consistent` mends each generated graph the least it can (it
drops dangling references and duplicate ids, gives a value the kind its producer implies, makes
a device's host link offload at the profile's host bandwidth), and each ``Idempotency-Key`` is
made one no earlier request sent, so the check asks what it should: is every graph the schema
allows accepted? Negative cases are left as generated. Loaded by ``SCHEMATHESIS_HOOKS=st_hooks`` (with ``tests/api`` on the path)
for ``st run``, and by importing this module for the strategies in test_fuzz.py.
"""

from __future__ import annotations

import itertools
from typing import Any

import schemathesis
from schemathesis import GenerationMode

from remat.ir.graph import LEAF_KINDS


def _ids(items: list[Any]) -> list[dict[str, Any]]:
    seen: set[Any] = set()
    out = []
    for it in items:
        if isinstance(it, dict) and it.get("id") not in seen:
            seen.add(it.get("id"))
            out.append(it)
    return out


def consistent(graph: dict[str, Any]) -> dict[str, Any]:
    """``graph`` (a schema-valid JSON object) with its references made consistent."""
    g = dict(graph)
    values = _ids(list(g.get("values") or []))
    nodes = _ids(list(g.get("nodes") or []))
    known = {v["id"] for v in values}
    made_by: dict[str, int] = {}
    for i, n in enumerate(nodes):
        outs: list[str] = []
        for o in n.get("outputs") or []:
            if o in known and o not in made_by and o not in outs:
                outs.append(o)
                made_by[o] = i
        nodes[i] = {**n, "outputs": outs}
    for i, n in enumerate(nodes):
        ins = [x for x in n.get("inputs") or [] if x in known and made_by.get(x, -1) < i]
        nodes[i] = {**n, "inputs": ins}
    at = {n["id"]: i for i, n in enumerate(nodes)}
    for j, v in enumerate(values):
        v = dict(v)
        late = v.get("eager_free_after")
        if late is not None and (late not in at or at[late] < made_by.get(v["id"], -1)):
            v.pop("eager_free_after")  # a node that does not exist, or runs before the producer
        kind = v.get("kind", "activation")
        if v["id"] in made_by:
            if kind in LEAF_KINDS:
                v["kind"] = "activation"
            v["producer"] = nodes[made_by[v["id"]]]["id"]
        else:
            if kind not in LEAF_KINDS and kind != "buffer":
                v["kind"] = "input"
            v.pop("producer", None)
        values[j] = v
    g["values"], g["nodes"] = values, nodes
    if "required" in g:
        g["required"] = [r for r in g["required"] if r in known]
    device = g.get("device")
    if isinstance(device, dict) and isinstance(device.get("host_link"), dict):
        # DeviceProfile: a host link's offload rate is the profile's host bandwidth (one
        # figure stated twice, equal; JSON Schema cannot tie one field to another).
        rate = device.get("host_bandwidth_bytes_per_s")
        link = device["host_link"]
        if rate is not None and "device_to_host_bytes_per_s" in link:
            g["device"] = {**device, "host_link": {**link, "device_to_host_bytes_per_s": rate}}
    return g


_sent = itertools.count()


def _fresh_key(key: str) -> str:
    """An Idempotency-Key no other request of this run sent: a key sent again with another
    request is refused (422) by design, a rule between requests that no schema states."""
    return f"{key[:180]}.{next(_sent):x}"


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    meta = case.meta
    if meta is None or meta.generation.mode != GenerationMode.POSITIVE:
        return case
    headers = case.headers or {}
    for name in [h for h in headers if h.lower() == "idempotency-key"]:
        if isinstance(headers[name], str):
            headers[name] = _fresh_key(headers[name])
    body = case.body
    if not isinstance(body, dict):
        return case
    if case.path.endswith("/v1/graphs") and case.method.upper() == "POST":
        case.body = consistent(body)
    elif isinstance(body.get("graph"), dict):
        case.body = {**body, "graph": consistent(body["graph"])}
    return case
