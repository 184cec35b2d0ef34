"""gactx/kernels/tables.py: table codes on a GPU in one launch, their bytes those of torch's ops and the C++ kernels."""

import pytest
import torch

from gactx.kernels import cpu
from gactx.kernels.bitmask import torch_pack_bool
from gactx.kernels.codes import decode_codes, encode_bins, encode_codes, encode_compare
from gactx.kernels.fewbit import fewbit_table
from gactx.kernels.tables import (
    COMPARE_KINDS,
    ELEMENTS,
    triton_decode_table,
    triton_encode_bins,
    triton_encode_compare,
)
from tests.conftest import TRITON_DEVICE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Sizes around the GPU's program (ELEMENTS) and the interpreter's, with and without a masked rest.
SIZES = [1, 5, 257, ELEMENTS, 2 * ELEMENTS + 77]


def _values(n: int, dtype: torch.dtype, edges: torch.Tensor) -> torch.Tensor:
    """Normal values, some equal to edges, and the specials: NaN, infinities, signed zeros."""
    g = torch.Generator().manual_seed(n)
    x = (2 * torch.randn(n, generator=g)).to(dtype)
    picks = torch.randint(0, edges.numel(), (n,), generator=g)
    x = torch.where(torch.rand(n, generator=g) < 0.2, edges.cpu()[picks].to(dtype), x)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0], dtype=dtype)
    x[: min(n, 5)] = specials[: min(n, 5)]
    return x.to(TRITON_DEVICE)


def _packed_bins(x: torch.Tensor, edges: torch.Tensor, bits: int) -> torch.Tensor:
    """The torch oracle: torch.bucketize, packed by torch ops (the torch backend of codes.py)."""
    codes = torch.bucketize(x.cpu().float(), edges.cpu().float())
    ct = encode_codes(codes.bool() if bits == 1 else codes, bits, torch.zeros(1 << bits), backend="torch")
    return (ct.codes.data if bits == 1 else ct.codes).cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_bins_are_bucketize_packed(dtype, bits, n):
    table = fewbit_table("gelu", (), bits)
    edges = torch.tensor(table.edges, dtype=dtype, device=TRITON_DEVICE)
    x = _values(n, dtype, edges)
    packed = triton_encode_bins(x, edges, bits, interpret=False)  # the GPU's launch, interpreted here
    assert torch.equal(packed.cpu(), _packed_bins(x, edges, bits))
    if bits > 1 and cpu.available():
        assert torch.equal(packed.cpu(), cpu.encode_bins(x.cpu(), edges.cpu(), bits))


@pytest.mark.parametrize("count", [1, 3, 16, 100, 255])
def test_any_count_of_sorted_edges(count):
    g = torch.Generator().manual_seed(count)
    edges = torch.randn(count, generator=g).sort().values.to(TRITON_DEVICE)
    edges[count // 2 :] = edges[count // 2 :].clamp(min=edges[count // 2].item())  # repeated edges
    x = _values(3000, torch.float32, edges)
    packed = triton_encode_bins(x, edges, 8, interpret=TRITON_DEVICE == "cpu")
    assert torch.equal(packed.cpu(), _packed_bins(x, edges, 8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(COMPARE_KINDS))
@pytest.mark.parametrize("n", [3, 2 * ELEMENTS + 77])
def test_compare_is_the_bool_test_packed(dtype, kind, n):
    lo, hi = -0.5, 1.0
    x = _values(n, dtype, torch.tensor([lo, hi])).cpu()
    v = x.float()
    test = {
        "gt": v > lo,
        "open": (v > lo) & (v < hi),
        "outside": ~((v >= lo) & (v <= hi)),
        "closed": (v >= lo) & (v <= hi),
        "ge": v >= lo,
        "le": v <= hi,
    }[kind]
    packed = triton_encode_compare(x.to(TRITON_DEVICE), kind, lo, hi, interpret=False)
    assert torch.equal(packed.cpu(), torch_pack_bool(test))
    if cpu.available():
        assert torch.equal(packed.cpu(), cpu.pack_compare(x, kind, lo, hi))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_decode_is_the_table_lookup_bit_for_bit(dtype, bits, n):
    g = torch.Generator().manual_seed(n + bits)
    codes = torch.randint(0, 1 << bits, (n,), generator=g)
    table = torch.randn(1 << bits, generator=g).to(dtype)
    table[0] = float("nan")
    table[-1] = -0.0
    ct = encode_codes(codes.bool() if bits == 1 else codes, bits, table, backend="torch")
    packed = (ct.codes.data if bits == 1 else ct.codes).to(TRITON_DEVICE)
    out = triton_decode_table(packed, table.to(TRITON_DEVICE), n, bits, interpret=False).cpu()
    assert out.dtype == dtype
    expected = table[codes]
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    assert torch.equal(out.view(width), expected.view(width))  # NaN and -0.0 included


def _codes(ct):
    return ct.codes.data if ct.bits == 1 else ct.codes


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_codes_module_takes_the_triton_kernels_and_keeps_layouts(bits):
    """encode_bins, encode_compare and decode_codes on the Triton backend: the torch backend's codes and values."""
    x = torch.randn(2, 3, 5, 7).contiguous(memory_format=torch.channels_last).to(TRITON_DEVICE)
    table = fewbit_table("gelu", (), bits)
    edges = torch.tensor(table.edges, device=TRITON_DEVICE)
    points = torch.tensor(table.points, device=TRITON_DEVICE)
    fast = encode_bins(x, edges, bits, points, backend="triton")
    slow = encode_bins(x.cpu(), edges.cpu(), bits, points.cpu(), backend="torch")
    assert torch.equal(_codes(fast).cpu(), _codes(slow))
    out = decode_codes(fast)
    assert out.stride() == x.stride() and torch.equal(out.cpu(), decode_codes(slow))
    mask = encode_compare(x, "gt", 0.0, 0.0, torch.tensor([0.0, 1.0], device=TRITON_DEVICE), backend="triton")
    assert torch.equal(decode_codes(mask).cpu(), (x.cpu() > 0).float())
