"""gactx/kernels/schemes/uniform/dequantize.py: the Triton kernel against its torch twin, round-trip error and SNR."""

import pytest
import torch

from gactx.kernels.schemes.uniform.dequantize import triton_dequantize
from gactx.kernels.schemes.uniform.reference import torch_dequantize, torch_quantize
from tests.conftest import TRITON_DEVICE
from tests.helpers import assert_same_bits, extreme_input, group_steps
from tests.kernels.schemes.uniform.test_quantize import BITS, DTYPES, SIZES, _sample, _special


def _decode_both(codes, meta, bits, group_size, n, dtype):
    interpret = codes.device.type == "cpu"
    return (
        triton_dequantize(codes, meta, bits, group_size, n, dtype, interpret=interpret),
        torch_dequantize(codes, meta, bits, group_size, n, dtype),
    )


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_and_torch_decode_identically(triton_device, n, bits, dtype):
    x = _sample(n, dtype, triton_device)
    codes, meta = torch_quantize(x, bits, 32, True, 3)
    a, b = _decode_both(codes, meta, bits, 32, n, dtype)
    assert a.dtype == dtype and a.shape == (n,)
    assert_same_bits(a, b)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_decode_identically_and_keep_non_finite(triton_device, bits, dtype):
    x = _special(dtype, triton_device)
    codes, meta = torch_quantize(x, bits, 32, False, 0)
    a, b = _decode_both(codes, meta, bits, 32, x.numel(), dtype)
    assert_same_bits(a, b)
    x, a = x.float().cpu(), a.float().cpu()
    assert torch.equal(~torch.isfinite(a), ~torch.isfinite(x)), "a non-finite value was made finite, or the reverse"
    assert a[170] == float("inf") and a[200] == -float("inf") and a[201] == -float("inf")
    assert a[130].isnan() and a[150].isnan() and a[230].isnan() and a[231].isnan() and a[256:288].isnan().all()
    assert (a[0:32] == 7.0).all(), "a constant group must come back exactly"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_launch_configuration_decodes_identically_across_programs_and_tail(bits, dtype):
    """The GPU's meta-parameters (whole programs, then a masked one), run by the interpreter. bfloat16 output is
    left out: compiled, it uses the hardware conversion, which the interpreter's cast (truncation) is not."""
    n = 2 * 8192 + 300
    codes, meta = torch_quantize(_sample(n, dtype, TRITON_DEVICE), bits, 256, True, 3)
    a = triton_dequantize(codes, meta, bits, 256, n, dtype, interpret=False)
    assert_same_bits(a, torch_dequantize(codes, meta, bits, 256, n, dtype))


@pytest.mark.parametrize("bits", BITS)
def test_finite_values_of_a_non_finite_group_stay_within_a_step(bits):
    x = torch.linspace(-2, 3, 64)
    x[5], x[20], x[40] = float("nan"), float("inf"), -float("inf")
    codes, meta = torch_quantize(x, bits, 32, False, 0)
    xhat = torch_dequantize(codes, meta, bits, 32, 64, torch.float32)
    finite = torch.isfinite(x)
    step = group_steps(meta, 32, 64)
    if bits > 1:
        assert ((xhat - x).abs()[finite] <= step[finite] / 2 * (1 + 1e-5)).all()
    else:  # one level left for finite values: they come back as zero
        assert (xhat[finite][:30] == 0).all()
    assert xhat[5].isnan() and xhat[20].isnan()  # NaN and +Inf in one group: both NaN
    assert xhat[40] == -float("inf")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_round_trip_is_within_half_a_step(bits, dtype):
    x = _sample(4099, dtype, "cpu")
    codes, meta = torch_quantize(x, bits, 256, False, 0)
    xhat = torch_dequantize(codes, meta, bits, 256, x.numel(), torch.float32)
    step = group_steps(meta, 256, x.numel())
    assert ((xhat - x.float()).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all()


# Signal-to-noise floors (dB) of stochastic rounding on Gaussian data at group size 256 (a group spans
# about 5.5 sigma; each bit adds ~6 dB). Measured with this seed: 1 bit -8.4, 2 bits 2.3, 4 bits 16.3,
# 8 bits 40.9; the floors leave about 1 dB.
SNR_FLOOR_DB = {1: -9.5, 2: 1.3, 4: 15.3, 8: 39.9}


@pytest.mark.parametrize("bits", BITS)
def test_signal_to_noise_floor(bits):
    x = _sample(1 << 16, torch.float32, "cpu", seed=5) - 1
    codes, meta = torch_quantize(x, bits, 256, True, 0)
    xhat = torch_dequantize(codes, meta, bits, 256, x.numel(), torch.float32)
    snr = 10 * torch.log10(x.pow(2).mean() / (xhat - x).pow(2).mean())
    assert snr >= SNR_FLOOR_DB[bits]


@pytest.mark.parametrize("bits", BITS)
def test_values_near_float32_max_never_decode_to_inf(triton_device, bits):
    big = torch.finfo(torch.float32).max * 0.99999
    x = torch.tensor([0.0, big, -big, big] + [big] * 28 + [float("nan"), big, -big] + [1.0] * 29, device=triton_device)
    codes, meta = torch_quantize(x, bits, 32, True, 1)
    a, b = _decode_both(codes, meta, bits, 32, x.numel(), torch.float32)
    assert_same_bits(a, b)
    assert torch.isfinite(a[:32]).all() and torch.isfinite(a[33:]).all() and a[32].isnan()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_groups_decode_identically_and_saturate_at_the_dtype_maximum(triton_device, bits, dtype):
    """Groups at the edges of the range decode to identical bits in both implementations; a 16-bit output is
    the float32 decode saturated at the dtype's largest finite value, then rounded: finite, and within a step
    (plus the dtype's rounding) of the input."""
    x = extreme_input(dtype).to(triton_device)
    codes, meta = torch_quantize(x, bits, 32, True, 3)
    a, b = _decode_both(codes, meta, bits, 32, x.numel(), dtype)
    assert_same_bits(a, b)
    top = torch.finfo(dtype).max
    wide = torch_dequantize(codes, meta, bits, 32, x.numel(), torch.float32)
    assert_same_bits(b, wide.clamp(-top, top).to(dtype))
    assert torch.isfinite(a).all()
    step = group_steps(meta, 32, x.numel()).double()
    error = (a.double() - x.double()).abs()
    assert (error <= step * (1 + 1e-5) + x.double().abs() * torch.finfo(dtype).eps).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_top_level_past_an_overflowing_product_decodes_in_range(triton_device, bits):
    """A span just under FLT_MAX from a negative minimum: ``L * step`` (the margin included) overflows, the top
    level ``lo + L * step`` does not. It decodes to the maximum, not to FLT_MAX (1e38 away)."""
    big = torch.finfo(torch.float32).max - 1e38
    x = torch.tensor([big, -1e38, 0.0] + [big] * 29, device=triton_device)
    codes, meta = torch_quantize(x, bits, 32, False, 0)
    assert (1 << bits) - 1 >= 3 and torch.isinf(((1 << bits) - 1) * meta[:, 1]).all()
    a, b = _decode_both(codes, meta, bits, 32, 32, torch.float32)
    assert_same_bits(a, b)
    assert ((a.double() - x.double()).abs() <= meta[0, 1].double() / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", BITS)
def test_16_bit_inputs_near_their_maximum_come_back_finite(triton_device, dtype, bits):
    top = torch.finfo(dtype).max
    x = torch.tensor([top, -top / 3, 0.0, top * 0.9] * 8, dtype=dtype, device=triton_device)
    for stochastic in (False, True):
        codes, meta = torch_quantize(x, bits, 32, stochastic, 4)
        a, b = _decode_both(codes, meta, bits, 32, x.numel(), dtype)
        assert_same_bits(a, b)
        assert torch.isfinite(a).all()
        assert ((a.double() - x.double()).abs() <= meta[0, 1].double() * (1 + 1e-5) + top * 2**-8).all()
