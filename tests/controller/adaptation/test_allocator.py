"""gactx/controller/adaptation/allocator.py: optimal against brute force, always within budget."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gactx.controller.adaptation.allocator import Item, allocate, variance_factor, widths_for
from gactx.kernels.format import expected_nbytes

DTYPES = [torch.float32, torch.bfloat16]


def _brute_force(items, budget, group_size=256):
    best = None
    for widths in itertools.product(*[widths_for(it.dtype) for it in items]):
        nbytes = sum(expected_nbytes(it.numel, it.dtype, b, group_size) for it, b in zip(items, widths, strict=True))
        if nbytes <= budget:
            var = sum(it.sensitivity * variance_factor(b, it.dtype) for it, b in zip(items, widths, strict=True))
            best = var if best is None else min(best, var)
    return best


items_strategy = st.lists(
    st.builds(
        lambda i, n, d, c: Item(i, n, d, c),
        st.integers(0, 10**6),
        st.integers(1, 50_000),
        st.sampled_from(DTYPES),
        st.floats(0, 1e4, allow_nan=False),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda it: it.key,
)


@settings(max_examples=150, deadline=None)
@given(items=items_strategy, fraction=st.floats(0.0, 1.2))
def test_optimal_against_brute_force_and_within_budget(items, fraction):
    lo = sum(min(expected_nbytes(it.numel, it.dtype, b) for b in widths_for(it.dtype)) for it in items)
    hi = sum(max(expected_nbytes(it.numel, it.dtype, b) for b in widths_for(it.dtype)) for it in items)
    budget = int(lo + fraction * (hi - lo))
    result = allocate(items, budget)
    spent = sum(expected_nbytes(it.numel, it.dtype, result.bits[it.key]) for it in items)
    assert spent == result.nbytes
    if budget >= lo:
        assert result.feasible and spent <= budget
        assert result.variance == pytest.approx(_brute_force(items, budget), rel=1e-9, abs=1e-12)
    else:
        assert not result.feasible


def test_tiny_variances_keep_the_optimum_against_the_bounds_rounding():
    """Variances of 1e-27 beside a bound whose ``lam * bytes`` terms are 1e-19: the bound's rounding is far above the
    variances, and pruned every point of the frontier before its slack was set by those terms."""
    items = [Item(0, 1, torch.float32, 0.0), Item(1, 1, torch.float32, 1.4700691996843588e-27)]
    budget = sum(min(expected_nbytes(it.numel, it.dtype, b) for b in widths_for(it.dtype)) for it in items)
    result = allocate(items, budget)
    assert result.feasible and result.nbytes <= budget
    assert result.variance == pytest.approx(_brute_force(items, budget), rel=1e-9, abs=1e-40)


def test_infeasible_budget_gives_the_narrowest_widths():
    items = [Item("a", 10_000, torch.float32, 1.0), Item("b", 10_000, torch.bfloat16, 5.0)]
    result = allocate(items, budget=100)
    assert not result.feasible and result.bits == {"a": 1, "b": 1}


def test_more_sensitive_tensors_get_more_bits():
    items = [Item(i, 100_000, torch.float32, 10.0**i) for i in range(4)]
    budget = sum(expected_nbytes(100_000, torch.float32, 4) for _ in items)
    bits = allocate(items, budget).bits
    assert [bits[i] for i in range(4)] == sorted(bits[i] for i in range(4))
    assert bits[3] > bits[0]


def test_a_curved_tensor_is_priced_by_its_curve():
    """A normalisation's input: variance ``C (a S + q S**2)``. Of two tensors alike at the probe width, the one
    whose variance grows with the square of the error is kept wider, and the narrow widths cost it more."""
    flat = Item("flat", 100_000, torch.float32, 1.0)
    bent = Item("bent", 100_000, torch.float32, 1.0, response=(0.1, 8.1))  # a + q S(2) = 1: equal at 2 bits
    budget = expected_nbytes(100_000, torch.float32, 1) + expected_nbytes(100_000, torch.float32, 2)
    assert allocate([flat, bent], budget).bits == {"flat": 1, "bent": 2}  # 1-bit bent: 8.2 against flat's 1
    x = variance_factor(1)
    assert allocate([bent], expected_nbytes(100_000, torch.float32, 1)).variance == pytest.approx(0.1 * x + 8.1 * x * x)


def test_many_tensors_stay_fast_and_within_budget():
    import random
    import time

    rng = random.Random(0)
    items = [Item(i, rng.randint(1000, 10**6), torch.float32, 10 ** rng.uniform(-3, 3)) for i in range(300)]
    budget = sum(expected_nbytes(it.numel, it.dtype, 3) for it in items)
    start = time.perf_counter()
    result = allocate(items, budget)
    assert time.perf_counter() - start < 30
    assert result.feasible and result.nbytes <= budget


def test_variance_model():
    assert variance_factor(2) == 1 / 9 and variance_factor(8) == 1 / 255**2
    assert variance_factor(16) == variance_factor(8) / 16 and variance_factor(32) == 0
    assert variance_factor(16, torch.bfloat16) == 0  # stored as is


def test_class_widths_and_coded_bytes_are_respected():
    """An attention tensor never goes below its class's narrowest width; a FewBit-coded tensor's bytes are
    its codes and table (no per-group metadata), so at equal bits it is cheaper than a quantized one."""
    from gactx.kernels.codes import coded_nbytes

    attention = Item("att", 1 << 16, torch.float32, 1e-9, widths=(4, 8, 16, 32))
    smooth = Item("act", 1 << 16, torch.float32, 1.0, coded=True)
    budget = expected_nbytes(1 << 16, torch.float32, 4) + coded_nbytes(1 << 16, 2, torch.float32)
    result = allocate([attention, smooth], budget)
    assert result.bits["att"] == 4, "below 4 bits is not an attention width, however insensitive"
    assert result.bits["act"] == 2
    assert result.nbytes == budget
    assert coded_nbytes(1 << 16, 2, torch.float32) < expected_nbytes(1 << 16, torch.float32, 2)
