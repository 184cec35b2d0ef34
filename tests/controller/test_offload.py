"""gactx/controller/offload.py: level L3. On the CPU the stream operations are replaced by a stand-in that copies
at once and logs what it did, so the bookkeeping (what moves, when it comes back, how much is in flight) is
tested everywhere; the CUDA test runs the real streams and pinned memory."""

import contextlib
from unittest import mock

import pytest
import torch
from torch import nn

import gactx
from gactx.controller import Packed
from gactx.controller import controller as controller_module
from gactx.controller.offload import HostCopy, Offloader
from tests.helpers import live


class CpuStreams:
    """Stream operations done at once on the CPU; counts copies in flight (started, not yet waited for)."""

    def __init__(self) -> None:
        self.to_host = self.to_device = self.in_flight = self.most_in_flight = 0

    @staticmethod
    def accepts(t):
        return t.device.type == "cpu"

    def side(self, device):
        return "side"

    def current(self, device):
        return "current"

    def use(self, stream):
        assert stream == "side"
        return contextlib.nullcontext()

    def host_like(self, t):
        self.to_host += 1
        return torch.empty_like(t)

    def device_like(self, t, device):
        self.to_device += 1
        return torch.empty_like(t)

    def event(self, stream):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return object()

    def wait_stream(self, waiter, other):
        assert (waiter, other) == ("side", "current")

    def wait_event(self, waiter, event):
        assert waiter == "current"
        self.in_flight -= 1

    def record(self, t, stream):
        pass


def _mlp(depth=6):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 10))


def _offloading(model, prefetch=2, **options):
    streams = CpuStreams()
    with mock.patch.object(controller_module, "Offloader", lambda _: Offloader(prefetch, streams)):
        controller = gactx.Controller(model, level="L3", **options)
    return controller, streams


def _grads(model, controller, x, retain=False):
    model.zero_grad(set_to_none=True)
    with controller:
        loss = model(x.clone()).square().mean()  # a batch nothing else holds: backward reads its copy
    loss.backward(retain_graph=retain)
    out = torch.cat([p.grad.flatten() for p in model.parameters()])
    return (out, loss) if retain else out


@pytest.fixture(autouse=True)
def _quiet_cpu_warning():
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)  # the stand-in streams accept CPU tensors
        yield


def test_offloaded_tensors_decode_exactly_as_on_the_device():
    model, x = _mlp(), torch.randn(64, 128)
    on_device = _grads(model, gactx.Controller(model, level="L2"), x)
    controller, streams = _offloading(model)
    offloaded = _grads(model, controller, x)
    assert torch.equal(offloaded, on_device)  # same bits, same noise: L3 is L2 plus where bytes wait
    stats = controller.memory_stats()
    # 7 linear inputs quantized and offloaded; 6 ReLU masks (1 bit an element) stay on the device
    masks = [r for r in controller.records if r.cls == "threshold"]
    assert stats.compressed == 13 and len(masks) == 6
    mask_bytes = sum(r.packed_bytes for r in masks)
    assert stats.offloaded_bytes == stats.packed_bytes - stats.kept_bytes - mask_bytes > 0
    assert stats.device_bytes == stats.kept_bytes + mask_bytes
    assert streams.to_host == 2 * 7  # payload and metadata
    assert streams.to_device == 2 * 7  # each brought back once, none wasted
    assert "in pinned CPU memory" in controller.report()


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_backward_prefetches_a_bounded_number_ahead(prefetch):
    model, x = _mlp(), torch.randn(64, 128)
    controller, streams = _offloading(model, prefetch=prefetch)
    with controller:
        loss = model(x.clone()).square().mean()
    handles = [h for h in live(Packed) if isinstance(h.stored, HostCopy)]
    assert len(handles) == 7 and all(h.stored.on_device is None for h in handles)
    assert all(h.stored.qt.data.device.type == "cpu" for h in handles)
    del handles
    loss.backward()
    assert streams.in_flight == 0
    assert streams.most_in_flight == prefetch + 1  # the tensor being decoded and `prefetch` behind it
    assert streams.to_device == streams.to_host


def test_a_tensor_still_alive_on_the_device_is_not_copied_back():
    model, x = _mlp(), torch.randn(64, 128)
    controller, streams = _offloading(model, prefetch=0)
    with controller:
        loss = model(x).square().mean()  # x, held here, is read where it is
    loss.backward()
    assert streams.to_host == 2 * 7 and streams.to_device == 2 * 6 and streams.in_flight == 0


def test_retain_graph_decodes_the_same_twice():
    model, x = _mlp(3), torch.randn(64, 128)
    controller, streams = _offloading(model)
    first, loss = _grads(model, controller, x, retain=True)
    model.zero_grad()
    loss.backward()
    second = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(first, second)
    assert streams.to_device == streams.to_host and streams.in_flight == 0


def test_handles_and_host_copies_are_freed_with_the_graph():
    model, x = _mlp(3), torch.randn(64, 128)
    controller, _ = _offloading(model)
    _grads(model, controller, x)
    with controller:
        model(x).sum()  # never run backward
    assert live(Packed) == [] and live(HostCopy) == []


def test_without_cuda_l3_warns_and_compresses_in_place(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, x = _mlp(3), torch.randn(64, 128)
    with pytest.warns(RuntimeWarning, match="moves compressed CUDA tensors only"):
        controller = gactx.Controller(model, level="L3")
    l3 = _grads(model, controller, x)
    assert torch.equal(l3, _grads(model, gactx.Controller(model, level="L2"), x))
    assert controller.memory_stats().offloaded_bytes == 0


def test_a_cpu_tensor_on_a_cuda_machine_warns_once():
    model, x = _mlp(3), torch.randn(64, 128)
    controller = gactx.Controller(model, level="L3")  # the real CUDA streams, which take CUDA tensors only
    with pytest.warns(RuntimeWarning, match=r"moves compressed CUDA tensors only \(a tensor on cpu\)") as seen:
        _grads(model, controller, x)
    assert len(seen) == 1
    assert controller.memory_stats().offloaded_bytes == 0


@contextlib.contextmanager
def _no_synchronization():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")  # read before the fixture runs
def test_offload_on_cuda_frees_device_memory_without_synchronizing():
    model = _mlp(12).cuda()
    x = torch.randn(4096, 128, device="cuda")

    def step(controller):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with _no_synchronization(), controller:
            loss = model(x).square().mean()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        with _no_synchronization():
            loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), held

    on_device, held_l2 = step(gactx.Controller(model, level="L2"))
    controller = gactx.Controller(model, level="L3")
    offloaded, held_l3 = step(controller)
    stats = controller.memory_stats()
    assert torch.equal(offloaded, on_device)
    assert stats.offloaded_bytes > 0
    assert held_l3 <= held_l2 - stats.offloaded_bytes // 2  # the payloads left the device
