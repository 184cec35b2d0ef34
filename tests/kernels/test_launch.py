"""gactx/kernels/_triton.py's launch: a kernel bound once per configuration, launched as Triton launches it."""

import pytest
import torch

from gactx.kernels import _triton
from gactx.kernels.schemes.uniform.dequantize import triton_dequantize
from gactx.kernels.schemes.uniform.quantize import triton_quantize
from gactx.kernels.tables import triton_decode_table, triton_encode_bins
from tests.conftest import needs_cuda


class _Compiled:
    """What a Triton launch returns: the compiled kernel, whose launcher records its calls."""

    def __init__(self, calls: list) -> None:
        self.function, self.packed_metadata, self.calls = "function", "metadata", calls

    def run(self, *args) -> None:
        self.calls.append(args)


class _Kernel:
    """A JIT kernel of signature (x_ptr, n, BLOCK): its Triton launches counted, the compiled kernel returned."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self) -> None:
        self.launches, self.calls, self.compiled = 0, [], []

    def __getitem__(self, grid):
        def go(*args, **meta):
            self.launches += 1
            self.compiled.append(_Compiled(self.calls))
            return self.compiled[-1]

        return go


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(_triton, "DIRECT", True)
    monkeypatch.setattr(_triton, "_BOUND", {})
    monkeypatch.setattr(_triton, "_device", lambda: 0)
    monkeypatch.setattr(_triton, "_stream", lambda device: 7)
    monkeypatch.setattr(_triton.triton.knobs.runtime, "launch_enter_hook", _triton.triton.knobs.HookChain())
    monkeypatch.setattr(_triton.triton.knobs.runtime, "launch_exit_hook", _triton.triton.knobs.HookChain())


def test_a_configuration_is_bound_once_then_launched_with_every_argument(direct):
    kernel = _Kernel()
    x = torch.zeros(64)
    _triton.launch(kernel, 3, x, 100, BLOCK=128, num_warps=4)
    assert kernel.launches == 1 and not kernel.calls  # Triton's own launch, which compiled it
    _triton.launch(kernel, 5, x, 200, BLOCK=128, num_warps=4)
    assert kernel.launches == 1
    # Triton 3.3 and later: the grid, the stream, the function, its metadata, launch metadata and hooks, then every
    # argument of the signature, constexprs included, in its order (options such as num_warps are not arguments).
    hooks = _triton.triton.knobs.runtime
    call = (5, 1, 1, 7, "function", "metadata", None, hooks.launch_enter_hook, hooks.launch_exit_hook, x, 200, 128)
    assert kernel.calls == [call]


def test_a_launch_hook_takes_tritons_own_launch(direct):
    """A profiler's hook (Triton's knobs) needs the launch metadata Triton's own launch makes."""
    kernel = _Kernel()
    _triton.triton.knobs.runtime.launch_enter_hook.add(lambda metadata: None)
    for _ in range(2):
        _triton.launch(kernel, 1, torch.zeros(4), 4, BLOCK=128)
    assert kernel.launches == 2 and not kernel.calls


def test_what_triton_specializes_on_binds_anew(direct):
    kernel = _Kernel()
    buffer = torch.zeros(64)
    for args, meta in [
        ((buffer, 100), dict(BLOCK=128)),
        ((buffer, 100), dict(BLOCK=256)),  # a meta-parameter
        ((buffer[1:], 100), dict(BLOCK=128)),  # a pointer not 16-byte aligned
        ((buffer.double(), 100), dict(BLOCK=128)),  # a dtype
        ((buffer, 1 << 31), dict(BLOCK=128)),  # an int64 size
    ]:
        _triton.launch(kernel, 1, *args, **meta)
    assert kernel.launches == 5 and not kernel.calls


def test_a_kernel_of_another_convention_turns_the_direct_launch_off(direct):
    kernel = _Kernel()
    kernel.arg_names = ["x_ptr", "n", "BLOCK", "EXTRA"]  # an argument neither given nor a meta-parameter
    _triton.launch(kernel, 1, torch.zeros(4), 4, BLOCK=128)
    assert _triton.DIRECT is False
    _triton.launch(kernel, 1, torch.zeros(4), 4, BLOCK=128)
    assert kernel.launches == 2 and not kernel.calls


@needs_cuda
def test_direct_launches_give_tritons_own_bytes(monkeypatch):
    """On a GPU: each kernel through Triton's own launch, then bound (first call) and launched directly (second),
    aligned and not: the same bytes."""
    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(3 * 4096 + 77 + 4, generator=g).cuda()
    edges = torch.linspace(-2, 2, 255, device="cuda")
    table = torch.randn(256, generator=g).cuda()

    def results(x):
        codes, meta = triton_quantize(x, 4, 256, True, 11)
        binned = triton_encode_bins(x, edges, 8)
        return (codes, meta, triton_dequantize(codes, meta, 4, 256, x.numel(), torch.float32), binned,
                triton_decode_table(binned, table, x.numel(), 8))  # fmt: skip

    for x in (buffer[: 3 * 4096 + 77], buffer[1 : 3 * 4096 + 78]):  # aligned, then 4 bytes off
        monkeypatch.setattr(_triton, "DIRECT", False)
        expected = results(x)
        monkeypatch.setattr(_triton, "DIRECT", True)
        for _ in range(2):
            for a, b in zip(results(x), expected, strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert _triton.DIRECT, "the direct launch turned itself off: Triton's launch convention changed"
