"""Level L3: compressed payloads wait for backward in pinned CPU memory, and come back ahead of need.

Forward (in the pack hook, after the payload was quantized on the current stream): a side stream waits for
the current one and copies payload and metadata into pinned host buffers (``non_blocking``). The device
copies are marked as in use by the side stream (``record_stream``) and dropped, so the caching allocator
hands their memory out again only once the copy has run.

Backward: unpacking a handle starts, on the side stream, the host-to-device copies of the ``prefetch``
handles that backward will need next (those packed just before it, in the same forward pass), so a copy
overlaps the computation of the nodes before it; the current stream waits on the handle's own copy with an
event. The device copy stays with its handle, which autograd frees after the last node that saved the
tensor has run (a tensor saved by two nodes is copied back once); with ``retain_graph=True`` handles
live on, and so the compressed tensors come back to the device over the first backward.

Nothing here synchronizes the host with the device. CUDA tensors only: :class:`Offloader` leaves tensors
on other devices where they are (and warns once).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch

from gactx.config import _caller_level
from gactx.kernels import QuantizedTensor

__all__ = ["HostCopy", "Offloader", "CudaStreams"]


class CudaStreams:
    """The stream operations offloading needs, on CUDA. One side stream per device, made on first use."""

    def __init__(self) -> None:
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def accepts(t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def side(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device)
        return stream

    @staticmethod
    def current(device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    @staticmethod
    def use(stream: torch.cuda.Stream):
        return torch.cuda.stream(stream)

    @staticmethod
    def host_like(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    @staticmethod
    def device_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    @staticmethod
    def event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait_stream(waiter: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        waiter.wait_stream(other)

    @staticmethod
    def wait_event(waiter: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        waiter.wait_event(event)

    @staticmethod
    def record(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        t.record_stream(stream)


@dataclasses.dataclass(eq=False)
class HostCopy:
    """A :class:`QuantizedTensor` whose tensors live in pinned host memory, and where it came from."""

    qt: QuantizedTensor  # ``data`` and ``meta`` on the host
    device: torch.device
    offloader: Offloader
    order: list  # weak references to the pass's host copies, in pack order
    index: int
    on_device: QuantizedTensor | None = None  # brought back: kept until the handle is freed
    event: object = None  # marks the end of the copy back, until the current stream has waited for it


class Offloader:
    """Moves quantized payloads to pinned host memory in forward and prefetches them in backward.

    Args:
        prefetch: how many handles ahead of the one being decoded backward copies back to the device.
        streams: the stream operations (:class:`CudaStreams`; tests hand in a stand-in that runs on the CPU).
    """

    def __init__(self, prefetch: int = 2, streams=None) -> None:
        self.prefetch = prefetch
        self.streams = CudaStreams() if streams is None else streams
        self._order: list = []
        self._warned = False

    def warn(self, why: str) -> None:
        """Says once that tensors ``why`` stay where they are (offloading moves compressed CUDA tensors only)."""
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"gactx offload (level L3, offload=True) moves compressed CUDA tensors only ({why}): "
                f"the others are compressed and stay on their device (docs/training-stacks.md#cpu-offload-l3)",
                RuntimeWarning,
                stacklevel=_caller_level(),
            )

    def accepts(self, t: torch.Tensor) -> bool:
        return self.streams.accepts(t)

    def begin_pass(self) -> None:
        """A new forward pass: its handles are prefetched among themselves."""
        self._order = []

    def offload(self, qt: QuantizedTensor) -> HostCopy:
        ops, device = self.streams, qt.data.device
        side = ops.side(device)
        ops.wait_stream(side, ops.current(device))  # the payload was written on the current stream
        with ops.use(side):
            host = {name: _to_host(ops, getattr(qt, name), side) for name in ("data", "meta")}
        copy = HostCopy(dataclasses.replace(qt, **host), device, self, self._order, len(self._order))
        self._order.append(weakref.ref(copy))
        return copy

    def fetch(self, copy: HostCopy) -> QuantizedTensor:
        """The device :class:`QuantizedTensor` of ``copy``, ready for the current stream; starts bringing back
        the handles backward needs next."""
        if copy.on_device is None:
            self._start(copy)
        for index in range(copy.index - 1, max(copy.index - 1 - self.prefetch, -1), -1):
            other = copy.order[index]()
            if other is not None and other.on_device is None:
                self._start(other)
        if copy.event is not None:  # the first use: the current stream waits for the copy, once
            ops = self.streams
            current = ops.current(copy.device)
            ops.wait_event(current, copy.event)
            for t in (copy.on_device.data, copy.on_device.meta):
                if t is not None:
                    ops.record(t, current)  # allocated for the side stream, read on the current one
            copy.event = None
        return copy.on_device

    def _start(self, copy: HostCopy) -> None:
        ops = self.streams
        side = ops.side(copy.device)
        with ops.use(side):
            tensors = {name: _to_device(ops, getattr(copy.qt, name), copy.device) for name in ("data", "meta")}
            copy.on_device, copy.event = dataclasses.replace(copy.qt, **tensors), ops.event(side)


def _to_host(ops, t: torch.Tensor | None, side) -> torch.Tensor | None:
    if t is None:
        return None
    host = ops.host_like(t)
    host.copy_(t, non_blocking=True)
    ops.record(t, side)  # not reused by the allocator before the copy has run
    return host


def _to_device(ops, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    out = ops.device_like(t, device)
    out.copy_(t, non_blocking=True)
    return out
