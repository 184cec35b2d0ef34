"""gactx/kernels/schemes/normal: the normal scheme's Triton kernels against their torch twins, unbiasedness, error
bounds, special and extreme values, and the public API's ``scheme=``."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import gactx
from gactx.kernels.format import expected_nbytes, pack_planes, unpack_planes
from gactx.kernels.schemes.normal import (
    NORMAL_BITS,
    normal_levels,
    normal_nbytes,
    torch_normal_dequantize,
    torch_normal_quantize,
    triton_normal_dequantize,
    triton_normal_quantize,
)
from tests.conftest import INTERPRET, TRITON_DEVICE
from tests.helpers import extreme_input

SIZES = [1, 255, 257, 4099]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _sample(n: int, dtype: torch.dtype, device: str, seed: int = 0, outlier: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3 + 1
    if outlier:
        x[::97] = 25.0  # one group in three or so holds an outlier: a tail of its own
    return x.to(dtype).to(device)


def _special(dtype: torch.dtype, device: str) -> torch.Tensor:
    """Constant groups, huge and tiny magnitudes, and groups with NaN / +-Inf, in groups of 32."""
    big = 6e4 if dtype == torch.float16 else 1e37
    tiny = 1e-7 if dtype == torch.float16 else 1e-40
    x = torch.linspace(-1, 1, 32 * 10, dtype=torch.float32)
    x[0:32] = 7.0  # constant group
    x[32:64] *= big
    x[64:96] *= tiny
    x[96:128] = torch.randn(32, generator=torch.Generator().manual_seed(1)) * tiny * 3
    x[130], x[150] = float("nan"), float("inf")  # NaN and +Inf: the group's value is NaN
    x[170] = float("inf")  # +Inf alone
    x[200], x[201] = -float("inf"), -float("inf")  # -Inf only
    x[230], x[231] = float("inf"), -float("inf")  # both infinities
    x[256:288] = float("nan")  # no finite value at all
    x[300:302] = torch.tensor([-0.0, 0.0])
    return x.to(dtype).to(device)


def _both(x: torch.Tensor, bits: int, group_size: int, stochastic: bool = False, seed: int = 0):
    flat = x.reshape(-1)
    return (
        triton_normal_quantize(flat, bits, group_size, stochastic, seed, interpret=x.device.type == "cpu"),
        torch_normal_quantize(flat, bits, group_size, stochastic, seed),
    )


def _decode_both(codes, meta, bits, group_size, n, dtype):
    interpret = codes.device.type == "cpu"
    a = triton_normal_dequantize(codes, meta, bits, group_size, n, dtype, interpret=interpret)
    b = torch_normal_dequantize(codes, meta, bits, group_size, n, dtype)
    return a, b


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Identical bits, any NaN equal to any NaN (a decoded NaN's payload is the cast's)."""
    if a.dtype.is_floating_point:
        if not torch.equal(a.isnan(), b.isnan()):
            return False
        a, b = a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)
        view = {4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


def _gaps(x: torch.Tensor, bits: int, group_size: int):
    """Each element's level below and above (float64, flat): stochastic rounding picks one of them."""
    _, below, above, _ = normal_levels(x.reshape(-1).cpu(), bits, group_size)
    n = x.numel()
    return below.reshape(-1)[:n].double(), above.reshape(-1)[:n].double()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", NORMAL_BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 256])
def test_triton_and_torch_produce_identical_bytes(triton_device, n, bits, dtype, group_size):
    x = _sample(n, dtype, triton_device)
    (codes_a, meta_a), (codes_b, meta_b) = _both(x, bits, group_size)
    n_groups = -(-n // group_size)
    assert codes_a.numel() == n_groups * group_size * bits // 8 and meta_a.shape == (n_groups, 3)
    assert meta_a.dtype == torch.int32
    assert torch.equal(codes_a, codes_b) and torch.equal(meta_a, meta_b)
    a, b = _decode_both(codes_a, meta_a, bits, group_size, n, dtype)
    assert _same(a, b) and a.dtype == dtype


@pytest.mark.parametrize("group_size", [64, 512, 4096])
def test_identical_bytes_across_group_sizes(triton_device, group_size):
    (codes_a, meta_a), (codes_b, meta_b) = _both(_sample(4099, torch.float32, triton_device), 4, group_size)
    assert torch.equal(codes_a, codes_b) and torch.equal(meta_a, meta_b)


@pytest.mark.parametrize("bits", NORMAL_BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_identical_bytes_and_kept_at_their_places(triton_device, bits, dtype):
    x = _special(dtype, triton_device)
    (codes_a, meta_a), (codes_b, meta_b) = _both(x, bits, 32)
    assert torch.equal(codes_a, codes_b) and torch.equal(meta_a, meta_b)
    a, b = _decode_both(codes_a, meta_a, bits, 32, x.numel(), dtype)
    assert _same(a, b)
    y, xf = a.float().cpu(), x.float().cpu()
    assert torch.equal(torch.isfinite(y), torch.isfinite(xf)), "non-finite values must stay at their places"
    assert y[170] == float("inf") and (y[200:202] == -float("inf")).all()  # a group's only non-finite value
    assert y[130].isnan() and y[150].isnan() and y[230].isnan() and y[256:288].isnan().all()
    assert (y[0:32] == 7.0).all(), "a constant group decodes exactly"
    below, above = _gaps(x.cpu(), bits, 32)
    fin = torch.isfinite(xf)
    below, above = below.to(dtype).double(), above.to(dtype).double()  # the output cast keeps the order
    within = (y.double() >= below) & (y.double() <= above)
    assert within[fin].all()


@pytest.mark.parametrize("bits", NORMAL_BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_extreme_groups_decode_finite_and_between_their_levels(triton_device, bits, dtype, stochastic):
    """Spans past FLT_MAX, +-65504 in float16, ends at the largest finite value: identical metadata (and bytes
    when deterministic), every element decoded finite, between its two levels."""
    x = extreme_input(dtype).to(triton_device)
    (codes_a, meta_a), (codes_b, meta_b) = _both(x, bits, 32, stochastic, seed=5)
    assert torch.equal(meta_a, meta_b)
    if not stochastic:
        assert torch.equal(codes_a, codes_b)
    below, above = _gaps(x.cpu(), bits, 32)
    top = torch.finfo(torch.float32).max  # decoded to float32 below
    for codes, meta in ((codes_a, meta_a), (codes_b, meta_b)):
        y = torch_normal_dequantize(codes.cpu(), meta.cpu(), bits, 32, x.numel(), torch.float32).double()
        assert torch.isfinite(y).all()
        assert ((y >= below.clamp(-top, top)) & (y <= above.clamp(-top, top))).all()


def test_gpu_configuration_matches_the_twin_across_programs_and_tail():
    """The GPU's meta-parameters (whole programs of 4096 elements, then masked ones of 2048), interpreted."""
    n = 2 * 4096 + 2048 + 300
    x = _sample(n, torch.bfloat16, TRITON_DEVICE, seed=3)
    for bits in NORMAL_BITS:
        codes_a, meta_a = triton_normal_quantize(x, bits, 256, False, 5, interpret=False)
        codes_b, meta_b = torch_normal_quantize(x, bits, 256, False, 5)
        assert torch.equal(codes_a, codes_b) and torch.equal(meta_a, meta_b)
        # float32 out: the compiled path's bfloat16 cast (EMULATE off) is the hardware's, which the interpreter
        # truncates instead
        a = triton_normal_dequantize(codes_a, meta_a, bits, 256, n, torch.float32, interpret=False)
        assert _same(a, torch_normal_dequantize(codes_b, meta_b, bits, 256, n, torch.float32))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bits", NORMAL_BITS)
def test_stochastic_rounding_is_unbiased_and_within_a_level_gap(impl, bits):
    n, group = 257, 32
    seeds = 300 if impl == "torch" else 100
    x = _sample(n, torch.float32, "cpu", seed=1)
    below, above = _gaps(x, bits, group)
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(seeds):
        if impl == "torch":
            codes, meta = torch_normal_quantize(x, bits, group, True, seed)
        else:
            codes, meta = triton_normal_quantize(x.to(TRITON_DEVICE), bits, group, True, seed, interpret=INTERPRET)
        y = torch_normal_dequantize(codes.cpu(), meta.cpu(), bits, group, n, torch.float32).double()
        assert ((y == below) | (y == above)).all(), "an element left its two neighbouring levels"
        total += y
    # A draw's variance is at most gap**2 / 4: the mean is within 5 standard errors of x.
    bound = 5 * (above - below) / 2 / seeds**0.5 + 1e-6
    assert ((total / seeds - x.double()).abs() <= bound).all()


def test_deterministic_rounding_is_within_half_a_gap():
    x = _sample(4099, torch.float32, "cpu", seed=2)
    for bits in NORMAL_BITS:
        codes, meta = torch_normal_quantize(x, bits, 256, False, 0)
        y = torch_normal_dequantize(codes, meta, bits, 256, x.numel(), torch.float32).double()
        below, above = _gaps(x, bits, 256)
        assert ((y - x.double()).abs() <= (above - below) / 2 * (1 + 1e-6) + 1e-12).all()


def test_levels_are_min_and_max_outermost_and_tails_go_to_the_outlier():
    """A group of normal values and one outlier: code 0 is the min, the top code at or just above the max (the
    margin), and the 4-bit inner segment is much finer than the uniform step."""
    x = _sample(256, torch.float32, "cpu", seed=4, outlier=False)
    x[7] = 40.0
    codes, meta = torch_normal_quantize(x, 4, 256, False, 0)
    q = unpack_planes(codes, 4, 256).view(-1)
    y = torch_normal_dequantize(codes, meta, 4, 256, 256, torch.float32)
    assert y[x.argmin()] == x.min() and q[x.argmin()] == 0
    assert q[7] == 15 and 40.0 <= y[7] <= 40.0 * (1 + 2**-18)
    levels = torch.unique(y)
    inner = levels[(levels > -2) & (levels < 4)].diff().max()
    assert inner < (x.max() - x.min()) / 15 / 2  # (the outlier widens the fitted spread, hence 1.7 x 3.9)


def test_an_empty_tail_gives_its_intervals_to_the_inner_segment():
    """Values uniform on [0, 1]: the fitted normal's tails reach past min and max, so the 15 intervals are
    all inner: a uniform grid."""
    x = torch.linspace(0, 1, 256)
    codes, meta = torch_normal_quantize(x, 4, 256, False, 0)
    levels = torch_normal_dequantize(torch.tensor([16 * q + q for q in range(16)], dtype=torch.uint8).repeat(8),
                                     meta, 4, 256, 256, torch.float32)[:16]  # fmt: skip
    assert levels[0] == 0.0 and levels[-1] >= 1.0
    gaps = levels.diff()
    assert torch.allclose(gaps, gaps[0].expand(15), rtol=1e-5)


def test_stochastic_noise_depends_on_seed_only(triton_device):
    x = _sample(4099, torch.float32, triton_device)
    for impl in (triton_normal_quantize, torch_normal_quantize):
        kwargs = {"interpret": triton_device == "cpu"} if impl is triton_normal_quantize else {}
        a, _ = impl(x, 2, 256, True, 7, **kwargs)
        b, _ = impl(x, 2, 256, True, 7, **kwargs)
        c, _ = impl(x, 2, 256, True, 8, **kwargs)
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_metadata_is_lo_hi_and_two_fractions():
    x = torch.tensor([2.0, 5.0, 3.0, 4.0] * 8)
    _, meta = torch_normal_quantize(x, 2, 32, False, 0)
    lo, hi = meta[0, :2].view(torch.float32).tolist()
    c16, d16 = int(meta[0, 2]) & 0xFFFF, (int(meta[0, 2]) >> 16) & 0xFFFF
    assert (lo, hi) == (2.0, 5.0)
    assert c16 == 32768 and abs(d16 / 65536 * 3 - 1.118) < 0.01  # mean 3.5, standard deviation sqrt(1.25)
    assert normal_nbytes(4099, 4, 256) == 17 * 128 + 17 * 12 == expected_nbytes(4099, torch.float32, 4, 256, "normal")


finite_floats = st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32)
any_floats = st.one_of(finite_floats, st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0]))


@settings(max_examples=60)
@given(
    data=arrays(np.float32, st.integers(1, 300), elements=st.one_of(finite_floats, any_floats)),
    bits=st.sampled_from(NORMAL_BITS),
    group_size=st.sampled_from([32, 64, 256]),
    dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([1.0, 1e-38, 1e-30, 1e8]),
)
def test_properties(data, bits, group_size, dtype, scale):
    """Codes survive pack and unpack; non-finite values stay at their places; finite ones come back finite,
    between their two levels (then cast); nbytes is the formula."""
    x = (torch.from_numpy(data) * scale).to(dtype)
    codes, meta = torch_normal_quantize(x, bits, group_size, True, 3)
    q = unpack_planes(codes, bits, group_size)
    assert torch.equal(pack_planes(q, bits), codes) and int(q.max()) < 1 << bits
    y = torch_normal_dequantize(codes, meta, bits, group_size, x.numel(), dtype)
    xf, yf = x.float(), y.float()
    assert torch.equal(torch.isfinite(xf), torch.isfinite(yf))
    below, above = _gaps(x, bits, group_size)
    fin = torch.isfinite(xf)
    y32 = torch_normal_dequantize(codes, meta, bits, group_size, x.numel(), torch.float32).double()
    assert ((y32 >= below) & (y32 <= above))[fin].all()
    assert codes.numel() + meta.numel() * 4 == normal_nbytes(x.numel(), bits, group_size)


@settings(max_examples=15)
@given(
    data=arrays(np.float32, st.integers(1, 200), elements=any_floats),
    bits=st.sampled_from(NORMAL_BITS),
    dtype=st.sampled_from(DTYPES),
)
def test_properties_triton_matches_the_twin(data, bits, dtype):
    x = torch.from_numpy(data).to(dtype).to(TRITON_DEVICE)
    (codes_a, meta_a), (codes_b, meta_b) = _both(x, bits, 32)
    assert torch.equal(codes_a, codes_b) and torch.equal(meta_a, meta_b)


# ---------------------------------------------------------------------------------------------- public API


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_public_api_round_trip(backend):
    x = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(0)).to(memory_format=torch.channels_last)
    x = x.to(TRITON_DEVICE) if backend == "triton" else x
    for dtype in DTYPES:
        xd = x.to(dtype)
        q = gactx.quantize(xd, 4, 32, scheme="normal", stochastic=False, backend=backend)
        assert q.scheme == "normal" and "scheme='normal'" in repr(q)
        assert q.nbytes == expected_nbytes(xd.numel(), dtype, 4, 32, scheme="normal")
        y = gactx.dequantize(q, backend=backend)
        assert y.shape == xd.shape and y.dtype == dtype and y.stride() == xd.stride()
        flat = xd.permute(0, 2, 3, 1).reshape(-1)
        ref = torch_normal_dequantize(*torch_normal_quantize(flat.cpu(), 4, 32, False, 0), 4, 32, flat.numel(), dtype)
        assert _same(y.permute(0, 2, 3, 1).reshape(-1).cpu(), ref)


def test_public_api_refuses_what_the_scheme_does_not_take():
    x = torch.randn(64)
    for bits in (1, 16, 32):
        with pytest.raises(ValueError, match=r"scheme='normal'.*\(2, 4, 8\)"):
            gactx.quantize(x, bits, scheme="normal")
    with pytest.raises(ValueError, match="allowed values are \\('uniform', 'normal'\\)"):
        gactx.quantize(x, 4, scheme="nf4")
    mask = gactx.quantize(torch.rand(40) > 0.5, 4, scheme="normal")  # bool masks: lossless, whatever the scheme
    assert mask.bits == 1 and mask.meta is None
    assert gactx.quantize(x, 4).scheme == "uniform"
