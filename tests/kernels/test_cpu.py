"""gactx/kernels/cpu.py: the C++ CPU kernels give the torch twins' bytes, round unbiasedly, and allocate
nothing but their output."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gactx
from gactx.kernels import cpu
from gactx.kernels.codes import decode_codes, encode_bins
from gactx.kernels.dequantize import torch_dequantize
from gactx.kernels.quantize import torch_quantize
from tests.helpers import assert_unbiased_at_the_edges, extreme_input, group_steps, same_values, special_input

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=60)
@given(
    n=st.integers(0, 5000),
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([32, 256, 4096]),
    scale=st.sampled_from([1e-30, 1.0, 1e4, 3e38]),
    specials=st.lists(st.sampled_from([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 3e38]), max_size=4),
    seed=st.integers(0, 2**31),
)
def test_deterministic_bytes_and_values_are_the_twins(n, dtype, bits, group, scale, specials, seed):
    x = special_input(n, dtype, seed, scale, specials)
    codes, meta = cpu.quantize(x, bits, group, False, 0)
    twin_codes, twin_meta = torch_quantize(x, bits, group, False, 0)
    assert torch.equal(codes, twin_codes)
    assert same_values(meta, twin_meta)  # equal values; the sign of a zero minimum is the reduction order's
    out = cpu.dequantize(codes, meta, bits, group, n, dtype)
    assert out.dtype == dtype and same_values(out, torch_dequantize(codes, meta, bits, group, n, dtype))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stochastic_rounding_is_unbiased_and_seeded(bits):
    x = torch.randn(4096)
    draws = torch.stack([gactx.dequantize(gactx.quantize(x, bits, seed=s)) for s in range(400)])
    q = gactx.quantize(x, bits, seed=0)
    step = q.meta[:, 1].repeat_interleave(256)
    # The mean of 400 draws is within 5 standard errors of x (the rounding error of one draw is at most a step).
    assert ((draws.mean(0) - x).abs() <= 5 * step / 2 / 400**0.5 + 1e-7).all()
    assert ((draws - x).abs() <= step * (1 + 1e-6)).all(), "never more than a level away"
    assert torch.equal(gactx.quantize(x, bits, seed=7).data, gactx.quantize(x, bits, seed=7).data)
    assert not torch.equal(gactx.quantize(x, bits, seed=7).data, gactx.quantize(x, bits, seed=8).data)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_extreme_groups_are_the_twins_and_decode_within_a_step(dtype, bits):
    """Groups at the edges of the range (spans past FLT_MAX, values near the dtype's maximum): deterministic
    bytes and decoded values (float32 and the dtype) are the twin's; stochastic decodes are finite, within a
    step."""
    x = extreme_input(dtype)
    codes, meta = cpu.quantize(x, bits, 32, False, 0)
    twin_codes, twin_meta = torch_quantize(x, bits, 32, False, 0)
    assert torch.equal(codes, twin_codes) and same_values(meta, twin_meta)
    for out in (torch.float32, dtype):
        decoded = cpu.dequantize(codes, meta, bits, 32, x.numel(), out)
        assert torch.isfinite(decoded).all()
        assert same_values(decoded, torch_dequantize(codes, meta, bits, 32, x.numel(), out))
    codes, meta = cpu.quantize(x, bits, 32, True, 17)
    xhat = cpu.dequantize(codes, meta, bits, 32, x.numel(), torch.float32).double()
    step = group_steps(meta, 32, x.numel()).double()
    assert torch.isfinite(xhat).all() and ((xhat - x.double()).abs() <= step * (1 + 1e-5)).all()


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_stochastic_rounding_is_unbiased_past_the_float32_range(bits):
    assert_unbiased_at_the_edges(lambda x, bits, seed: cpu.quantize(x, bits, 32, True, seed), bits, 300)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bins_are_bucketize_and_decode_through_the_table(dtype, bits):
    edges = torch.linspace(-2, 2, (1 << bits) - 1).to(dtype)
    table = torch.arange(1 << bits).to(dtype)
    x = torch.cat([torch.randn(999) * 2, edges.float(), torch.tensor([float("nan"), float("inf"), -float("inf")])])
    x = x.to(dtype).view(1, -1).expand(3, -1).t()  # a transposed layout: binned in memory order
    coded = encode_bins(x, edges, bits, table, backend="cpp")
    expected = table[torch.bucketize(x, edges)]
    assert torch.equal(decode_codes(coded), expected)
    twin = encode_bins(x, edges, bits, table, backend="torch")
    assert torch.equal(decode_codes(twin), expected)
    assert coded.codes.numel() == -(-x.numel() * bits // 8)
    assert torch.equal(coded.codes, twin.codes), "the same bytes, the codes past the end 0"


def test_auto_is_cpp_on_the_cpu_and_torch_where_the_build_failed(monkeypatch):
    x = torch.randn(1000)
    from gactx.kernels.functional import choose_backend

    assert choose_backend(x, "auto") == "cpp"
    monkeypatch.setitem(cpu._state, "module", None)
    assert choose_backend(x, "auto") == "torch"
    with pytest.raises(RuntimeError, match="could not be built"):
        gactx.quantize(x, 2, backend="cpp")
    q = gactx.quantize(x, 2, stochastic=False)
    assert torch.equal(q.data, torch_quantize(x, 2, 256, False, 0)[0])


def test_a_failed_build_warns_and_falls_back(monkeypatch):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpp_extension, "load_inline", fail)
    with pytest.warns(RuntimeWarning, match="falling back to the torch kernels"):
        assert cpu._build() is None


def test_cpp_refuses_other_devices():
    from gactx.kernels.functional import choose_backend

    with pytest.raises(ValueError, match="runs on CPU tensors"):
        choose_backend(torch.randn(10, device="meta"), "cpp")
    with pytest.raises(ValueError, match="a meta tensor has none"):  # quantize says first that it has no values
        gactx.quantize(torch.randn(10, device="meta"), 2, backend="cpp")


@pytest.mark.parametrize("bits", [2, 4])
def test_peak_memory_is_the_output_and_a_group_a_thread(bits):
    x = torch.randn(1 << 20)  # 4 MiB
    q = gactx.quantize(x, bits)
    with gactx.PeakMemory("cpu") as meter:
        q2 = gactx.quantize(x, bits)
    assert meter.peak <= q2.nbytes + 64 * 1024, (meter.peak, q2.nbytes)
    with gactx.PeakMemory("cpu") as meter:
        out = gactx.dequantize(q)
    assert meter.peak <= out.numel() * 4 + 64 * 1024
    with gactx.PeakMemory("cpu") as meter, warnings.catch_warnings():
        gactx.quantize(x, bits, backend="torch")
    assert meter.peak > 4 * x.numel() * 4, "the twins hold temporaries several times the input"


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099])
def test_bool_masks_pack_as_the_twin_and_come_back(n):
    from gactx.kernels.bitmask import torch_pack_bool

    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = cpu.pack_bool(mask)
    assert torch.equal(packed, torch_pack_bool(mask))
    assert torch.equal(cpu.unpack_bool(packed, n), mask)
    assert torch.equal(gactx.dequantize(gactx.quantize(mask, 1)), mask)


def test_one_bit_codes_decode_through_the_table_without_a_mask():
    from gactx.kernels.codes import encode_codes

    t = torch.randn(64, 47).t()  # transposed: decoded in memory order, back in the layout
    table = torch.tensor([-1.5, 2.5])
    coded = encode_codes(t > 0, 1, table, backend="cpp")
    assert torch.equal(decode_codes(coded), torch.where(t > 0, 2.5, -1.5))
    assert decode_codes(coded).stride() == t.stride()


COMPARES = {
    "gt": lambda t, lo, hi: t > lo,
    "open": lambda t, lo, hi: (t > lo) & (t < hi),
    "outside": lambda t, lo, hi: ~((t >= lo) & (t <= hi)),
    "closed": lambda t, lo, hi: (t >= lo) & (t <= hi),
    "ge": lambda t, lo, hi: t >= lo,
    "le": lambda t, lo, hi: t <= hi,
}


@pytest.mark.parametrize("kind", list(COMPARES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 9, 4099])
def test_a_comparison_packs_as_torch_compares_then_packs(kind, dtype, n):
    """Bounds of float32 tensors round to float32 as torch's scalar does (0.1 is not a float32); 16-bit
    tensors' bounds are exact in their dtype (mask_values keeps the others as they are); NaN and the
    bounds themselves included."""
    from gactx.kernels.bitmask import torch_pack_bool

    lo, hi = (0.1, 0.7) if dtype == torch.float32 else (0.125, 0.75)
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[::5] = lo
    x[1::7] = hi
    x[2::11] = float("nan")
    x[3::13] = float("inf")
    expected = COMPARES[kind](x, lo, hi)
    assert torch.equal(cpu.pack_compare(x, kind, lo, hi), torch_pack_bool(expected))


def test_a_mask_is_made_in_one_pass_and_decodes_as_the_tested_one():
    from gactx.kernels.codes import encode_codes, encode_compare

    t = torch.randn(64, 47).t()  # transposed: tested in memory order, back in the layout
    table = torch.tensor([0.0, 1.0])
    coded = encode_compare(t, "gt", 0.0, 0.0, table, backend="auto")
    reference = encode_codes(t > 0, 1, table, backend="torch")
    assert torch.equal(coded.codes.data, reference.codes.data)
    assert torch.equal(decode_codes(coded), decode_codes(reference))
    assert decode_codes(coded).stride() == t.stride()
    assert encode_compare(t, "gt", 0.0, 0.0, table, backend="torch") is None
    assert encode_compare(t.double(), "gt", 0.0, 0.0, table.double()) is None
