"""Malformed requests answer 4xx naming the field, never 5xx.

Two fuzzers: schemathesis generates requests (valid and invalid) from the service's own OpenAPI
document; a hypothesis strategy breaks one field of a valid solve request at a time (wrong
types, unknown ids, cycles, huge numbers, negative budgets, truncated JSON) and checks that the
answer names that field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
import st_hooks  # noqa: F401  (registers the hook that makes generated graphs graphs)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
)
from service_harness import Server

from remat.ir import synthetic


def _operations() -> list[Any]:
    # The document the server publishes, built here without starting anything (no workers run
    # before the lifespan starts). schemathesis's pytest plugin is not used: it does not load
    # under the pytest in use; its hypothesis strategies are.
    from remat.api import Settings, create_app

    doc = create_app(Settings(db_url="memory://", workers=1)).openapi()
    return [r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations()]


OPERATIONS = _operations()


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_openapi_fuzz_never_5xx(op: Any, server: Server) -> None:
    # Also: what the document allows is accepted, and what it forbids is refused
    # (schemathesis's positive_data_acceptance and negative_data_rejection).
    cases = st.one_of(
        op.as_strategy(generation_mode=GenerationMode.POSITIVE),
        op.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )

    @given(cases)
    @settings(
        max_examples=12,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        response = case.call(base_url=server.url, timeout=60)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        checks = [not_a_server_error, positive_data_acceptance, negative_data_rejection]
        case.validate_response(response, checks=checks)

    run()


# -- targeted mutations -----------------------------------------------------------------------

GRAPH = synthetic.chain(3).model_dump(mode="json")
N_NODES = len(GRAPH["nodes"])
N_VALUES = len(GRAPH["values"])

WRONG = st.sampled_from([None, True, "x", [], {}, -1, 1.5, 10**40, -(10**40)])


def _mutations() -> st.SearchStrategy[tuple[str, Any]]:
    """(expected field path fragment, a mutated request body or raw bytes)."""

    def body(**over: Any) -> dict[str, Any]:
        return {"graph": json.loads(json.dumps(GRAPH)), "budget": "90%", **over}

    # A graph error names the field's path, or the element's id and the field in its message
    # ("value 'x': size_bytes must be >= 0"): "A|B" means both A and B must appear.
    def set_node(i: int, field: str, v: Any) -> tuple[str, Any]:
        b = body()
        b["graph"]["nodes"][i][field] = v
        return f"graph.nodes.{i}.{field}", b

    def set_value(i: int, field: str, v: Any) -> tuple[str, Any]:
        b = body()
        b["graph"]["values"][i][field] = v
        return f"graph.values.{i}.{field}", b

    def unknown_input(i: int, name: str) -> tuple[str, Any]:
        b = body()
        b["graph"]["nodes"][i]["inputs"] = [*b["graph"]["nodes"][i]["inputs"], "ghost-" + name]
        return "ghost-" + name, b

    def cycle(i: int) -> tuple[str, Any]:
        b = body()
        later = b["graph"]["nodes"][i + 1]["outputs"][0]
        b["graph"]["nodes"][i]["inputs"] = [*b["graph"]["nodes"][i]["inputs"], later]
        return b["graph"]["nodes"][i]["id"], b

    def truncated(n: int) -> tuple[str, Any]:
        raw = json.dumps(body()).encode()
        return "json_invalid", raw[: max(1, len(raw) * n // 100)]

    node_i = st.integers(0, N_NODES - 1)
    value_i = st.integers(0, N_VALUES - 1)
    return st.one_of(
        st.builds(lambda v: ("budget", body(budget=v)), WRONG.filter(lambda v: v != 1.5)),
        st.builds(lambda v: ("budget", body(budget=-v)), st.integers(1, 10**30)),
        st.builds(
            lambda v: ("time_limit_s", body(time_limit_s=v)), WRONG.filter(lambda v: v is not None)
        ),
        st.builds(lambda v: ("solver", body(solver=v)), st.sampled_from([1, [], "no-such"])),
        st.builds(lambda v: ("options", body(solver="none", options=v)), st.sampled_from([[], 3])),
        st.builds(
            lambda v: ("graph_id", {"graph_id": v, "budget": 1}),
            st.sampled_from(["short", "0" * 64, 7]),
        ),
        st.builds(
            set_node,
            node_i,
            st.sampled_from(["time_s", "flops", "workspace_bytes"]),
            st.sampled_from(["x", -5, [], 10**40]),
        ),
        st.builds(set_value, value_i, st.just("size_bytes"), st.sampled_from(["x", -5, 10**40])),
        st.builds(set_value, value_i, st.just("kind"), st.just("nonsense")),
        st.builds(unknown_input, node_i, st.text("abc", min_size=1, max_size=4)),
        st.builds(cycle, st.integers(0, N_NODES // 2 - 2)),
        st.builds(truncated, st.integers(1, 99)),
    )


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as h:
        yield h


@given(_mutations())
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_broken_field_is_named(http: httpx.Client, mutation: tuple[str, Any]) -> None:
    field, body = mutation
    alternatives = [field]
    if field.startswith("graph.") and not isinstance(body, bytes):
        _, kind, i, name = field.split(".")
        alternatives.append(f"{body['graph'][kind][int(i)]['id']}|{name}")
    if isinstance(body, bytes):
        r = http.post("/v1/solve", content=body, headers={"content-type": "application/json"})
    else:
        r = http.post("/v1/solve", json=body)
    assert 400 <= r.status_code < 500, r.text[:500]
    detail = r.json()["detail"]
    text = json.dumps(detail)
    if isinstance(detail, list):
        text += " " + " ".join(".".join(str(p) for p in d["loc"]) for d in detail)
    assert any(all(part in text for part in alt.split("|")) for alt in alternatives), detail
