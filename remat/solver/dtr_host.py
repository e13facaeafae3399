"""Eviction to the host inside ``dtr``'s planner, Capuchin-style (Peng et al. 2020).

When DTR must free memory, a candidate whose next read is far enough that a round trip on the
link hides under the compute until then may go to the host instead of being dropped (and
recomputed later): an ``offload`` step, and a ``prefetch`` issued early enough before the next
read. :class:`HostLane` keeps what the planner needs to decide it without simulating: the two
copy streams' free times, which values have a valid host copy, and the host bytes.

Times are the planner's *stall-free* compute clock (the sum of the computes emitted so far).
The simulator's clock is never earlier (stalls only delay computes), and a copy's completion
there is never later than here plus the stalls before it, so a decision made on these times
holds in the simulation:

* an offload is placed *back* in the plan, right after the value's last read or make (and
  after the last offload placed, so the device-to-host stream keeps plan order), and is taken
  only if its copy ends by the current compute: the device bytes are then released, in the
  simulator too, before the compute that needed the room;
* a value already copied once (its host copy is still valid) is offloaded again at once,
  without a transfer; a prefetched value is an eviction candidate from its next read on, or,
  in a second run (``evict_prefetched``), from its prefetch on;
* a prefetch is issued at the last compute boundary from which it still ends
  :data:`~remat.solver.offload.PREFETCH_LEAD` times its copy time before the next read, by the
  stall-free clock in graph order (recomputations only push that read later);
* the host bytes held over the interval an offload spans stay within the host budget.

References
----------
X. Peng, X. Shi, H. Dai, H. Jin, W. Ma, Q. Xiong, F. Yang, X. Qian. "Capuchin: Tensor-based GPU
Memory Management for Deep Learning." ASPLOS 2020.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Literal

from remat.ir.device_profile import HostLink
from remat.solver.offload import PREFETCH_LEAD

HostOrder = Literal["far", "score"]
"""How candidates that can go to the host rank among themselves (all before those that would be
dropped): ``"far"``, the longest time to the next read first (Capuchin's free time);
``"score"``, DTR's score."""


class HostLane:
    """The host link as ``dtr``'s planner sees it (see the module docstring).

    ``size`` and ``uses`` are the planner's per-value sizes and ascending reading nodes;
    ``node_time`` the nodes' times in graph order."""

    def __init__(
        self,
        link: HostLink,
        size: list[int],
        uses: list[list[int]],
        node_time: list[float],
        *,
        order: HostOrder = "far",
    ) -> None:
        self.order = order
        self.size = size
        self.uses = uses
        self.d2h_s = [link.offload_s(b) for b in size]
        self.h2d_s = [link.prefetch_s(b) for b in size]
        self.host_budget = link.host_memory_bytes
        self.ahead = list(itertools.accumulate(node_time, initial=0.0))  # graph-order clock
        self.d2h_free = 0.0
        self.h2d_free = 0.0
        self.last_pos = -1  # plan position of the last offload placed on the stream
        self.hosted = [False] * len(size)  # a valid host copy exists
        self.host_done = [0.0] * len(size)  # when that copy is complete
        self.host_live = 0
        self.freed_at: list[int] = []  # plan positions where host copies were released
        self.freed_cum: list[int] = [0]  # their bytes, cumulative
        self.waiting: list[tuple[int, int]] = []  # (next graph-order read, value) on the host
        self.inserts: list[tuple[int, int]] = []  # (plan position, value): offloads placed back
        self.moved = 0

    def next_use(self, v: int, target: int) -> int:
        """The first graph-order read of ``v`` at or after node ``target`` (-1: none)."""
        uses = self.uses[v]
        i = bisect.bisect_left(uses, target)
        return uses[i] if i < len(uses) else -1

    def far_enough(self, v: int, target: int) -> bool:
        """Whether ``v``'s next read leaves room, by the graph-order clock, for its prefetch."""
        u = self.next_use(v, target)
        return u >= 0 and self.ahead[u] - self.ahead[target] >= PREFETCH_LEAD * self.h2d_s[v]

    def rank(self, v: int, target: int, score: float) -> float:
        """The eviction rank of ``v`` going to the host, below every score (those are >= 0):
        the farther its next read (``"far"``) or the lower its DTR ``score``, the lower."""
        if self.order == "far":
            return -1.0 - (self.ahead[self.next_use(v, target)] - self.ahead[target])
        return -1.0 / (score + 1e-300)

    def can_offload(self, v: int, target: int, now: float, ready: float, pos: int) -> bool:
        """Whether ``v`` (made at clock ``ready``, last read or made at plan position ``pos``)
        may go to the host now: its next read is far, and its copy, queued behind those placed,
        ends by ``now`` within the host budget."""
        if not self.far_enough(v, target):
            return False
        if self.hosted[v]:
            return True
        if max(self.d2h_free, ready) + self.d2h_s[v] > now:
            return False
        if self.host_budget is None:
            return True
        # the most held anywhere from the copy's position on: what is held now plus what was
        # released since (every copy made in between is in one or the other)
        at = max(pos, self.last_pos)
        since = self.freed_cum[-1] - self.freed_cum[bisect.bisect_right(self.freed_at, at)]
        return self.host_live + since + self.size[v] <= self.host_budget

    def offload(self, v: int, target: int, ready: float, pos: int) -> bool:
        """Record ``v``'s move to the host; True when a copy was placed back at a plan position
        (in :attr:`inserts`), False when the host copy was valid (the caller emits the offload
        at once, which releases the device bytes without a transfer)."""
        heapq.heappush(self.waiting, (self.next_use(v, target), v))
        if self.hosted[v]:
            return False
        at = max(pos, self.last_pos)
        begin = max(self.d2h_free, ready)
        self.d2h_free = self.host_done[v] = begin + self.d2h_s[v]
        self.last_pos = at
        self.hosted[v] = True
        self.host_live += self.size[v]
        self.moved += self.size[v]
        self.inserts.append((at, v))
        return True

    def due(
        self, target: int, now: float, node_s: float, resident: list[bool], room: int
    ) -> list[int]:
        """The values on the host whose prefetch must be issued before node ``target`` runs:
        issued after it (at ``now + node_s``) it would end less than its lead before the
        read; in next-read order, as long as they fit in ``room`` free bytes (one that does
        not waits, at the latest until its read brings it back). Stale entries (values back
        on the device) are dropped."""
        out: list[int] = []
        while self.waiting:
            u, v = self.waiting[0]
            if resident[v] or not self.hosted[v]:
                heapq.heappop(self.waiting)
                continue
            read_at = now + self.ahead[u] - self.ahead[target]
            later = max(self.h2d_free, now + node_s, self.host_done[v])
            if later + PREFETCH_LEAD * self.h2d_s[v] <= read_at or self.size[v] > room:
                break
            heapq.heappop(self.waiting)
            room -= self.size[v]
            out.append(v)
        return out

    def prefetch(self, v: int, now: float) -> None:
        """Record the prefetch of ``v`` issued at clock ``now``."""
        self.h2d_free = max(self.h2d_free, now, self.host_done[v]) + self.h2d_s[v]

    def release(self, v: int, pos: int) -> None:
        """``v`` was freed (dead) at plan position ``pos``: its host copy goes too."""
        if self.hosted[v]:
            self.hosted[v] = False
            self.host_live -= self.size[v]
            self.freed_at.append(pos)
            self.freed_cum.append(self.freed_cum[-1] + self.size[v])
