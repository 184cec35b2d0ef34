"""gactx/kernels/free.py: the free estimator's reductions, the C++ kernels and the torch forms, against sums written
out element by element."""

import math

import pytest
import torch
from torch import nn

from gactx.kernels import cpu
from gactx.kernels.free import add_weighted_norms, mean_inverse_variance, row_variances


def _rows_by_loop(x: torch.Tensor, group: int, rows: int) -> list[float]:
    """Each row's sum of its elements' group terms (hi - lo)^2 / 6, element by element in float64."""
    flat = x.double().reshape(-1)
    terms = []
    for start in range(0, flat.numel(), group):
        g = flat[start : start + group]
        terms += [float((g.max() - g.min()) ** 2 / 6)] * g.numel()
    row = flat.numel() // rows
    return [sum(terms[r * row : (r + 1) * row]) for r in range(rows)]


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
@pytest.mark.parametrize(
    "numel, rows",
    [(8192, 32), (8192, 1), (1000, 10), (1000, 1), (768, 3), (512, 512), (300, 100), (257, 1), (0, 1), (0, 4)],
    ids=["rows of whole groups", "one row", "a tail", "a tail, one row", "groups of rows", "rows of 1",
         "neither", "a 1-element tail", "empty", "empty, 4 rows"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_variances_are_each_rows_share_of_its_groups_ranges(numel, rows, dtype, kernels, monkeypatch):
    """The free estimator's term (one C++ call on a CPU, torch ops elsewhere): every element takes its group's
    ``R**2 / 6``, the last group's range its own, summed per row; float32 of ``rows``."""

    if kernels == "cpp" and not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    if kernels == "torch":
        monkeypatch.setattr(cpu, "takes", lambda t: False)
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel + rows)) * 3).to(dtype)
    got = row_variances(x, 256, rows)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    expected = torch.tensor(_rows_by_loop(x, 256, rows), dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, rtol=2e-6, atol=0)


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
def test_row_variances_of_a_group_holding_nan_or_inf(kernels, monkeypatch):

    if kernels == "cpp" and not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    if kernels == "torch":
        monkeypatch.setattr(cpu, "takes", lambda t: False)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(1))
    x[5], x[600] = float("nan"), float("inf")
    got = row_variances(x, 256, 4)
    assert got[0].isnan() and got[2].isinf() and got[1].isfinite() and got[3].isfinite()
    with pytest.raises(ValueError, match="rows=3"):
        row_variances(x, 256, 3)


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
@pytest.mark.parametrize("rows", [1, 4, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_weighted_norms_adds_each_rows_squared_norm_times_its_weight(rows, dtype, kernels, monkeypatch):

    if kernels == "cpp" and not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    if kernels == "torch":
        monkeypatch.setattr(cpu, "takes", lambda t: False)
    gen = torch.Generator().manual_seed(rows)
    g, weights = torch.randn(4096, generator=gen).to(dtype), torch.rand(rows, generator=gen)
    total = torch.full((1,), 2.5)
    add_weighted_norms(total, g, weights)
    add_weighted_norms(total, g, weights)  # it accumulates
    g64 = g.double().reshape(rows, -1)
    expected = 2.5 + 2 * float((g64.square().sum(1) * weights.double()).sum())
    assert total.dtype == torch.float32 and total.shape == (1,)
    assert float(total) == pytest.approx(expected, rel=1e-6)


def _inverse_by_loop(x: torch.Tensor, dims: tuple[int, ...], eps: float) -> float:
    """The mean over slices of 1 / (var + eps), each slice's variance over ``dims`` in float64."""
    x = x.double()
    var = x.var(dims, unbiased=False)
    return float((1 / (var + eps)).mean())


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
@pytest.mark.parametrize(
    "shape, dims",
    [((8, 16, 5, 5), (0, 2, 3)), ((4, 3, 7), (0, 2)), ((6, 10), (0,)), ((2, 5, 64), (2,)), ((2, 5, 8, 8), (2, 3)),
     ((3, 4, 5), (0, 1)), ((1, 9), (1,))],
    ids=["BatchNorm2d", "BatchNorm1d on a sequence", "BatchNorm1d", "LayerNorm", "LayerNorm of two dimensions",
         "two leading dimensions (torch form)", "one row"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_inverse_variance_is_each_slices_inverse_variance_averaged(shape, dims, dtype, kernels, monkeypatch):
    if kernels == "cpp" and not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    if kernels == "torch":
        monkeypatch.setattr(cpu, "takes", lambda t: False)
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 4 + 3).to(dtype)
    got = mean_inverse_variance(x, dims, 1e-5)
    assert got.dtype == torch.float32 and got.shape == (1,)
    assert float(got) == pytest.approx(_inverse_by_loop(x, dims, 1e-5), rel=1e-5)


def test_mean_inverse_variance_of_a_strided_input_reads_its_values():
    x = torch.randn(4, 6, 5, 5, generator=torch.Generator().manual_seed(2)).to(memory_format=torch.channels_last)
    assert float(mean_inverse_variance(x, (0, 2, 3), 1e-5)) == pytest.approx(_inverse_by_loop(x, (0, 2, 3), 1e-5))


@pytest.mark.parametrize("kind", ["BatchNorm1d", "LayerNorm"])
def test_what_a_normalisation_divides_by_is_its_own_variance(kind):
    """Against the module itself: with weight 1 and bias 0 its output over the centred input is ``1 / sqrt(var +
    eps)`` of each slice at every element, and every slice has as many elements."""
    x = torch.randn(4, 6, 25, generator=torch.Generator().manual_seed(3)) * 2 + 1
    norm, dims = (nn.BatchNorm1d(6), (0, 2)) if kind == "BatchNorm1d" else (nn.LayerNorm(25), (2,))
    with torch.no_grad():
        slope = norm.train()(x).double() / (x - x.mean(dims, keepdim=True)).double()
    expected = float(slope.square().mean())
    assert math.isfinite(expected)
    assert float(mean_inverse_variance(x, dims, norm.eps)) == pytest.approx(expected, rel=1e-3)
