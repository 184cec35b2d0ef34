"""gactx/kernels/schemes/samples.py: per-sample widths, unbiased, within their bytes, without a host read."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gactx.kernels.schemes.samples import (
    sample_ranges,
    sample_variances,
    split_count,
    split_nbytes,
    split_samples,
)


def _batch(shape=(8, 4, 8, 8), seed=0) -> torch.Tensor:
    """Samples whose ranges span three orders of magnitude, out of order."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 1, shape[0])[torch.randperm(shape[0], generator=g)]
    return torch.randn(shape, generator=g) * scales.view(-1, *[1] * (len(shape) - 1))


def test_the_widest_samples_get_the_wider_width():
    x = _batch()
    s = split_samples(x, 2, 4, 0.25, seed=0, backend="torch")
    widest = set(torch.topk(sample_ranges(x), 2).indices.tolist())
    assert set(s.order[:2].tolist()) == widest and sorted(s.order.tolist()) == list(range(8))
    assert s.high.bits == 4 and s.low.bits == 2 and s.high.shape[0] == 2 and s.low.shape[0] == 6
    assert s.nbytes == split_nbytes(tuple(x.shape), x.dtype, 2, 4, 0.25, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unbiased_and_each_sample_errs_as_predicted(dtype):
    x = _batch().to(dtype)
    draws = 300
    total, squared = torch.zeros(x.shape), torch.zeros(x.shape[0])
    for seed in range(draws):
        d = split_samples(x, 2, 4, 0.5, seed=seed, backend="torch").decode().float()
        total += d
        squared += (d - x.float()).square().sum((1, 2, 3))
    predicted = torch.empty(x.shape[0])
    order = split_samples(x, 2, 4, 0.5, seed=0, backend="torch").order.long()
    predicted[order[:4]] = sample_variances(x, 4, 256)[order[:4]]
    predicted[order[4:]] = sample_variances(x, 2, 256)[order[4:]]
    if dtype == torch.float32:  # bf16 decodes round to the dtype: the prediction is of the codes alone
        torch.testing.assert_close(squared / draws, predicted, rtol=0.15, atol=0)
    # The mean of the draws: within 5 standard errors of each element's value.
    error = (total / draws - x.float()).abs()
    bound = 5 * (predicted.max() / x[0].numel() / draws).sqrt() + 1e-2 * x.float().abs()
    assert (error <= bound).all()


def test_shapes_dtypes_and_strides_come_back():
    x = _batch((6, 3, 16, 16)).to(memory_format=torch.channels_last)
    d = split_samples(x, 1, 2, 0.5, seed=1).decode()
    assert d.shape == x.shape and d.dtype == x.dtype and d.stride() == x.stride()
    y = _batch((5, 300)).t()  # not dense in any sample order: decoded contiguous
    d = split_samples(y, 4, 8, 0.25, seed=1).decode()
    assert d.shape == y.shape and d.is_contiguous()
    assert (d - y).abs().max() <= (y.amax() - y.amin()) / 15 * 1.01


def test_non_finite_values_come_back_at_their_places():
    x = _batch()
    x[3, 0, 0, 0], x[5, 1, 2, 3] = float("nan"), float("inf")
    d = split_samples(x, 2, 4, 0.25, seed=0).decode()
    assert d[3, 0, 0, 0].isnan() and d[5, 1, 2, 3] == float("inf")
    assert torch.isfinite(d).sum() == x.numel() - 2


def test_no_host_read():
    class NoHostRead(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                raise AssertionError("a host read")
            return func(*args, **(kwargs or {}))

    x = _batch()
    with NoHostRead():
        s = split_samples(x, 2, 4, 0.25, seed=0, backend="torch")
        s.decode()
        sample_variances(x, 2, 256)


def test_bad_arguments_raise_naming_them():
    x = _batch()
    with pytest.raises(ValueError, match="batch of at least 2"):
        split_samples(x[:1], 2, 4, 0.5)
    with pytest.raises(ValueError, match="batch of at least 2"):
        split_samples(torch.randn(100), 2, 4, 0.5)
    with pytest.raises(ValueError, match="fraction"):
        split_samples(x, 2, 4, 1.0)
    with pytest.raises(ValueError, match="high"):
        split_samples(x, 4, 2, 0.5)


def test_counts_and_unaligned_samples():
    assert [split_count(8, f) for f in (0.01, 0.25, 0.5, 0.99)] == [1, 2, 4, 8]
    assert sample_variances(torch.randn(4, 100), 2, 256) is None  # a sample is not whole groups
    assert sample_variances(torch.randn(4, 512), 2, 256).shape == (4,)
