"""The controller on real architectures: exact at L0, close at 8 bits, honest accounting, no leaks."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import gactx
from benchmarks.zoo import ZOO, build
from gactx.controller import Packed
from gactx.controller.pack import PackPath
from gactx.controller.store import Kept
from gactx.kernels import QuantizedTensor
from gactx.kernels.codes import CodedTensor
from tests.helpers import live, native_handles

NAMES = list(ZOO)


def grads(model, run, controller=None, seed=0, scale_loss=1.0):
    """Flat parameter gradient of one step; the controller is installed for the forward pass only."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if controller is not None:
        controller.install_hook()
    try:
        loss = run() * scale_loss
    finally:
        if controller is not None:
            controller.uninstall_hook()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", NAMES)
def test_l0_gradients_are_bit_identical(name):
    model, run = build(name)
    plain = grads(model, run)
    controller = gactx.Controller(model, level="L0")
    assert torch.equal(grads(model, run, controller), plain)
    assert controller.memory_stats().original_bytes > 0


@pytest.mark.parametrize("name", NAMES)
def test_8_bit_gradients_are_close(name):
    model, run = build(name)
    plain = grads(model, run)
    compressed = grads(model, run, gactx.Controller(model, level="L1.1"))
    assert F.cosine_similarity(plain, compressed, dim=0) >= 0.999


def saved_storages(model, run, seed=0):
    """What plain PyTorch saves: each saved storage once, and of a view of data that does not need a graph (a
    leaf that does not require grad: a batch sliced from a dataset) the bytes from its first element to its
    last, each byte once; parameters and buffers left out. Counted with a hook of the test's own."""
    model_ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    spans = {}  # storage -> [(first byte, end byte)]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in model_ptrs:
            size = t.untyped_storage().nbytes()
            if t._base is None or t._base.grad_fn is not None or t._base.requires_grad:
                spans.setdefault(ptr, []).append((0, size))
            else:
                first = t.storage_offset() * t.element_size()
                last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else -1
                spans.setdefault(ptr, []).append((first, min(first + (last + 1) * t.element_size(), size)))
        return t

    torch.manual_seed(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    total = 0
    for ranges in spans.values():  # the union of each storage's ranges
        reach = 0
        for first, end in sorted(ranges):
            total += max(0, end - max(first, reach))
            reach = max(reach, end)
    return total


def _object_bytes(stored) -> int:
    if isinstance(stored, QuantizedTensor):
        meta = 0 if stored.meta is None else stored.meta.numel() * stored.meta.element_size()
        return stored.data.numel() * stored.data.element_size() + meta
    if isinstance(stored, CodedTensor):
        return _object_bytes(stored.codes) + stored.table.numel() * stored.table.element_size()
    if isinstance(stored, torch.Tensor):
        return stored.numel() * stored.element_size()
    return 0  # Unused: nothing is held


def held_bytes(model, controller, run, seed=0):
    """What the handles autograd got from the controller actually hold: each stored object once, and each
    storage of a tensor kept as is once (parameters left out), counted from the objects themselves."""
    model_ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    returned = []
    pack = PackPath.pack
    torch.manual_seed(seed)
    with mock.patch.object(PackPath, "pack", lambda path, t: returned.append(pack(path, t)) or returned[-1]):
        with controller:  # a controller not installed before: its hooks are made now, with the pack above
            run()
    objects, storages = {}, {}
    for r in returned:
        stored = r.stored if isinstance(r, Packed) else r.tensor if isinstance(r, Kept) else r
        if isinstance(stored, torch.Tensor):
            ptr = stored.untyped_storage().data_ptr()
            if ptr not in model_ptrs:
                storages[ptr] = stored.untyped_storage().nbytes()
        else:
            objects[id(stored)] = _object_bytes(stored)
    return sum(objects.values()) + sum(storages.values())


@pytest.mark.parametrize("name", NAMES)
def test_memory_stats_match_an_independent_count(name):
    model, run = build(name)
    controller = gactx.Controller(model, level="L1.2")
    held = held_bytes(model, controller, run)
    stats = controller.memory_stats()
    assert stats.original_bytes == saved_storages(model, run)
    assert stats.packed_bytes == held
    assert stats.packed_bytes < stats.original_bytes


def _live(kind) -> int:
    return len(live(kind))


@pytest.mark.parametrize("name", NAMES)
def test_no_handles_or_tensors_leak_over_200_steps(name):
    model, run = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Counted from what is alive before: a failed test's traceback elsewhere in this process may hold some.
    packed, quantized, native = _live(Packed), _live(QuantizedTensor), native_handles()
    controller = gactx.Controller(model, level="L1").install_hook()
    try:
        for step in range(200):
            torch.manual_seed(step)
            loss = run()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            controller.iterate()
            del loss
            if step == 9:
                tensors_at_10 = _live(torch.Tensor)
                assert _live(Packed) == packed and _live(QuantizedTensor) == quantized
                assert native_handles() == native
    finally:
        controller.uninstall_hook()
    assert controller.step == 200
    assert _live(Packed) == packed and _live(QuantizedTensor) == quantized and native_handles() == native
    assert _live(torch.Tensor) <= tensors_at_10


@pytest.mark.parametrize("level", ["L0", "L1.1"])
def test_retain_graph_allows_two_backward_passes(level):
    model, run = build("resnet")
    controller = gactx.Controller(model, level=level)
    controller.install_hook()
    loss = run()
    controller.uninstall_hook()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()  # every handle is unpacked a second time and must decode the same
    for a, p in zip(first, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)


@pytest.mark.parametrize("level", ["L0", "L1.1"])
def test_double_backward_through_compressed_tensors(level):
    model, run = build("mlp")

    def penalty(controller):
        torch.manual_seed(0)
        model.zero_grad()
        if controller:
            controller.install_hook()
        loss = run()
        g = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        total = loss + sum(x.square().sum() for x in g)
        if controller:
            controller.uninstall_hook()
        total.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    plain = penalty(None)
    got = penalty(gactx.Controller(model, level=level))
    if level == "L0":
        assert torch.equal(got, plain)
    else:
        assert F.cosine_similarity(got, plain, dim=0) >= 0.999


def _ratios(level):
    """(name, original MiB, ratio, share of gactx's bytes that are integer tensors it must keep)."""
    from benchmarks.zoo import REALISTIC_SCALE

    rows = []
    for name in NAMES:
        model, run = build(name, REALISTIC_SCALE[name])
        controller = gactx.Controller(model, level=level)
        with controller:
            torch.manual_seed(0)
            run()
        stats = controller.memory_stats()
        integer = sum(n for why, n in stats.kept_by_reason.items() if "int" in why)
        rows.append((name, stats.original_bytes / 2**20, stats.ratio, integer / stats.packed_bytes))
    return rows


def test_compression_ratios_over_the_zoo_at_realistic_sizes():
    """The issue's bar: median >= 10x at L1.2 and >= 6x at L1, float32 models, dedupe and metadata counted.
    A model below 6x at L1.2 must owe it to integer tensors it has to keep (indices, RNN workspaces)."""
    import statistics

    at_2_bits, at_4_bits = _ratios("L1.2"), _ratios("L1")
    assert all(mib >= 2 for _, mib, _, _ in at_2_bits), "every model should save several MB"
    assert statistics.median(r for _, _, r, _ in at_2_bits) >= 10
    assert statistics.median(r for _, _, r, _ in at_4_bits) >= 6
    for name, _, ratio, integer_share in at_2_bits:
        assert ratio >= 6 or integer_share >= 0.5, f"{name}: {ratio:.2f}x and only {integer_share:.0%} integers kept"
