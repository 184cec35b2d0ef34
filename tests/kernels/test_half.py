"""gactx/kernels/half.py: float32 -> bfloat16, round to nearest even or stochastic (unbiased)."""

import pytest
import torch

from gactx.kernels.half import torch_round_bf16, triton_round_bf16
from tests.conftest import INTERPRET, TRITON_DEVICE
from tests.helpers import assert_same_bits

FLT_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max  # about 3.3895e38: FLT_MAX's exponent, 7 mantissa bits set


def _values(device: str) -> torch.Tensor:
    x = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 10
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), FLT_MAX, -FLT_MAX, 1e-40])
    return x.to(device)


def test_round_to_nearest_even_matches_torch_cast_but_saturates(triton_device):
    """torch's cast, except where it turns a finite value into inf (+-FLT_MAX here): +-BF16_MAX instead."""
    x = _values(triton_device)
    expected = x.to(torch.bfloat16)
    overflow = expected.isinf() & torch.isfinite(x)
    assert overflow.sum() == 2
    expected = torch.where(overflow, BF16_MAX * x.sign(), expected.float()).to(torch.bfloat16)
    assert_same_bits(torch_round_bf16(x, False, 0), expected)
    assert_same_bits(triton_round_bf16(x, False, 0, interpret=triton_device == "cpu"), expected)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_finite_values_beyond_bfloat16_saturate_and_non_finite_stay(triton_device, impl, stochastic):
    """Finite float32 values above BF16_MAX (about 3.3895e38), FLT_MAX and the midpoint to 2**128 included,
    are stored as +-BF16_MAX in both modes; NaN and +-Inf stay what they are."""
    beyond = [FLT_MAX, -FLT_MAX, 3.3961e38, -3.3961e38, 3.39e38, BF16_MAX, -BF16_MAX]
    x = torch.tensor(beyond + [float("inf"), -float("inf"), float("nan")], device=triton_device)
    if impl == "torch":
        y = torch_round_bf16(x, stochastic, 3).float()
    else:
        y = triton_round_bf16(x, stochastic, 3, interpret=triton_device == "cpu").float()
    assert (y[:7] == BF16_MAX * x[:7].sign()).all()
    assert y[7] == float("inf") and y[8] == -float("inf") and y[9].isnan()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_stochastic_rounding_picks_a_neighbour_and_keeps_specials(triton_device, impl):
    x = _values(triton_device)
    if impl == "torch":
        y = torch_round_bf16(x, True, 11).float()
    else:
        y = triton_round_bf16(x, True, 11, interpret=triton_device == "cpu").float()
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncation: magnitude rounded down
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    finite = torch.isfinite(x) & (x.abs() < FLT_MAX)
    assert ((y == down) | (y == up))[finite].all()
    assert torch.isfinite(y[5]) and torch.isfinite(y[6]), "FLT_MAX must not round up to inf"
    assert y[2] == float("inf") and y[3] == -float("inf") and y[4].isnan()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_stochastic_rounding_is_unbiased(impl):
    x = torch.randn(257, generator=torch.Generator().manual_seed(2)) * 5
    x = x.to(TRITON_DEVICE if impl == "triton" else "cpu")
    seeds = 400 if impl == "torch" else 150
    total = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(seeds):
        y = (
            torch_round_bf16(x, True, seed)
            if impl == "torch"
            else triton_round_bf16(x, True, seed, interpret=INTERPRET)
        )
        total += y.double()
    ulp = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32) - (x.view(torch.int32) & ~0xFFFF).view(
        torch.float32
    )
    # Per element the variance is at most ulp^2 / 4: the mean is within 5 standard errors.
    assert ((total / seeds - x.double()).abs() <= 5 * ulp.abs().double() / 2 / seeds**0.5).all()


def test_gpu_launch_configuration_matches_torch_across_programs_and_tail():
    """The GPU's programs (8192 elements, whole ones and then a masked one) under the interpreter, stochastic
    (round to nearest is the hardware conversion when compiled, which the interpreter does not run)."""
    x = (torch.randn(2 * 8192 + 300, generator=torch.Generator().manual_seed(4)) * 3).to(TRITON_DEVICE)
    y = triton_round_bf16(x, True, 9, interpret=False).float()
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    assert ((y == down) | (y == up)).all()
    assert (y == up).float().mean().item() > 0.3, "every element rounded one way: the tail or a program skipped"
