"""The CUDA copies of :class:`remat.executor.hostmem.HostMemory`, on a machine without a GPU.

``torch.cuda``'s streams and events and the pinned/device allocations are replaced by fakes that
log, in order, which stream each copy is issued on and what each stream waited for; the log is
checked against the ordering the simulator's host link assumes: one copy stream per direction,
each copy after the compute that made or allocated its tensor, a prefetch after the offload that
wrote its host copy, and the compute after the prefetch it reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from remat.executor import hostmem
from remat.executor.hostmem import HostMemory


class FakeEvent:
    def __init__(self) -> None:
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream


class FakeStream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        assert event.stream is not None, "waiting on an event never recorded"
        self.log.append(("wait_event", self.name, event.stream.name))

    def __repr__(self) -> str:
        return self.name


class FakeStorage:
    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def nbytes(self) -> int:
        return self._nbytes


class FakeTensor:
    """What HostMemory reads of a tensor; ``copy_`` logs the stream it is issued on."""

    def __init__(self, cuda: FakeCuda, name: str, shape: tuple[int, ...] = (4,)) -> None:
        self.cuda, self.name, self.shape, self.dtype = cuda, name, shape, torch.float32
        self._storage = FakeStorage(4 * shape[0])

    def stride(self) -> tuple[int, ...]:
        return (1,)

    def untyped_storage(self) -> FakeStorage:
        return self._storage

    def copy_(self, src: FakeTensor, non_blocking: bool = False) -> None:
        assert non_blocking
        self.cuda.log.append(("copy", self.cuda.current.name, src.name, self.name))

    def record_stream(self, stream: FakeStream) -> None:
        self.cuda.log.append(("record_stream", self.name, stream.name))


class FakeCuda:
    """Stands in for the parts of ``torch.cuda`` (and ``torch.empty_strided``) HostMemory uses."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.compute = FakeStream(self.log, "compute")
        self.current = self.compute
        self.made: list[FakeStream] = []
        self.allocated = 0

    def Stream(self, device: Any = None) -> FakeStream:
        s = FakeStream(self.log, f"side{len(self.made)}")
        self.made.append(s)
        return s

    @contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    def empty_strided(self, shape: Any, stride: Any, **kw: Any) -> FakeTensor:
        self.allocated += 1
        where = "host" if str(kw.get("device")) == "cpu" else "dev"
        return FakeTensor(self, f"{where}{self.allocated}", tuple(shape))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    for name in ("Stream", "stream", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch, "empty_strided", fake.empty_strided)
    return fake


def test_each_direction_copies_on_its_own_stream(cuda: FakeCuda) -> None:
    host = HostMemory(torch.device("cuda"))
    value = FakeTensor(cuda, "value")
    h = host.offload(value)  # type: ignore[arg-type]
    offloaded = list(cuda.log)
    _, event = host.prefetch(h)
    prefetched = cuda.log[len(offloaded) :]

    (d2h,) = [e[1] for e in offloaded if e[0] == "copy"]
    (h2d,) = [e[1] for e in prefetched if e[0] == "copy"]
    assert "compute" not in (d2h, h2d)
    assert d2h != h2d, "offloads and prefetches share one copy stream"
    # The offload: after the compute that made the value; its block kept until the copy ends.
    assert offloaded == [
        ("wait_stream", d2h, "compute"),
        ("copy", d2h, "value", "host1"),
        ("record_stream", "value", d2h),
    ]
    # The prefetch: after the compute stream's earlier users of the new block and after the
    # offload that wrote the host copy (on the other stream now, so not ordered for free).
    assert prefetched == [
        ("wait_stream", h2d, "compute"),
        ("wait_event", h2d, d2h),
        ("copy", h2d, "host1", "dev2"),
        ("record_stream", "dev2", h2d),
    ]
    # The compute stream reads the device copy only once the prefetch is done.
    start = len(cuda.log)
    hostmem.wait(event)
    assert cuda.log[start:] == [("wait_event", "compute", h2d)]


def test_the_two_streams_are_made_once(cuda: FakeCuda) -> None:
    host = HostMemory(torch.device("cuda"))
    for i in range(3):
        h = host.offload(FakeTensor(cuda, f"v{i}"))  # type: ignore[arg-type]
        host.prefetch(h)
    assert len(cuda.made) == 2
    d2h = {e[1] for e in cuda.log if e[0] == "copy" and e[3].startswith("host")}
    h2d = {e[1] for e in cuda.log if e[0] == "copy" and e[3].startswith("dev")}
    assert len(d2h) == len(h2d) == 1 and d2h != h2d
    del h
    assert not host._written, "an offload's event outlives its host copy"
