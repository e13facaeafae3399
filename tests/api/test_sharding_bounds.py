"""Graphs carrying a sharding description (issue 25) at the service: out-of-range numbers are a
422 naming the field, extreme values inside the bounds are solved, never a 5xx.

The first landing of issue 25 was reverted because the service fuzzers answered 5xx on such
graphs (bucket sizes of 10**34 bytes, latencies of 1e307 s, world sizes as floats); each case
they found is here as an explicit example.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from service_harness import Server

from remat.ir import synthetic
from remat.ir.shard import shard_graph
from remat.ir.sharding import ShardingSpec


def _body(sharding: dict[str, Any], device_link: dict[str, Any] | None = None) -> dict[str, Any]:
    graph = synthetic.chain(3).model_dump(mode="json")
    graph["sharding"] = sharding
    if device_link is not None:
        graph["device"]["interconnect"] = device_link
    return {"graph": graph, "budget": "90%", "solver": "sqrt"}


@pytest.mark.parametrize(
    ("sharding", "device_link", "field"),
    [
        (
            {"world_size": 2, "first_bucket_bytes": 17511237789001022595701956711284736},
            None,
            "first_bucket_bytes",
        ),
        (
            {"world_size": 2, "strategy": "ddp", "bucket_cap_bytes": 2**60 + 1},
            None,
            "bucket_cap_bytes",
        ),
        ({"world_size": 1e300}, None, "world_size"),
        ({"world_size": 276.5}, None, "world_size"),
        ({"world_size": 2**20 + 1}, None, "world_size"),
        ({"world_size": 0}, None, "world_size"),
        (
            {"world_size": 2, "interconnect": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e307}},
            None,
            "latency_s",
        ),
        (
            {"world_size": 2, "interconnect": {"bandwidth_bytes_per_s": 1e-300}},
            None,
            "bandwidth_bytes_per_s",
        ),
        ({"world_size": 2}, {"bandwidth_bytes_per_s": 1e300}, "bandwidth_bytes_per_s"),
        ({"world_size": 2}, {"bandwidth_bytes_per_s": 1e9, "latency_s": 2.0}, "latency_s"),
        ({"world_size": 2, "units": ["\u0013."]}, None, "units"),
        ({"world_size": 2, "reduce_dtype": "\u0093\n\u00bb"}, None, "reduce_dtype"),
        ({"world_size": 2, "strategy": "ddp", "units": ["a"]}, None, "units"),
    ],
)
def test_out_of_range_is_422_naming_the_field(
    server: Server, sharding: dict[str, Any], device_link: dict[str, Any] | None, field: str
) -> None:
    for path in ("/v1/solve", "/v1/graphs"):
        body = _body(sharding, device_link)
        r = httpx.post(server.url + path, json=body if path == "/v1/solve" else body["graph"])
        assert r.status_code == 422, (path, r.text[:500])
        text = r.text
        assert field in text, (path, text[:500])


@pytest.mark.parametrize(
    "sharding",
    [
        # The largest values the schema allows, on its slowest link.
        {
            "world_size": 2**20,
            "strategy": "ddp",
            "bucket_cap_bytes": 2**60,
            "first_bucket_bytes": 2**60,
            "gradient_as_bucket_view": True,
            "interconnect": {"bandwidth_bytes_per_s": 1.0, "latency_s": 1.0},
        },
        {
            "world_size": 276.0,
            "units": ["stages.0", "no.such.module"],
            "param_dtype": "float8_e5m2",
            "reduce_dtype": "torch.float64",
            "interconnect": {"bandwidth_bytes_per_s": 1e30},
        },
        {"world_size": 1},
    ],
)
def test_extreme_valid_specs_are_solved(server: Server, sharding: dict[str, Any]) -> None:
    body = _body(sharding, {"bandwidth_bytes_per_s": 1.0, "latency_s": 1.0})
    r = httpx.post(server.url + "/v1/graphs", json=body["graph"])
    assert r.status_code < 300, r.text[:500]
    r = httpx.post(server.url + "/v1/solve", json=body, timeout=60)
    assert r.status_code < 300, r.text[:500]


def test_a_sharded_graph_is_solved_per_rank(server: Server) -> None:
    # A graph made by shard_graph at the largest group on the slowest link (collective nodes
    # of the longest finite times) solves like any other.
    g = synthetic.transformer(1, d_model=16, num_heads=2, seq_len=8, batch_size=1, vocab_size=16)
    slow = {"bandwidth_bytes_per_s": 1.0, "latency_s": 1e-6}
    s = shard_graph(
        g,
        ShardingSpec.model_validate(
            {"world_size": 64, "units": ["layers.0"], "interconnect": slow}
        ),
    )
    body = {"graph": s.model_dump(mode="json"), "budget": "90%", "solver": "sqrt"}
    r = httpx.post(server.url + "/v1/solve", json=body, timeout=60)
    assert r.status_code < 300, r.text[:500]
