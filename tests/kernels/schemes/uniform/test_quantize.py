"""gactx/kernels/schemes/uniform/quantize.py: the Triton kernel against its torch twin, unbiasedness, error bounds."""

import pytest
import torch

from gactx.kernels.schemes.uniform.quantize import triton_quantize
from gactx.kernels.schemes.uniform.reference import torch_quantize
from tests.conftest import INTERPRET, TRITON_DEVICE
from tests.helpers import assert_same_bits, assert_unbiased_at_the_edges, extreme_input, group_steps

SIZES = [1, 255, 257, 4099]
BITS = [1, 2, 4, 8]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _sample(n: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3 + 1).to(dtype).to(device)


def _special(dtype: torch.dtype, device: str) -> torch.Tensor:
    """Constant groups, huge and tiny magnitudes, and groups with NaN / +-Inf, in groups of 32."""
    big = 1e37 if dtype == torch.float32 else (6e4 if dtype == torch.float16 else 1e37)
    tiny = 1e-40 if dtype == torch.float32 else (1e-7 if dtype == torch.float16 else 1e-40)
    x = torch.linspace(-1, 1, 32 * 10, dtype=torch.float32)
    x[0:32] = 7.0  # constant group
    x[32:64] *= big
    x[64:96] *= tiny
    x[96:128] = torch.randn(32) * tiny * 3
    x[130], x[150] = float("nan"), float("inf")  # NaN and +Inf: the group's value is NaN
    x[170] = float("inf")  # +Inf alone
    x[200], x[201] = -float("inf"), -float("inf")  # -Inf only
    x[230], x[231] = float("inf"), -float("inf")  # both infinities
    x[256:288] = float("nan")  # no finite value at all
    return x.to(dtype).to(device)


def _both(x: torch.Tensor, bits: int, group_size: int, stochastic: bool = False, seed: int = 0):
    flat = x.reshape(-1)
    return (
        triton_quantize(flat, bits, group_size, stochastic, seed, interpret=x.device.type == "cpu"),
        torch_quantize(flat, bits, group_size, stochastic, seed),
    )


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 256])
def test_triton_and_torch_produce_identical_bytes(triton_device, n, bits, dtype, group_size):
    (codes_a, meta_a), (codes_b, meta_b) = _both(_sample(n, dtype, triton_device), bits, group_size)
    assert codes_a.numel() == -(-n // group_size) * group_size * bits // 8 and meta_a.shape == (-(-n // group_size), 2)
    assert torch.equal(codes_a, codes_b)
    assert_same_bits(meta_a, meta_b)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_identical_bytes_on_special_values(triton_device, bits, dtype):
    (codes_a, meta_a), (codes_b, meta_b) = _both(_special(dtype, triton_device), bits, 32)
    assert torch.equal(codes_a, codes_b)
    assert_same_bits(meta_a, meta_b)


@pytest.mark.parametrize("group_size", [32, 256, 4096])
def test_identical_bytes_across_group_sizes(triton_device, group_size):
    (codes_a, meta_a), (codes_b, meta_b) = _both(_sample(4099, torch.float32, triton_device), 2, group_size)
    assert torch.equal(codes_a, codes_b)
    assert_same_bits(meta_a, meta_b)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_gpu_launch_configuration_matches_the_twin_across_programs_and_tail(bits, dtype, stochastic):
    """The GPU's meta-parameters (a launch of whole programs of 4096 elements, then one of masked programs of 2048
    for the rest), run by the interpreter: identical bytes in deterministic mode, each code within a step else."""
    n = 2 * 8192 + 2048 + 300
    x = _sample(n, dtype, TRITON_DEVICE, seed=3)
    codes_a, meta_a = triton_quantize(x, bits, 256, stochastic, 5, interpret=False)
    codes_b, meta_b = torch_quantize(x, bits, 256, stochastic, 5)
    assert_same_bits(meta_a, meta_b)
    if not stochastic:
        assert torch.equal(codes_a, codes_b)
    else:
        from gactx.kernels.schemes.uniform.reference import torch_dequantize

        xhat = torch_dequantize(codes_a, meta_a, bits, 256, n, torch.float32)
        assert ((xhat - x.float()).abs() <= group_steps(meta_a, 256, n) * (1 + 1e-5)).all()


def test_metadata_is_group_min_and_step():
    x = torch.tensor([2.0, 5.0, 3.0, 4.0] * 8 + [-1.0] * 32)
    _, meta = torch_quantize(x, 2, 32, False, 0)
    assert meta[0, 0] == 2.0 and meta[0, 1] == pytest.approx(1.0, rel=1e-5)
    assert meta[0, 1] * 3 >= 3.0  # the margin: max - min is inside lo + L * step
    assert meta[1].tolist() == [-1.0, 0.0]  # constant group: step 0


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_stochastic_rounding_is_unbiased(impl, bits):
    from gactx.kernels.schemes.uniform.reference import torch_dequantize

    n, group, seeds = 257, 32, 300 if impl == "torch" else 120
    x = _sample(n, torch.float32, TRITON_DEVICE if impl == "triton" else "cpu", seed=1)
    total = torch.zeros(n, dtype=torch.float64, device=x.device)
    for seed in range(seeds):
        if impl == "torch":
            codes, meta = torch_quantize(x, bits, group, True, seed)
        else:
            codes, meta = triton_quantize(x, bits, group, True, seed, interpret=INTERPRET)
        xhat = torch_dequantize(codes, meta, bits, group, n, torch.float32)
        step = group_steps(meta, group, n)
        assert ((xhat - x).abs() <= step * (1 + 1e-5)).all(), "an element moved by more than one step"
        total += xhat.double()
    # Per element the rounding has variance <= step^2 / 4: the mean is within 5 standard errors.
    bound = 5 * step.double() / 2 / seeds**0.5 + 1e-6
    assert ((total / seeds - x.double()).abs() <= bound).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_extreme_groups_give_identical_bytes_and_decode_within_a_step(triton_device, bits, dtype, stochastic):
    """Finite groups at the edges of the range (float32 and bfloat16 spans past FLT_MAX, float16 near 65504):
    the kernel's metadata, and its bytes when deterministic, are the twin's; every element of either decodes
    finite and within one step of its input (within half a step when deterministic, but at 1 bit where the
    step is clamped to FLT_MAX)."""
    from gactx.kernels.schemes.uniform.reference import torch_dequantize

    x = extreme_input(dtype).to(triton_device)
    (codes_a, meta_a), (codes_b, meta_b) = _both(x, bits, 32, stochastic, seed=5)
    assert_same_bits(meta_a, meta_b)
    if not stochastic:
        assert torch.equal(codes_a, codes_b)
    # The grid of the ends: L steps reach from min to max, plus the margin (a step clamped to FLT_MAX would
    # pass "within a step" without meaning it); at 1 bit FLT_MAX is the most a step can be, less than the span.
    groups = x.cpu().double().view(-1, 32)
    assert (((1 << bits) - 1) * meta_b[:, 1].cpu().double() <= (groups.amax(1) - groups.amin(1)) * (1 + 2**-19)).all()
    step = group_steps(meta_b.cpu(), 32, x.numel()).double()
    reach = 1.0 if stochastic or bits == 1 else 0.5
    for codes, meta in ((codes_a, meta_a), (codes_b, meta_b)):
        xhat = torch_dequantize(codes.cpu(), meta.cpu(), bits, 32, x.numel(), torch.float32).double()
        assert torch.isfinite(xhat).all()
        assert ((xhat - x.cpu().double()).abs() <= step * reach * (1 + 1e-5)).all()


def test_a_span_past_float32_keeps_the_grid_of_its_ends():
    """``[2e38, -2e38, 0, 1e38]`` at 8 bits: lo is the minimum and 255 steps reach the maximum (plus the
    margin), as for any group; the span, 4e38, is not a float32."""
    x = torch.tensor([2e38, -2e38, 0.0, 1e38])
    codes, meta = torch_quantize(x, 8, 32, False, 0)
    lo, step = meta[0].double()
    span = x[0].double() - x[1].double()
    assert lo == x[1] and span < 255 * step <= span * (1 + 2**-19)
    assert codes[:4].tolist() == [255, 0, 127, 191]  # 0 is 127.5 steps above lo less the margin, 1e38 191.25


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_stochastic_rounding_is_unbiased_past_the_float32_range(impl, bits):
    def quantize(x, bits, seed):
        if impl == "torch":
            return torch_quantize(x, bits, 32, True, seed)
        return triton_quantize(x.to(TRITON_DEVICE), bits, 32, True, seed, interpret=INTERPRET)

    assert_unbiased_at_the_edges(quantize, bits, 300 if impl == "torch" else 120)


def test_stochastic_noise_depends_on_seed_only(triton_device):
    x = _sample(4099, torch.float32, triton_device)
    for impl in (triton_quantize, torch_quantize):
        kwargs = {"interpret": triton_device == "cpu"} if impl is triton_quantize else {}
        a, _ = impl(x, 2, 256, True, 7, **kwargs)
        b, _ = impl(x, 2, 256, True, 7, **kwargs)
        c, _ = impl(x, 2, 256, True, 8, **kwargs)
        assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with about 10 GiB free")
def test_offsets_past_two_to_the_31_do_not_wrap():
    n = (1 << 31) + 512  # the last groups sit past 2**31 elements and 2**31 packed bytes at 8 bits
    x = torch.randn(n, dtype=torch.float16, device="cuda")
    codes, meta = triton_quantize(x, 8, 256, False, 0)
    tail_codes, tail_meta = torch_quantize(x[1 << 31 :], 8, 256, False, 0)
    assert torch.equal(codes[1 << 31 :], tail_codes)
    assert_same_bits(meta[(1 << 31) // 256 :], tail_meta)


def test_a_seed_read_on_the_device_draws_the_noise_of_the_same_seed_passed_as_a_value(triton_device):
    # SEED_IN_MEMORY (what a compiled graph captured by CUDA graphs launches): the seed's address, read by the kernel
    from gactx.kernels._triton import launch
    from gactx.kernels.schemes.uniform.format import allocate
    from gactx.kernels.schemes.uniform.quantize import _quantize_kernel, advance_seed, quantize_launch

    x = _sample(4099, torch.float32, triton_device)
    seed = (1 << 61) + 12345
    expected = triton_quantize(x, 4, 256, True, seed, INTERPRET)
    programs, full, meta = quantize_launch(x.numel(), x.dtype, 4, 256, True, INTERPRET)
    codes, groups = allocate(x, 4, 256)
    stored = torch.tensor(seed, dtype=torch.int64, device=triton_device)
    launch(_quantize_kernel, programs, x, codes, groups, x.numel(), stored, full, **(meta | {"SEED_IN_MEMORY": True}))
    assert_same_bits(codes, expected[0])
    assert_same_bits(groups, expected[1])
    advance_seed(stored)  # the next seed of its sequence, on the device
    after = (seed * 6364136223846793005 + 1442695040888963407) % (1 << 64) & ((1 << 62) - 1)
    assert int(stored) == after
