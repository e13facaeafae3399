"""Graph validation: every rule raises GraphValidationError naming the offending id."""

from __future__ import annotations

import json
from typing import Any

import pytest
from handmade import chain_step

from remat.ir import Graph, GraphValidationError, Node, Value
from remat.ir.synthetic import transformer


def base() -> dict[str, Any]:
    return chain_step().model_dump(mode="json")


def node(d: dict[str, Any], node_id: str) -> dict[str, Any]:
    return next(n for n in d["nodes"] if n["id"] == node_id)


def value(d: dict[str, Any], value_id: str) -> dict[str, Any]:
    return next(v for v in d["values"] if v["id"] == value_id)


def broken(edit: Any) -> dict[str, Any]:
    d = base()
    edit(d)
    return d


CASES = [
    ("unknown input", lambda d: node(d, "f2")["inputs"].append("ghost"), "ghost"),
    ("unknown output", lambda d: node(d, "f2")["outputs"].append("phantom"), "phantom"),
    ("unknown producer", lambda d: value(d, "a1").update(producer="nobody"), "nobody"),
    ("producer mismatch", lambda d: value(d, "a1").update(producer="f2"), "'a1'"),
    ("unknown required", lambda d: d["required"].append("missing_grad"), "missing_grad"),
    ("cycle", lambda d: node(d, "f1")["inputs"].append("a2"), "'f1' -> 'f2' -> 'f1'"),
    ("self loop", lambda d: node(d, "f2")["inputs"].append("a2"), "'f2'"),
    ("two producers", lambda d: node(d, "f2")["outputs"].append("a1"), "'a1' has two producers"),
    ("negative size", lambda d: value(d, "a2").update(size_bytes=-1), "'a2'"),
    ("negative time", lambda d: node(d, "b2").update(time_s=-0.5), "'b2'"),
    ("nan time", lambda d: node(d, "b2").update(time_s=float("nan")), "'b2'"),
    ("negative flops", lambda d: node(d, "b1").update(flops=-3), "'b1'"),
    ("negative workspace", lambda d: node(d, "f1").update(workspace_bytes=-8), "'f1'"),
    ("duplicate node", lambda d: d["nodes"].append(dict(node(d, "f1"), outputs=[])), "duplicate node id 'f1'"),
    ("duplicate value", lambda d: d["values"].append(dict(value(d, "a1"))), "duplicate value id 'a1'"),
    ("required never produced", lambda d: (
        d["values"].append({"id": "orphan_grad", "size_bytes": 4, "kind": "gradient"}),
        d["required"].append("orphan_grad"),
    ), "required value 'orphan_grad' is produced by no node"),
    ("activation without producer", lambda d: d["values"].append(
        {"id": "floating", "size_bytes": 4, "kind": "activation"}), "'floating'"),
    ("param with producer", lambda d: node(d, "f1")["outputs"].append("w2"), "'w2'"),
    ("negative static", lambda d: d.update(static_bytes=-1), "static_bytes"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "edit", "needle"), CASES, ids=[c[0] for c in CASES])
def test_validation_names_the_offender(name: str, edit: Any, needle: str) -> None:
    d = broken(edit)
    for build in (Graph.from_dict, lambda x: Graph.from_json(json.dumps(x)), lambda x: Graph(**x)):
        with pytest.raises(GraphValidationError) as info:
            build(d)
        assert needle in str(info.value), str(info.value)


def test_out_of_order_is_not_called_a_cycle() -> None:
    d = base()
    d["nodes"][0], d["nodes"][1] = d["nodes"][1], d["nodes"][0]
    with pytest.raises(
        GraphValidationError, match="'f2' reads value 'a1' before its producer 'f1'"
    ):
        Graph.from_dict(d)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"nodes": [{"id": 3}]}', "nodes.0.id"),
        ('{"nodes": [], "values": [{"id": "v", "size_bytes": "big"}]}', "values.0.size_bytes"),
        ('{"nodes": [], "values": [], "surprise": 1}', "surprise"),
        ('{"nodes": [', "json"),
        ('{"schema_version": 99}', "schema_version"),
        ('{"values": [{"id": "v", "size_bytes": 1, "kind": "weird"}]}', "values.0.kind"),
    ],
)
def test_malformed_json_names_the_field(text: str, needle: str) -> None:
    with pytest.raises(GraphValidationError) as info:
        Graph.from_json(text)
    assert needle in str(info.value).lower()


def test_json_round_trip_and_content_hash() -> None:
    g = transformer(2, d_model=32, seq_len=8, batch_size=2, vocab_size=64, num_heads=2)
    text = g.to_json()
    g2 = Graph.from_json(text)
    assert g2 == g
    assert g2.content_hash() == g.content_hash()
    assert json.loads(text)["schema_version"] == 1
    # Any change of content changes the hash.
    d = g.model_dump(mode="json")
    d["static_bytes"] += 1
    assert Graph.from_dict(d).content_hash() != g.content_hash()


def test_producer_is_derived_and_lookups_work() -> None:
    g = chain_step()
    assert g.producer_of("a1") is not None and g.producer_of("a1").id == "f1"  # type: ignore[union-attr]
    assert g.producer_of("x") is None
    assert [n.id for n in g.consumers_of("a1")] == ["f2", "b2"]
    assert g.is_static("w1") and g.is_static("gw1") and not g.is_static("g1")
    assert g.input_bytes == 10
    assert g.summary()["num_backward_nodes"] == 3
    with pytest.raises(KeyError, match="ghost"):
        g.node("ghost")


def test_empty_graph_is_valid() -> None:
    g = Graph()
    assert g.num_nodes == 0 and g.summary()["static_bytes"] == 0
    assert Graph.from_json(g.to_json()) == g


def test_values_are_frozen() -> None:
    v = Value(id="a", size_bytes=1)
    with pytest.raises(Exception, match="frozen"):
        v.size_bytes = 2  # type: ignore[misc]


def test_eager_free_after_names_a_node_not_before_the_producer() -> None:

    def graph(after: str) -> Graph:
        return Graph(
            values=[
                Value(id="x", size_bytes=4, kind="input"),
                Value(id="a", size_bytes=8, eager_free_after=after),
                Value(id="b", size_bytes=8),
                Value(id="loss", size_bytes=4, kind="loss"),
            ],
            nodes=[
                Node(id="f0", inputs=("x",), outputs=("b",)),
                Node(id="f1", inputs=("x",), outputs=("a",)),
                Node(id="f2", inputs=("a", "b"), outputs=("loss",)),
            ],
            required=["loss"],
        )

    assert graph("f2").value("a").eager_free_after == "f2"
    with pytest.raises(GraphValidationError, match="unknown node 'nope'"):
        graph("nope")
    with pytest.raises(GraphValidationError, match="runs before its producer 'f1'"):
        graph("f0")
