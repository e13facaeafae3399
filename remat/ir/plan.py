"""The plan: the one schedule type every solver returns and every executor runs.

A plan is a list of steps over one graph:

* ``compute(node)``: run the node. Its inputs must be on the device; its outputs and its
  workspace are allocated. A node computed more than once is recomputation.
* ``free(value)``: release the device copy of a value.
* ``offload(value)``: start a device-to-host copy on the copy stream; the device bytes are
  released when the copy completes, and the value cannot be read on the device until a later
  ``prefetch``. The host copy stays valid, so a value may be prefetched several times.
* ``prefetch(value)``: start a host-to-device copy; bytes are allocated when it starts and the
  value is readable once it completes (a compute that reads it earlier waits: a stall).

:func:`remat.ir.simulate` judges plans; nothing else decides whether one is valid.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from remat.ir.graph import Graph

StepOp = Literal["compute", "free", "offload", "prefetch"]


class Step(BaseModel):
    """One step of a plan: ``op`` applied to a node id (compute) or a value id (the others)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    op: StepOp
    id: str

    def __str__(self) -> str:
        return f"{self.op}({self.id})"


def compute(node_id: str) -> Step:
    return Step(op="compute", id=node_id)


def free(value_id: str) -> Step:
    return Step(op="free", id=value_id)


def offload(value_id: str) -> Step:
    return Step(op="offload", id=value_id)


def prefetch(value_id: str) -> Step:
    return Step(op="prefetch", id=value_id)


def step_maker(graph: Graph) -> Callable[[StepOp, str], Step]:
    """``make(op, id)``: the plan step, one shared (frozen) instance per op and id of
    ``graph``, so that plans of large graphs are not validated step by step again and again."""
    cache: dict[tuple[str, str], Step] = graph.memo("chain.steps", dict)

    def make(op: StepOp, sid: str) -> Step:
        key = (op, sid)
        s = cache.get(key)
        if s is None:
            s = cache[key] = Step(op=op, id=sid)
        return s

    return make


@dataclass(frozen=True)
class ValueFate:
    """What a plan does with one activation: for people and for the module-level executor."""

    value_id: str
    times_computed: int
    times_offloaded: int

    @property
    def recomputed(self) -> int:
        return max(0, self.times_computed - 1)

    @property
    def status(self) -> str:
        if self.times_offloaded:
            return "offloaded"
        if self.recomputed:
            return f"recomputed {self.recomputed}x"
        return "kept"


class Plan(BaseModel):
    """A schedule: an ordered tuple of :class:`Step`.

    Examples
    --------
    >>> p = Plan.of([("compute", "f"), ("free", "x")])
    >>> [str(s) for s in p.steps]
    ['compute(f)', 'free(x)']
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    steps: tuple[Step, ...] = ()

    @classmethod
    def of(cls, steps: Iterable[Step | tuple[str, str]]) -> Plan:
        """Build from steps or ``(op, id)`` pairs."""
        out = [s if isinstance(s, Step) else Step(op=s[0], id=s[1]) for s in steps]
        return cls(steps=tuple(out))

    def __len__(self) -> int:
        return len(self.steps)

    def compute_counts(self) -> Counter[str]:
        """How many times each node is computed."""
        return Counter(s.id for s in self.steps if s.op == "compute")

    def summary(self, graph: Graph) -> dict[str, ValueFate]:
        """Per produced, non-static value: how often it is computed and offloaded."""
        computes = self.compute_counts()
        offloads = Counter(s.id for s in self.steps if s.op == "offload")
        out: dict[str, ValueFate] = {}
        for v in graph.values:
            p = graph.producer_of(v.id)
            if p is None or graph.is_static(v.id):
                continue
            out[v.id] = ValueFate(v.id, computes.get(p.id, 0), offloads.get(v.id, 0))
        return out
