"""Host memory for offloaded values, and the copies in both directions.

An ``offload`` step copies a value to host memory (pinned when the device is a GPU, on a side
stream) and drops the device copy; a ``prefetch`` allocates a device tensor and fills it from the
host copy. On the CPU, where host and device memory are the same, the host copies are made with
every ``TorchDispatchMode`` switched off, so the device-side tracker
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
    _stream: Any = field(default=None, repr=False)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.offloaded_bytes = 0
        self.prefetched_bytes = 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def side_stream(self) -> Any:
        if self._stream is None and self.is_cuda:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

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
                side = self.side_stream()
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    host.copy_(t, non_blocking=True)
                t.record_stream(side)  # the device block is not reused before the copy ends
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
        side = self.side_stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            t.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        t.record_stream(side)
        return t, event


def wait(event: Any) -> None:
    """Make the compute stream wait for a prefetch (no-op on the CPU)."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)
