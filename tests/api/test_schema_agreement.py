"""The OpenAPI document and the server agree on what a request may be (schemathesis's
positive_data_acceptance and negative_data_rejection, on the cases it found).

* JSON Schema counts a whole-number float (``4096.0``) as an integer: the server takes it for
  an integer field (graph sizes, integer solver options) and as bytes for a budget;
* every budget string the pattern admits is one the budget parser takes, and the ones it
  refuses (``"1"``, ``"46.5"`` without a unit, exotic spaces) the server refuses too.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from service_harness import Server

from remat.api.options import whole_numbers
from remat.api.parse import parse_body
from remat.api.schemas import BUDGET_PATTERN, SolveRequest
from remat.ir import parse_budget, synthetic

GID = "0" * 64


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.from_regex(BUDGET_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 40))
def test_every_budget_the_pattern_admits_parses(text: str) -> None:
    parse_budget(text)
    SolveRequest(graph_id=GID, budget=text)


@pytest.mark.parametrize("text", ["1", "01", "46.5483", "1.5", "100\x1f%", "\x0b760592000"])
def test_budgets_outside_the_pattern_are_refused(text: str) -> None:
    with pytest.raises(ValidationError, match="budget"):
        SolveRequest(graph_id=GID, budget=text)


def test_a_whole_number_float_budget_is_bytes() -> None:
    assert SolveRequest(graph_id=GID, budget=34258123.0).budget == 34258123
    assert SolveRequest(graph_id=GID, budget=0.0).budget == 0
    assert SolveRequest(graph_id=GID, budget=1.0).budget == 1.0  # both forms: the fraction
    with pytest.raises(ValidationError, match="fraction"):
        SolveRequest(graph_id=GID, budget=2.5)


def test_whole_number_floats_in_a_graph_are_integers() -> None:
    g = synthetic.chain(3).model_dump(mode="json")
    g["static_bytes"] = float(g["static_bytes"] + 8)
    g["values"][0]["size_bytes"] = float(g["values"][0]["size_bytes"])
    g["nodes"][0]["flops"] = 12.0
    out = parse_body("graph", json.dumps(g).encode(), 1000, 1000)
    assert "invalid" not in out, out
    stored = json.loads(out["graph"]["text"])
    assert stored["static_bytes"] == int(g["static_bytes"]) and stored["nodes"][0]["flops"] == 12
    # not whole, or not a number: still refused, each naming its field
    g["values"][1]["size_bytes"] = 2.5
    g["nodes"][1]["flops"] = True
    bad = parse_body("graph", json.dumps(g).encode(), 1000, 1000)["invalid"]
    assert {tuple(e["loc"]) for e in bad} == {
        ("body", "values", 1, "size_bytes"),
        ("body", "nodes", 1, "flops"),
    }


def test_whole_number_floats_for_integer_options() -> None:
    assert whole_numbers("milp", {"threads": 2.0}) == {"threads": 2}
    assert type(whole_numbers("lp-round", {"samples": 64.0})["samples"]) is int
    assert whole_numbers("milp", {"threads": 2.5})["threads"] == 2.5  # refused later
    assert whole_numbers("milp", {"threads": True})["threads"] is True


def test_the_server_takes_whole_number_floats(server: Server) -> None:
    body = {
        "graph": synthetic.chain(4).model_dump(mode="json"),
        "budget": 10.0**9,
        "solver": "chen-greedy",
        "options": {"num_thresholds": 8.0},
    }
    r = httpx.post(server.url + "/v1/solve", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["budget_bytes"] == 10**9
    for wrong in (8.5, True, "8"):
        body["options"] = {"num_thresholds": wrong}
        r = httpx.post(server.url + "/v1/solve", json=body, timeout=120)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"][:3] == ["body", "options", "num_thresholds"], r.text
