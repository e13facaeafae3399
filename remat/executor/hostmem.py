"""Host memory for offloaded values, and the copies in both directions.

An ``offload`` step copies a value to host memory and drops the device copy; a ``prefetch``
allocates a device tensor and fills it from the host copy. On a GPU the host copies are pinned and
each direction has its own copy stream (device -> host for offloads, host -> device for
prefetches), so an offload of the forward and a prefetch for the backward can overlap each other
as well as the compute, as the simulator's host link assumes (one stream per direction); events
order them: each copy waits for the compute stream that made or allocated its tensor, a prefetch
waits for the offload that wrote its host copy, and the compute stream waits for a prefetch before
reading it (:func:`wait`). On the CPU, where host and device memory are the same, the host copies
are made with every ``TorchDispatchMode`` switched off, so the device-side tracker
(:class:`remat.executor.measure.LiveStorageTracker`) never sees them: they are host bytes, counted
here by :class:`HostMemory` (``live_bytes``, ``peak_bytes``), exactly, by storage.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


@dataclass
class HostMemory:
    """Host bytes held by offloaded copies: live now, peak since :meth:`reset_peak`."""

    device: torch.device
    live_bytes: int = 0
    peak_bytes: int = 0
    offloaded_bytes: int = 0
    """Bytes copied device -> host since the last :meth:`reset_peak`."""
    prefetched_bytes: int = 0
    _offload_stream: Any = field(default=None, repr=False)
    _prefetch_stream: Any = field(default=None, repr=False)
    _written: dict[int, Any] = field(default_factory=dict, repr=False)
    """The event of the offload that fills each host copy still alive, by ``id`` (CUDA only)."""

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.offloaded_bytes = 0
        self.prefetched_bytes = 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def offload_stream(self) -> Any:
        """The device -> host copy stream (None on the CPU)."""
        if self._offload_stream is None and self.is_cuda:
            self._offload_stream = torch.cuda.Stream(self.device)
        return self._offload_stream

    def prefetch_stream(self) -> Any:
        """The host -> device copy stream (None on the CPU)."""
        if self._prefetch_stream is None and self.is_cuda:
            self._prefetch_stream = torch.cuda.Stream(self.device)
        return self._prefetch_stream

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def offload(self, t: torch.Tensor) -> torch.Tensor:
        """Copy ``t`` to host memory; the caller drops its device reference afterwards."""
        with _disable_current_modes():
            host = torch.empty_strided(
                tuple(t.shape),
                tuple(t.stride()),
                dtype=t.dtype,
                device="cpu",
                pin_memory=self.is_cuda,
            )
            if self.is_cuda:
                d2h = self.offload_stream()
                d2h.wait_stream(torch.cuda.current_stream(self.device))  # t has been computed
                with torch.cuda.stream(d2h):
                    host.copy_(t, non_blocking=True)
                    written = torch.cuda.Event()
                    written.record(d2h)
                t.record_stream(d2h)  # the device block is not reused before the copy ends
                # A prefetch on the other stream must not read the host copy before it is written.
                self._written[id(host)] = written
                weakref.finalize(host, self._written.pop, id(host), None)
            else:
                host.copy_(t)
        nbytes = int(host.untyped_storage().nbytes())
        self.live_bytes += nbytes
        self.offloaded_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(host.untyped_storage(), self._release, nbytes)
        return host

    def prefetch(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A device copy of ``host`` and the event to wait on before reading it (None on CPU).

        The device tensor is allocated on the compute stream (the device-side tracker sees it).
        """
        t = torch.empty_strided(
            tuple(host.shape), tuple(host.stride()), dtype=host.dtype, device=self.device
        )
        self.prefetched_bytes += int(host.untyped_storage().nbytes())
        if not self.is_cuda:
            with _disable_current_modes():
                t.copy_(host)
            return t, None
        h2d = self.prefetch_stream()
        # t's block was allocated on the compute stream: its earlier users there come first.
        h2d.wait_stream(torch.cuda.current_stream(self.device))
        written = self._written.get(id(host))
        if written is not None:
            h2d.wait_event(written)
        with torch.cuda.stream(h2d):
            t.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(h2d)
        t.record_stream(h2d)
        return t, event


def wait(event: Any) -> None:
    """Make the compute stream wait for a prefetch (no-op on the CPU)."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)
