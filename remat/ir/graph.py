"""The graph of one training step: values (tensor storages) and nodes (operations).

A :class:`Graph` is one forward + loss + backward step as a DAG. It is validated exactly once,
when it is built or parsed; every other part of remat may then rely on its invariants:

* node ids are unique, value ids are unique;
* every id a node, value or ``required`` names exists;
* every value has at most one producer, and ``nodes`` is a topological order (no cycles);
* sizes, times, FLOP counts and workspaces are finite and non-negative;
* inputs and parameters are produced by no node; activations, gradients and the loss are
  produced by exactly one.

Memory accounting rules (the simulator, every solver and the executors share them):

* Parameters and buffers live in ``static_bytes`` and are always on the device.
* A *required* value of kind ``gradient`` is a parameter gradient: it is written into the
  parameter's ``.grad`` buffer, whose bytes are part of ``static_bytes`` as well.
* Everything else is dynamic: inputs are on the device when the step starts (the caller holds
  them); activations, non-parameter gradients and the loss occupy memory from the step that
  computes them until the step that frees or offloads them.
* Memory is counted by storage: a view is never a value of its own.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)
from pydantic._internal._model_construction import ModelMetaclass

from remat.ir.device_profile import DeviceProfile as DeviceProfile
from remat.ir.device_profile import HostLink as HostLink
from remat.ir.errors import GraphValidationError
from remat.ir.sharding import ShardingSpec

SCHEMA_VERSION = 1

ValueKind = Literal["input", "param", "buffer", "activation", "gradient", "loss"]
Phase = Literal["forward", "backward"]

LEAF_KINDS: frozenset[str] = frozenset({"input", "param"})
_T = TypeVar("_T")

STATIC_KINDS: frozenset[str] = frozenset({"param", "buffer"})

# Used when a graph carries no device profile: a PCIe 4.0 x16 link as measured in practice.
DEFAULT_HOST_BANDWIDTH_BYTES_PER_S = 25e9


class Value(BaseModel):
    """One tensor storage.

    ``producer`` may be omitted: it is derived from the node that lists the value as an output.
    When given it must agree with that node.

    ``eager_free_after`` (a node id, optional): plain eager PyTorch still holds this storage
    until that node has run, after the value's last reader (a Python local of the model's
    ``forward`` that stays bound until the function returns). Only the eager plan
    (:func:`remat.ir.eager_plan`, the ``none`` solver and the budgets derived from it) frees the
    value there; every other plan may free it at its last use. It must name a node that does
    not run before the value's producer.

    ``held_by`` (module paths, optional): the blocks whose ``forward`` is called with this
    storage among its tensor arguments. A checkpoint region around such a block holds its
    arguments until the region's backward is done, whether or not its ops read them (Llama's
    decoder layers take ``position_ids`` they never read); the checkpoint class counts that.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    size_bytes: int
    kind: ValueKind = "activation"
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    producer: str | None = None
    eager_free_after: str | None = None
    held_by: tuple[str, ...] = ()


class Node(BaseModel):
    """One operation of the step.

    ``inputs`` and ``outputs`` are value ids. ``time_s`` is the node's cost on the graph's
    device, ``workspace_bytes`` scratch memory alive only while it runs. ``recomputable`` is
    false for ops with side effects (they run exactly once); ``rng`` is true for ops that draw
    random numbers (a recomputation must replay the same numbers). ``autograd_node`` numbers
    the eager autograd node a backward op is part of: consecutive backward ops with the same
    number spell one node's formula (eager unpacks that node's saved tensors before its first
    op runs); None when unknown or for forward ops. ``eager_in_place`` is true for a forward op
    that eager runs in place, writing into a storage an earlier op made (the graph, functional,
    makes a new value): dropout's ``bernoulli_`` and ``div_`` on its noise.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    name: str = ""
    op: str = ""
    phase: Phase = "forward"
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    time_s: float = 0.0
    flops: int = 0
    workspace_bytes: int = 0
    recomputable: bool = True
    module: str = ""
    rng: bool = False
    autograd_node: int | None = None
    eager_in_place: bool = False


class _GraphMeta(ModelMetaclass):
    """Makes ``Graph(...)`` raise :class:`GraphValidationError` like the parsers do.

    (Overriding ``Graph.__init__`` instead would make pydantic validate every parsed graph
    twice: it calls a custom ``__init__`` after ``model_validate_json``.)
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as exc:
            raise _as_graph_error(exc) from None


class Graph(BaseModel, metaclass=_GraphMeta):
    """One training step as a validated DAG. Build with ``Graph(...)``, :meth:`from_json` or
    :meth:`from_dict`; each raises :class:`GraphValidationError` naming the offending id.

    Examples
    --------
    >>> g = Graph(
    ...     values=[Value(id="x", size_bytes=4, kind="input"),
    ...             Value(id="loss", size_bytes=4, kind="loss")],
    ...     nodes=[Node(id="f", inputs=("x",), outputs=("loss",), time_s=1.0)],
    ...     required=["loss"],
    ... )
    >>> g.producer_of("loss").id
    'f'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    name: str = ""
    nodes: tuple[Node, ...] = ()
    values: tuple[Value, ...] = ()
    required: tuple[str, ...] = ()
    static_bytes: int = 0
    device: DeviceProfile | None = None
    sharding: ShardingSpec | None = None
    """The data-parallel configuration this graph is one rank's step of (None: one process;
    :func:`remat.ir.shard.shard_graph` makes sharded graphs)."""

    _node_index: dict[str, int] = PrivateAttr(default_factory=dict)
    _value_index: dict[str, int] = PrivateAttr(default_factory=dict)
    _producer: dict[str, int] = PrivateAttr(default_factory=dict)
    _consumers: dict[str, list[int]] = PrivateAttr(default_factory=dict)
    _required_set: frozenset[str] = PrivateAttr(default_factory=frozenset)
    _static_set: frozenset[str] = PrivateAttr(default_factory=frozenset)
    _node_map: dict[str, Node] = PrivateAttr(default_factory=dict)
    _size_map: dict[str, int] = PrivateAttr(default_factory=dict)
    _memo: dict[str, Any] = PrivateAttr(default_factory=dict)
    _content_hash: str | None = PrivateAttr(default=None)
    _traced_with_loss_fn: bool | None = PrivateAttr(default=None)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_json(cls, text: str | bytes) -> Graph:
        """Parse the JSON form; malformed input raises :class:`GraphValidationError`."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise _as_graph_error(exc) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Graph:
        """Validate a parsed JSON object; malformed input raises :class:`GraphValidationError`."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise _as_graph_error(exc) from None

    def model_post_init(self, context: Any, /) -> None:
        _validate(self)

    def __eq__(self, other: object) -> bool:
        """Equal fields (the step itself); the derived indexes and the :meth:`memo` are left
        out, so a graph equals its JSON round trip whatever either has computed."""
        if not isinstance(other, Graph):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable device fields: never hashable

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Graph:
        """A copy with its own :meth:`memo` (figures derived from the original may not hold for
        it), validated and indexed again when ``update`` changes fields."""
        g = super().model_copy(update=update, deep=deep)
        g._p["_memo"] = {}
        g._p["_content_hash"] = None
        if update:
            _validate(g)
        return g

    # -- serialisation ------------------------------------------------------------------------

    @model_serializer(mode="wrap")
    def _without_unsharded(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A graph of one process serialises as before ``sharding`` existed (same JSON, same
        content hash)."""
        out: dict[str, Any] = handler(self)
        if self.sharding is None:
            out.pop("sharding", None)
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent, exclude_defaults=False)

    def canonical_json(self) -> str:
        """Key-sorted compact JSON: equal graphs give equal text (used for content hashing)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def content_hash(self) -> str:
        """sha256 of :meth:`canonical_json`, hex (computed once: the graph is frozen)."""
        if self._content_hash is None:
            self._content_hash = hashlib.sha256(self.canonical_json().encode()).hexdigest()
        return self._content_hash

    # -- lookups ------------------------------------------------------------------------------
    # The indexes are read from ``__pydantic_private__`` directly: ``self._x`` on a pydantic
    # model goes through ``BaseModel.__getattr__``, measured 20x slower, and solvers call these
    # lookups hundreds of thousands of times on large graphs.

    @property
    def _p(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.__pydantic_private__)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_values(self) -> int:
        return len(self.values)

    def node(self, node_id: str) -> Node:
        try:
            i: int = self._p["_node_index"][node_id]
            return self.nodes[i]
        except KeyError:
            raise KeyError(f"unknown node id {node_id!r}") from None

    def value(self, value_id: str) -> Value:
        try:
            i: int = self._p["_value_index"][value_id]
            return self.values[i]
        except KeyError:
            raise KeyError(f"unknown value id {value_id!r}") from None

    def has_node(self, node_id: str) -> bool:
        return node_id in self._p["_node_index"]

    def has_value(self, value_id: str) -> bool:
        return value_id in self._p["_value_index"]

    def node_position(self, node_id: str) -> int:
        """Index of the node in :attr:`nodes` (its place in the unmodified step)."""
        i: int = self._p["_node_index"][node_id]
        return i

    def producer_of(self, value_id: str) -> Node | None:
        i = self._p["_producer"].get(value_id)
        return None if i is None else self.nodes[i]

    def producer_position(self, value_id: str) -> int | None:
        i: int | None = self._p["_producer"].get(value_id)
        return i

    def consumers_of(self, value_id: str) -> list[Node]:
        """Nodes that read the value, in graph order."""
        return [self.nodes[i] for i in self._p["_consumers"].get(value_id, ())]

    def consumer_positions(self, value_id: str) -> list[int]:
        return list(self._p["_consumers"].get(value_id, ()))

    def is_required(self, value_id: str) -> bool:
        return value_id in self._p["_required_set"]

    def is_static(self, value_id: str) -> bool:
        """True for values whose bytes are part of ``static_bytes`` (see the module docstring)."""
        p = self._p
        if value_id in p["_static_set"]:
            return True
        if value_id not in p["_value_index"]:
            raise KeyError(f"unknown value id {value_id!r}")
        return False

    def required_set(self) -> frozenset[str]:
        """:attr:`required` as a set (computed once)."""
        r: frozenset[str] = self._p["_required_set"]
        return r

    def static_ids(self) -> frozenset[str]:
        """The values :meth:`is_static` holds true for, computed once: solvers that test many
        values read this set instead of calling it per value."""
        s: frozenset[str] = self._p["_static_set"]
        return s

    def node_map(self) -> Mapping[str, Node]:
        """Node id -> node, computed once (a plain dict lookup; not to be modified)."""
        m: dict[str, Node] = self._p["_node_map"]
        return m

    def memo(self, key: str, make: Callable[[], _T]) -> _T:
        """What ``make()`` returns, computed once per graph and ``key`` (the graph is frozen:
        figures derived from it alone, such as a proven bound on any plan's peak, never
        change). The caller picks a key no other caller uses."""
        memo: dict[str, Any] = self._p["_memo"]
        if key not in memo:
            memo[key] = make()
        return cast(_T, memo[key])

    def size_map(self) -> Mapping[str, int]:
        """Value id -> ``size_bytes``, computed once (not to be modified)."""
        m: dict[str, int] = self._p["_size_map"]
        return m

    @property
    def forward_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.phase == "forward"]

    @property
    def backward_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.phase == "backward"]

    @property
    def input_bytes(self) -> int:
        """Dynamic bytes on the device before the first step: the inputs the caller holds."""
        return sum(v.size_bytes for v in self.values if v.kind == "input")

    @property
    def host_bandwidth_bytes_per_s(self) -> float:
        if self.device is None:
            return DEFAULT_HOST_BANDWIDTH_BYTES_PER_S
        return self.device.host_bandwidth_bytes_per_s

    @property
    def link(self) -> HostLink:
        """The host link copies are priced on (:meth:`DeviceProfile.link`; without a device,
        :data:`DEFAULT_HOST_BANDWIDTH_BYTES_PER_S` both ways)."""
        if self.device is None:
            bw = DEFAULT_HOST_BANDWIDTH_BYTES_PER_S
            return HostLink(device_to_host_bytes_per_s=bw, host_to_device_bytes_per_s=bw)
        return self.device.link()

    @property
    def traced_with_loss_fn(self) -> bool | None:
        """Whether the tracer captured this step with a ``loss_fn`` (True: the step ends at
        its scalar) or without one (False: it ends at the model's output or at the loss the
        model returns); None when not known (a graph read from JSON or built by hand). The
        executors hold a plan's caller to the same choice. Not serialised."""
        return self._traced_with_loss_fn

    def mark_traced(self, *, with_loss_fn: bool) -> Graph:
        """Record how the tracer captured this step (see :attr:`traced_with_loss_fn`)."""
        self._traced_with_loss_fn = with_loss_fn
        return self

    def summary(self) -> dict[str, Any]:
        """Counts and totals for people and for the service's graph summary."""
        return {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "num_values": self.num_values,
            "num_forward_nodes": sum(1 for n in self.nodes if n.phase == "forward"),
            "num_backward_nodes": sum(1 for n in self.nodes if n.phase == "backward"),
            "static_bytes": self.static_bytes,
            "input_bytes": self.input_bytes,
            "activation_bytes": sum(v.size_bytes for v in self.values if v.kind == "activation"),
            "compute_time_s": sum(n.time_s for n in self.nodes),
            "flops": sum(n.flops for n in self.nodes),
            "device": None if self.device is None else self.device.name,
        }


# -- validation -------------------------------------------------------------------------------


def _bad_number(x: float) -> bool:
    return x < 0 or math.isnan(x) or math.isinf(x)


def _validate(g: Graph) -> None:
    node_index: dict[str, int] = {}
    for i, n in enumerate(g.nodes):
        if n.id in node_index:
            raise GraphValidationError(f"duplicate node id {n.id!r}")
        node_index[n.id] = i
        if _bad_number(n.time_s):
            raise GraphValidationError(
                f"node {n.id!r}: time_s must be finite and >= 0, got {n.time_s}"
            )
        if n.flops < 0:
            raise GraphValidationError(f"node {n.id!r}: flops must be >= 0, got {n.flops}")
        if n.workspace_bytes < 0:
            raise GraphValidationError(
                f"node {n.id!r}: workspace_bytes must be >= 0, got {n.workspace_bytes}"
            )
        if len(set(n.outputs)) != len(n.outputs):
            raise GraphValidationError(f"node {n.id!r} lists an output twice")

    value_index: dict[str, int] = {}
    for i, v in enumerate(g.values):
        if v.id in value_index:
            raise GraphValidationError(f"duplicate value id {v.id!r}")
        value_index[v.id] = i
        if v.size_bytes < 0:
            raise GraphValidationError(
                f"value {v.id!r}: size_bytes must be >= 0, got {v.size_bytes}"
            )

    if g.static_bytes < 0:
        raise GraphValidationError(f"static_bytes must be >= 0, got {g.static_bytes}")

    producer: dict[str, int] = {}
    for i, n in enumerate(g.nodes):
        for o in n.outputs:
            if o not in value_index:
                raise GraphValidationError(f"node {n.id!r} outputs unknown value {o!r}")
            if o in producer:
                first = g.nodes[producer[o]].id
                raise GraphValidationError(
                    f"value {o!r} has two producers: nodes {first!r} and {n.id!r}"
                )
            producer[o] = i

    for v in g.values:
        if v.producer is not None:
            if v.producer not in node_index:
                raise GraphValidationError(
                    f"value {v.id!r} names unknown producer node {v.producer!r}"
                )
            if producer.get(v.id) != node_index[v.producer]:
                actual = producer.get(v.id)
                other = "no node" if actual is None else f"node {g.nodes[actual].id!r}"
                raise GraphValidationError(
                    f"value {v.id!r} names producer {v.producer!r} but {other} outputs it"
                )

    required_set = frozenset(g.required)
    for r in g.required:
        if r not in value_index:
            raise GraphValidationError(f"required value {r!r} is unknown")
        kind = g.values[value_index[r]].kind
        if r not in producer and kind not in LEAF_KINDS and kind != "buffer":
            raise GraphValidationError(f"required value {r!r} is produced by no node")

    for v in g.values:
        if v.kind in LEAF_KINDS and v.id in producer:
            raise GraphValidationError(
                f"value {v.id!r} of kind {v.kind} is produced by node "
                f"{g.nodes[producer[v.id]].id!r}"
            )
        if v.kind not in LEAF_KINDS and v.kind != "buffer" and v.id not in producer:
            raise GraphValidationError(f"value {v.id!r} of kind {v.kind} is produced by no node")

    for v in g.values:
        if v.eager_free_after is None:
            continue
        at = node_index.get(v.eager_free_after)
        if at is None:
            raise GraphValidationError(
                f"value {v.id!r}: eager_free_after names unknown node {v.eager_free_after!r}"
            )
        p = producer.get(v.id)
        if p is not None and at < p:
            raise GraphValidationError(
                f"value {v.id!r}: eager_free_after node {v.eager_free_after!r} runs before its "
                f"producer {g.nodes[p].id!r}"
            )

    consumers: dict[str, list[int]] = {}
    out_of_order: tuple[int, str] | None = None
    for i, n in enumerate(g.nodes):
        for x in n.inputs:
            if x not in value_index:
                raise GraphValidationError(f"node {n.id!r} reads unknown value {x!r}")
            p = producer.get(x)
            if p is not None and p >= i and out_of_order is None:
                out_of_order = (i, x)
            lst = consumers.setdefault(x, [])
            if not lst or lst[-1] != i:
                lst.append(i)

    if out_of_order is not None:
        cycle = _find_cycle(g, producer)
        if cycle is not None:
            raise GraphValidationError("cycle through nodes " + " -> ".join(repr(c) for c in cycle))
        i, x = out_of_order
        raise GraphValidationError(
            f"node {g.nodes[i].id!r} reads value {x!r} before its producer "
            f"{g.nodes[producer[x]].id!r} runs: nodes must be listed in a topological order"
        )

    g._node_index = node_index
    g._value_index = value_index
    g._producer = producer
    g._consumers = consumers
    g._required_set = required_set
    g._static_set = frozenset(
        v.id
        for v in g.values
        if v.kind in STATIC_KINDS or (v.kind == "gradient" and v.id in required_set)
    )
    g._node_map = {n.id: n for n in g.nodes}
    g._size_map = {v.id: v.size_bytes for v in g.values}


def _find_cycle(g: Graph, producer: Mapping[str, int]) -> list[str] | None:
    """Return node ids along one cycle (first repeated at the end), or None."""
    succ: list[list[int]] = [[] for _ in g.nodes]
    for i, n in enumerate(g.nodes):
        for x in n.inputs:
            p = producer.get(x)
            if p is not None:
                succ[p].append(i)
    state = [0] * len(g.nodes)  # 0 new, 1 on stack, 2 done
    for root in range(len(g.nodes)):
        if state[root]:
            continue
        stack: list[tuple[int, Iterator[int]]] = [(root, iter(succ[root]))]
        path = [root]
        state[root] = 1
        while stack:
            u, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[u] = 2
                continue
            if state[nxt] == 1:
                start = path.index(nxt)
                return [g.nodes[k].id for k in [*path[start:], nxt]]
            if state[nxt] == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(succ[nxt])))
    return None


def _as_graph_error(exc: ValidationError) -> GraphValidationError:
    """Turn pydantic's error into ours: unwrap our own, or name the field that failed."""
    for err in exc.errors():
        ctx = err.get("ctx") or {}
        inner = ctx.get("error")
        if isinstance(inner, GraphValidationError):
            return inner
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "graph"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return GraphValidationError(f"{loc}: {err['msg']}{more}")
