"""gactx/kernels/variance.py: rounding_variance against the empirical squared error over seeds, and the normal
scheme against the uniform one where each should win."""

import pytest
import torch

from gactx.kernels.schemes.normal import torch_normal_dequantize, torch_normal_quantize
from gactx.kernels.schemes.uniform.reference import torch_dequantize, torch_quantize
from gactx.kernels.variance import rounding_variance


def _empirical(x: torch.Tensor, bits: int, group: int, scheme: str, seeds: int) -> tuple[float, float]:
    """Mean over seeds of the summed squared error, and its standard error."""
    sums = []
    for seed in range(seeds):
        if scheme == "uniform":
            codes, meta = torch_quantize(x, bits, group, True, seed)
            y = torch_dequantize(codes, meta, bits, group, x.numel(), torch.float32)
        else:
            codes, meta = torch_normal_quantize(x, bits, group, True, seed)
            y = torch_normal_dequantize(codes, meta, bits, group, x.numel(), torch.float32)
        fin = torch.isfinite(x)
        sums.append(((y.double() - x.double())[fin] ** 2).sum())
    s = torch.stack(sums)
    return float(s.mean()), float(s.std() / seeds**0.5)


def _data(kind: str, n: int = 2048, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "outlier":  # one 12-sigma value a 256-element group
        x = torch.randn(n, generator=g)
        x[::256] = 12.0
        return x
    if kind == "student_t":  # Student-t, 3 degrees of freedom: normal / sqrt(chi2_3 / 3)
        chi2 = (torch.randn(3, n, generator=g) ** 2).sum(0)
        return torch.randn(n, generator=g) / (chi2 / 3).sqrt()
    return torch.rand(n, generator=g) * 2 - 1


@pytest.mark.parametrize("scheme", ["uniform", "normal"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_matches_the_empirical_squared_error(scheme, bits):
    x = _data("outlier", 1024, seed=1) * 3 + 1
    expected = rounding_variance(x, bits, 256, scheme)
    assert expected.dim() == 0 and expected.dtype == torch.float32 and expected.device == x.device
    mean, se = _empirical(x, bits, 256, scheme, 200)
    assert abs(mean - float(expected)) <= 5 * se + 1e-6 * mean


def test_non_finite_elements_contribute_nothing():
    x = _data("normal", 512, seed=2)
    y = x.clone()
    y[3], y[300] = float("nan"), float("inf")
    for scheme in ("uniform", "normal"):
        v = rounding_variance(y, 4, 256, scheme)
        assert torch.isfinite(v) and v > 0
        mean, se = _empirical(y, 4, 256, scheme, 150)
        assert abs(mean - float(v)) <= 5 * se + 1e-6 * mean


def test_exact_values_and_constant_groups_cost_nothing():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0] * 8)  # on the 2-bit uniform levels, and the normal scheme's ends
    assert float(rounding_variance(torch.full((64,), 3.5), 2, 32, "normal")) == 0.0
    assert float(rounding_variance(torch.full((64,), 3.5), 2, 32, "uniform")) == 0.0
    # The step's margin (2**-20) moves the inner levels off 1 and 2 by about 1e-6: (x - t_j)(t_{j+1} - x) ~ 1e-6 each.
    assert float(rounding_variance(x, 2, 32, "uniform")) < 1e-4


def test_refuses_what_a_scheme_does_not_take():
    with pytest.raises(ValueError, match="scheme"):
        rounding_variance(torch.randn(8), 4, 32, "nf4")
    with pytest.raises(ValueError, match=r"\(2, 4, 8\)"):
        rounding_variance(torch.randn(8), 1, 32, "normal")


# Ratios of normal to uniform rounding variance (2048 elements, groups of 256); the bounds leave room for other
# draws.
@pytest.mark.parametrize(
    ("kind", "bits", "below"),
    [("outlier", 2, 0.4), ("outlier", 4, 0.45), ("student_t", 2, 0.6), ("student_t", 4, 0.6), ("normal", 2, 0.92),
     ("normal", 4, 0.9), ("normal", 8, 0.9)],
)  # fmt: skip
def test_normal_scheme_beats_uniform_on_bell_shaped_groups(kind, bits, below):
    x = _data(kind)
    ratio = rounding_variance(x, bits, 256, "normal") / rounding_variance(x, bits, 256, "uniform")
    assert ratio < below


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_normal_scheme_does_not_win_on_uniform_distributed_groups(bits):
    """The fitted normal reaches past a uniform group's ends: both tails empty, the uniform grid, no gain (and
    its 12 bytes of metadata a group against 8 make it lose per byte)."""
    x = _data("uniform")
    ratio = rounding_variance(x, bits, 256, "normal") / rounding_variance(x, bits, 256, "uniform")
    assert 0.97 < ratio < 1.1


def _inputs():
    g = torch.Generator().manual_seed(3)
    with_specials = torch.randn(700, generator=g)
    with_specials[3], with_specials[400], with_specials[650] = float("nan"), float("inf"), -float("inf")
    wide = torch.randn(600, generator=g)
    wide[::200] = 3e38
    wide[1::200] = -3e38
    yield "outlier", _data("outlier", 1000, seed=4) * 3 + 1
    yield "uniform", _data("uniform", 4096, seed=5)
    yield "specials", with_specials
    yield "past float32", wide
    yield "tiny", torch.randn(512, generator=g) * 1e-40
    yield "constant", torch.full((300,), -2.5)


@pytest.mark.parametrize("kernels", ["cpp", "torch"])
@pytest.mark.parametrize("name, x", list(_inputs()), ids=[n for n, _ in _inputs()])
def test_every_width_at_once_is_the_exact_variance(name, x, kernels, monkeypatch):
    """The collecting step's closed forms (one pass of group statistics, then every width; C++ on a CPU, torch ops
    elsewhere) against the exact levels: the same to float32 rounding."""
    from gactx.kernels import cpu, variance
    from gactx.kernels.variance import normal_variances, uniform_variances

    if kernels == "cpp" and not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    if kernels == "torch":
        monkeypatch.setattr(variance, "_on_cpu_kernels", lambda flat: False)

    for scheme, widths, fast in (("uniform", (1, 2, 4, 8), uniform_variances), ("normal", (2, 4, 8), normal_variances)):
        got = fast(x, widths, 256)
        for bits in widths:
            exact = float(rounding_variance(x, bits, 256, scheme))
            value = float(got[bits])
            assert got[bits].dtype == torch.float32 and got[bits].dim() == 0
            assert value == exact or abs(value - exact) <= 1e-5 * abs(exact), (scheme, bits, value, exact)


def test_a_sample_of_groups_estimates_a_large_tensors_total():
    """group_sample: a small tensor whole; of a large one, evenly spaced groups whose scaled sum is the total to a
    few per cent."""
    from gactx.kernels.variance import SAMPLED_ELEMENTS, group_sample, uniform_variances

    small = torch.randn(SAMPLED_ELEMENTS)
    assert group_sample(small, 256) == (small, 1.0)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1 << 20, generator=g) * torch.linspace(0.5, 2.0, 1 << 20)  # groups of unequal ranges
    sample, scale = group_sample(x, 256)
    assert SAMPLED_ELEMENTS // 2 <= sample.numel() <= SAMPLED_ELEMENTS and scale == x.numel() / sample.numel()
    for bits, value in uniform_variances(sample, (2, 4, 8), 256).items():
        exact = float(rounding_variance(x, bits, 256))
        assert abs(float(value) * scale - exact) <= 0.05 * exact, bits


@pytest.mark.parametrize("numel", [1 << 20, (1 << 20) + 77, 300 * 256])  # whole groups; a tail; a stride of 4
def test_the_meters_estimate_reads_the_sampled_groups_where_they_lie(numel):
    """estimated_variances on a CPU reads group_sample's groups in place (the C++ kernels step over the others): the
    same sums as the sample copied out and measured whole, times its factor (to float32 rounding)."""
    from gactx.kernels import cpu
    from gactx.kernels.variance import estimated_variances, group_sample, normal_variances, uniform_variances

    if not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(numel, generator=g) * torch.linspace(0.5, 2.0, numel)
    sample, scale = group_sample(x, 256)
    assert sample.numel() < x.numel()
    schemes = (("uniform", (1, 2, 4, 8), uniform_variances), ("normal", (2, 4, 8), normal_variances))
    for scheme, widths, whole in schemes:
        got = estimated_variances(x, widths, 256, scheme)
        copied = whole(sample, widths, 256)
        assert got.shape == (len(widths),)
        for i, bits in enumerate(widths):
            expected = (copied[bits].double() * scale).float()  # the sample's float32 sum, scaled
            assert abs(float(got[i]) - float(expected)) <= 1e-6 * float(expected), (scheme, bits)
