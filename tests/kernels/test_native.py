"""Replayed saves packed by native launches on a GPU (gactx.kernels.native): the bytes that Triton's launcher stores
for the same call, and a model's gradients alike either way. On a machine with no GPU these skip; the recording
driver's tests (test_launch_record.py) hold the launches there, byte for byte."""

import pytest
import torch

import gactx
from gactx.kernels import native
from gactx.kernels.functional import dequantize_flat, quantize_flat
from gactx.kernels.tables import triton_decode_table, triton_encode_bins

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
SEED = (1 << 60) + 99


@cuda
@pytest.mark.parametrize("n", [1 << 18, (1 << 18) + 77])  # a whole number of programs, and a rest
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_native_packer_stores_and_decodes_what_tritons_launches_do(dtype, bits, stochastic, n):
    x = (torch.randn(n, device="cuda") * 3).to(dtype)
    packer = native.quantize_packer(x, bits, 256, stochastic)
    assert packer is not None and packer.launching, native.why_not(x)
    handle = packer(x, SEED)
    codes, meta = quantize_flat(x, bits, 256, stochastic, SEED, "triton")
    offset = -(-codes.numel() // 16) * 16
    assert torch.equal(handle.data[: codes.numel()], codes)
    assert torch.equal(handle.data[offset : offset + meta.numel() * 4].view(torch.float32), meta.view(-1))
    expected = dequantize_flat(codes, meta, bits, 256, x.shape, dtype, "triton")
    del x  # freed: the handle decodes its codes
    assert torch.equal(handle.unpack(), expected)


@cuda
@pytest.mark.parametrize("n", [1 << 18, (1 << 18) + 77])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_native_bins_packer_stores_and_decodes_what_tritons_launches_do(dtype, bits, n):
    x = torch.randn(n, device="cuda").to(dtype)
    edges = torch.linspace(-2, 2, (1 << bits) - 1, device="cuda").to(dtype)
    table = torch.linspace(0, 1, 1 << bits, device="cuda").to(dtype)
    packer = native.bins_packer(x, edges, bits, table)
    assert packer is not None and packer.launching, native.why_not(x)
    handle = packer(x, SEED)
    codes = triton_encode_bins(x, edges, bits)
    assert torch.equal(handle.data, codes)
    del x
    assert torch.equal(handle.unpack(), triton_decode_table(codes, table, n, bits))


def _grads(dtype, monkeypatch, enabled: bool):
    monkeypatch.setattr(native, "ENABLED", enabled)
    torch.manual_seed(0)
    width = 256
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    model = model.to("cuda", dtype)
    x = torch.randn(64, width, device="cuda", dtype=dtype)
    controller = gactx.Controller(model, level="L1")
    with controller:
        for _ in range(3):
            model(x).float().square().mean().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            controller.iterate()
    return grads, controller.report()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_on_a_gpu_gets_the_same_gradients_by_native_launches_and_by_tritons_launcher(dtype, monkeypatch):
    launched, report = _grads(dtype, monkeypatch, True)
    through_triton, other = _grads(dtype, monkeypatch, False)
    assert all(torch.equal(a, b) for a, b in zip(launched, through_triton, strict=True))
    assert "replayed saves on cuda: 8 of 8 packed by native launches" in report, report
    assert "through Triton's launcher (native.ENABLED is False)" in other, other


@cuda
def test_a_compiled_model_on_a_gpu_stores_its_saves_by_native_launches(monkeypatch):
    torch.manual_seed(0)
    width = 256
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    model = model.cuda()
    x = torch.randn(64, width, device="cuda")
    model(x).square().mean().backward()
    plain = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    controller = gactx.Controller(model, level="L1.1")
    forward = torch.compile(model)
    with controller:
        for _ in range(2):
            forward(x).square().mean().backward()
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            controller.iterate()
    assert torch.nn.functional.cosine_similarity(got, plain, dim=0) > 0.999
    assert "compiled graphs' saves stored by native launches" in controller.report(), controller.report()


@cuda
def test_a_graph_replayed_by_cuda_graphs_draws_new_noise_at_every_replay():
    # mode="reduce-overhead": the quantize reads a seed its own launch advances on the device, so that the gradients
    # of two replays on the same weights and data differ (one seed replayed would give the same ones).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    controller = gactx.Controller(model, level="L1")
    forward = torch.compile(model, mode="reduce-overhead")
    grads = []
    with controller:
        for _ in range(5):
            forward(x).square().mean().backward()
            grads.append(model[0].weight.grad.clone())
            model.zero_grad(set_to_none=True)
            controller.iterate()
    assert not torch.equal(grads[-1], grads[-2]) and not torch.equal(grads[-2], grads[-3])
    assert "compiled graphs' saves stored by native launches" in controller.report()


def test_what_cannot_take_native_launches_says_why():
    assert native.why_not(torch.empty(3)) == "a CPU tensor (the C++ kernels serve it)"
    assert native.quantize_packer(torch.empty(3), 4, 256, True) is None
    assert native.why_not(torch.empty(3, device="meta")) == "a meta tensor"
