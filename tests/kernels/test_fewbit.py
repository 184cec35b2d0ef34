"""FewBit tables: optimal bins (checked against brute force), points where the op's own derivative equals
the level, errors that fall with the width, and the wider-than-normal inputs the weight is built for."""

import itertools

import numpy as np
import pytest
import torch

from gactx.kernels.fewbit import FUNCTIONS, SAVES_RESULT, _segments, derivative_error, fewbit_table


def _cost(d, w, cuts):
    bounds = [0, *cuts, d.size]
    total = 0.0
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        level = np.sum(w[a:b] * d[a:b]) / np.sum(w[a:b])
        total += np.sum(w[a:b] * (d[a:b] - level) ** 2)
    return total


def test_dynamic_programme_finds_the_best_cuts():
    """On a grid small enough to try every cut, the programme's cuts cost no more than the best."""
    import gactx.kernels.fewbit as fb

    rng = np.random.default_rng(0)
    d, w = np.cumsum(rng.normal(size=40)), rng.uniform(0.1, 1.0, 40)
    old = fb.DP_POINTS
    fb.DP_POINTS = 41  # every grid point is a candidate cut
    try:
        cuts = _segments(d, w, 4)
    finally:
        fb.DP_POINTS = old
    best = min(_cost(d, w, list(c)) for c in itertools.combinations(range(1, 40), 3))
    assert _cost(d, w, cuts) <= best * (1 + 1e-9)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_each_point_has_its_level_as_derivative(name, bits):
    table = fewbit_table(name, (), bits)
    assert len(table.points) == 1 << bits and len(table.edges) == (1 << bits) - 1
    assert list(table.edges) == sorted(table.edges)
    x = torch.tensor(table.points, dtype=torch.float64)
    if name in SAVES_RESULT:  # points are results: go back to inputs
        x = torch.logit(x) if name == "sigmoid" else torch.atanh(x)
    x.requires_grad_()
    FUNCTIONS[name](x).sum().backward()
    assert np.allclose(x.grad.numpy(), table.levels, atol=2e-3)


@pytest.mark.parametrize("name", ["gelu", "silu", "tanh", "sigmoid", "elu", "softplus", "mish", "hardswish"])
def test_errors_fall_with_the_width_for_inputs_of_several_scales(name):
    for sigma in (0.5, 1.0, 3.0):
        errors = [derivative_error(name, (), b, sigma) for b in (1, 2, 4, 8)]
        assert errors == sorted(errors, reverse=True), (sigma, errors)
        assert errors[2] < 0.13 and errors[3] < 0.05, (sigma, errors)


def test_parameters_change_the_table():
    a = fewbit_table("softplus", (("beta", 1.0), ("threshold", 20.0)), 2)
    b = fewbit_table("softplus", (("beta", 4.0), ("threshold", 20.0)), 2)
    assert a.levels != b.levels
    with pytest.raises(ValueError, match="no FewBit table"):
        fewbit_table("relu", (), 2)
    with pytest.raises(ValueError, match="bits=9"):
        fewbit_table("gelu", (), 9)
