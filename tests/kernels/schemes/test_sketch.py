"""Row sketches: unbiased over seeds, the sampling variance as derived, layouts and bytes back, composed with
quantization, reproducible from the seed, no host read; a linear layer's gradients through a sketched input."""

import itertools
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gactx.kernels.format import QuantizedTensor
from gactx.kernels.schemes.sketch import (
    SketchedTensor,
    kept_rows,
    row_length,
    sketch_nbytes,
    sketch_rows,
    sketch_variance,
)

SEEDS = 2000
Z = 6.0  # seeds are fixed, so a test's outcome is too; 6 standard errors leave room for a few thousand elements


def _rows_of(n: int, d: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """``n`` rows of ``d`` elements whose norms span two orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, n)[torch.randperm(n, generator=g)]
    return (torch.randn(n, d, generator=g) * scale[:, None]).to(dtype)


def _draws(x: torch.Tensor, fraction, bits: int, seeds: int = SEEDS) -> torch.Tensor:
    return torch.stack([sketch_rows(x, fraction, bits, seed).decode().double() for seed in range(seeds)])


def _assert_mean_is(draws: torch.Tensor, expected: torch.Tensor, se: torch.Tensor) -> None:
    """Every element's mean over the draws within ``Z`` standard errors ``se`` of ``expected``."""
    z = (draws.mean(0) - expected.double()).abs() / se.clamp_min(1e-30)
    assert z.max() < Z, f"largest deviation {z.max():.2f} standard errors"


@pytest.mark.parametrize("fraction", [1 / 2, 1 / 4, 1 / 8, 0.3])
@pytest.mark.parametrize("n", [1, 3, 257])
def test_decode_is_unbiased_over_seeds(fraction, n):
    x = _rows_of(n, 6)
    k = math.ceil(fraction * n)
    draws = _draws(x, fraction, 32)
    # Each element decodes to N/k x or 0: variance x^2 (N/k - 1) a draw.
    se = x.double().abs() * math.sqrt((n / k - 1) / SEEDS)
    if k == n:
        assert torch.equal(draws[0], x.double()) and bool((draws == draws[0]).all())
    else:
        _assert_mean_is(draws, x, se)


@pytest.mark.parametrize("n, fraction", [(257, 1 / 4), (40, 1 / 8), (9, 1 / 2)])
def test_every_row_is_kept_k_times_in_n(n, fraction):
    k = math.ceil(fraction * n)
    counts = torch.zeros(n)
    for seed in range(SEEDS):
        rows = kept_rows(n, k, seed, "cpu")
        assert rows.dtype == torch.int64 and rows.numel() == k
        assert bool((rows[1:] > rows[:-1]).all()), "distinct, in increasing order"
        counts[rows] += 1
    p = k / n
    z = (counts - SEEDS * p).abs() / math.sqrt(SEEDS * p * (1 - p))
    assert z.max() < Z


@pytest.mark.parametrize("complement", [False, True])
def test_the_cpu_kernels_rows_are_the_torch_forms(complement, monkeypatch):
    """kept_rows on a CPU is one C++ call; the torch form (every other device) is its oracle: the same rows."""
    from gactx.kernels import cpu
    from gactx.kernels.schemes import sketch

    if not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    cases = [(n, k, seed) for n in (1, 2, 7, 64, 513, 4096) for k in {0, 1, n // 3, n - 1, n} if 0 <= k <= n
             for seed in (0, 1, 2**31 + 5, 2**62 - 1)]  # fmt: skip
    fast = [kept_rows(n, k, seed, "cpu", complement) for n, k, seed in cases]
    monkeypatch.setattr(sketch, "_on_cpu", lambda device: False)
    for (n, k, seed), rows in zip(cases, fast, strict=True):
        assert torch.equal(rows, kept_rows(n, k, seed, torch.device("cpu"), complement)), (n, k, seed)


def test_row_zero_is_not_always_kept_under_seed_zero():
    # Without the hash's offset, row 0's key under seed 0 had 32 zero high bits: the smallest of any row, always kept.
    assert [int(kept_rows(1 << 12, 1, seed, "cpu")) for seed in range(4)].count(0) == 0


def test_the_sampling_variance_is_the_mean_over_all_choices():
    """The formula against its definition: every k-subset of N rows, equally likely."""
    x = _rows_of(5, 3, seed=1)
    for k in range(1, 6):
        errors = []
        for subset in itertools.combinations(range(5), k):
            x_hat = torch.zeros_like(x, dtype=torch.float64)
            x_hat[list(subset)] = x[list(subset)].double() * 5 / k
            errors.append((x_hat - x.double()).square().sum())
        exact = torch.stack(errors).mean()
        got = sketch_variance(x, k / 5)
        assert got.dtype == torch.float32 and got.dim() == 0
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=0)


@pytest.mark.parametrize("fraction", [1 / 2, 1 / 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampling_variance_matches_the_empirical_mean(fraction, dtype):
    # 256 rows: N / k is 2 or 8, exact in bfloat16 (at other scales its decode rounds c x to bfloat16, which
    # moves the mean squared error by about 2**-9 of it: 0.35% at 257 rows, more than 4000 draws resolve)
    n = 257 if dtype == torch.float32 else 256
    x = _rows_of(n, 8, seed=2, dtype=dtype)
    errors = torch.stack(
        [(sketch_rows(x, fraction, 32, s).decode().double() - x.double()).square().sum() for s in range(4000)]
    )
    predicted = sketch_variance(x, fraction).double()
    # the mean of 4000 draws, within 6 of its standard errors (estimated from the draws; at 1/2 of an even count
    # every draw errs by ||x||^2 exactly, dropped rows once and kept rows once, so float32 sums set the floor)
    se = errors.std() / math.sqrt(errors.numel())
    assert (errors.mean() - predicted).abs() < max(Z * se, 1e-6 * predicted)
    assert (errors.mean() - predicted).abs() < 0.1 * predicted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(257, 7),
        lambda: torch.randn(3, 5, 7),
        lambda: torch.randn(1, 9),
        lambda: torch.randn(11),
        lambda: torch.randn(()),
        lambda: torch.randn(7, 257).t(),
        lambda: torch.randn(2, 3, 5, 4).contiguous(memory_format=torch.channels_last),
        lambda: torch.randn(6, 10)[:, ::2],  # gapped: decoded contiguous, as quantize does
        lambda: torch.randn(0, 5),
    ],
    ids=["257x7", "3x5x7", "1x9", "11", "0-d", "transposed", "channels_last", "gapped", "empty"],
)
def test_layout_dtype_and_kept_rows_come_back(make, dtype):
    x = make().to(dtype)
    s = sketch_rows(x, 1 / 4, 32, seed=7)
    out = s.decode()
    assert isinstance(s, SketchedTensor)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    dense = x.is_contiguous() or x.permute(sorted(range(x.dim()), key=lambda d: -x.stride(d))).is_contiguous()
    assert out.stride() == (x.stride() if dense else x.contiguous().stride()) == s.stride()
    # in memory order: the kept rows, scaled by N / k, and zeros
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d)) if dense else list(range(x.dim()))
    xr, outr = x.permute(order).reshape(-1, row_length(x)), out.permute(order).reshape(-1, row_length(x))
    assert s.n_rows == xr.shape[0] and s.row_len == xr.shape[1]
    keep = torch.zeros(s.n_rows, dtype=torch.bool)
    keep[s.rows()] = True
    assert int(keep.sum()) == math.ceil(s.n_rows / 4)
    scale = s.n_rows / s.n_kept if s.n_kept else 1.0
    assert torch.equal(outr[keep], torch.mul(xr[keep], scale).to(dtype))
    assert not outr[~keep].any()


@pytest.mark.parametrize(
    "fraction, n, k", [(0.1, 10, 1), (0.7, 10, 7), (1 / 3, 3, 1), (0.5, 257, 129), (1 / 8, 3, 1), (1, 5, 5)]
)
def test_fractions_keep_the_ceiling_of_their_share(fraction, n, k):
    x = torch.randn(n, 4)
    s = sketch_rows(x, fraction, 32, seed=3)
    assert s.n_kept == k and s.kept.shape == (k, 4)
    if k == n:
        assert torch.equal(s.decode(), x)


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5, math.nan, math.inf, True, "1/2", None])
def test_bad_fractions_are_refused(fraction):
    with pytest.raises(ValueError, match="fraction="):
        sketch_rows(torch.randn(4, 4), fraction, 32, seed=0)
    with pytest.raises(ValueError, match="fraction="):
        sketch_variance(torch.randn(4, 4), fraction)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="bits=3"):
        sketch_rows(torch.randn(4, 4), 0.5, 3, seed=0)
    with pytest.raises(ValueError, match="seed="):
        sketch_rows(torch.randn(4, 4), 0.5, 8, seed=-1)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        sketch_rows(torch.ones(4, 4, dtype=torch.bool), 0.5, 8, seed=0)


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
def test_composed_with_quantization_is_unbiased(bits):
    x = _rows_of(33, 16, seed=4)
    draws = _draws(x, 1 / 4, bits, seeds=1500)
    s = sketch_rows(x, 1 / 4, bits, seed=0)
    assert isinstance(s.kept, QuantizedTensor if bits < 32 else torch.Tensor)
    _assert_mean_is(draws, x, draws.std(0) / math.sqrt(draws.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("shape, fraction", [((257, 24), 1 / 8), ((3, 5, 300), 1 / 2), ((1, 7), 0.3), ((5,), 1)])
def test_bytes_are_what_sketch_nbytes_says(shape, fraction, bits, dtype):
    x = torch.randn(shape).to(dtype)
    s = sketch_rows(x, fraction, bits, seed=11, group_size=64)
    assert s.nbytes == sketch_nbytes(x.numel(), row_length(x), dtype, fraction, bits, 64)


def test_bytes_at_a_fraction_are_a_fraction():
    # 4096 rows of 1024 bf16 values, 1/8 of them at 2 bits: 512 rows, 0.25 bit an element plus metadata
    n, d = 4096, 1024
    assert sketch_nbytes(n * d, d, torch.bfloat16, 1 / 8, 2) == 512 * d * 2 // 8 + 8 * (512 * d // 256)
    assert sketch_nbytes(n * d, d, torch.bfloat16, 1 / 8, 32) == 512 * d * 2
    assert sketch_nbytes(n * d, d, torch.float32, 1 / 2, 16) == 2048 * d * 2


def test_reproducible_from_the_seed(device):
    x = torch.randn(300, 40, device=device)
    a, b = sketch_rows(x, 1 / 4, 2, seed=5), sketch_rows(x, 1 / 4, 2, seed=5)
    assert torch.equal(a.rows(), b.rows())
    assert torch.equal(a.kept.data, b.kept.data) and torch.equal(a.kept.meta, b.kept.meta)
    assert torch.equal(a.decode(), b.decode())
    assert not torch.equal(a.rows(), sketch_rows(x, 1 / 4, 2, seed=6).rows())
    # the choice is a function of the seed alone: the same rows on any device
    assert torch.equal(a.rows().cpu(), kept_rows(300, 75, 5, "cpu"))


class _NoHostRead(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a tensor value was read on the host")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bits", [2, 16, 32])
def test_no_host_read(bits):
    x = torch.randn(257, 33, dtype=torch.bfloat16)
    with _NoHostRead():
        with pytest.raises(AssertionError, match="host"):
            torch.ones(1).item()  # the mode does catch a read
        s = sketch_rows(x, 1 / 8, bits, seed=1)
        s.decode()
        sketch_variance(x, 1 / 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_gpu_synchronization_on_cuda():
    x = torch.randn(4097, 64, device="cuda")
    sketch_rows(x, 1 / 4, 4, seed=0).decode()  # warm-up: kernels compiled, the allocator filled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = sketch_rows(x, 1 / 4, 4, seed=1)
        s.decode()
        sketch_variance(x, 1 / 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _sketched_grads(layer: nn.Linear, x: torch.Tensor, fraction, bits: int, seed: int):
    """Gradients of ``layer(x)`` against a fixed ``g``, with every saved activation sketched (the layer's parameters,
    saved as themselves or views, are kept); ``fraction=None``: plain autograd."""

    def pack(t):
        base = t if t._base is None else t._base
        return t if isinstance(base, nn.Parameter) else sketch_rows(t, fraction, bits, seed)

    def unpack(s):
        return s.decode() if isinstance(s, SketchedTensor) else s

    x = x.detach().requires_grad_()
    if fraction is None:
        y = layer(x)
    else:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = layer(x)
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(y, [x, *params], g)
    return grads[0], grads[1], grads[2:]


@pytest.mark.parametrize("shape", [(96, 12), (4, 24, 12)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bits", [32, 4])
def test_linear_weight_gradient_unbiased_and_input_gradient_exact(shape, bias, bits):
    torch.manual_seed(0)
    layer = nn.Linear(12, 5, bias=bias)
    x = torch.randn(shape) * torch.logspace(-1, 1, shape[-2]).view(-1, 1)
    exact_x, exact_w, exact_b = _sketched_grads(layer, x, None, 32, 0)
    grad_ws = []
    for seed in range(500):
        gx, gw, gb = _sketched_grads(layer, x, 1 / 4, bits, seed)
        assert torch.equal(gx, exact_x), "grad_x = g W never reads x"
        for got, want in zip(gb, exact_b, strict=True):
            assert torch.equal(got, want)
        grad_ws.append(gw.double())
    draws = torch.stack(grad_ws)
    assert (draws[0] - exact_w).abs().max() > 1e-3, "a single draw is not exact"
    _assert_mean_is(draws, exact_w, draws.std(0) / math.sqrt(draws.shape[0]))


def _error(x: torch.Tensor, fraction, bits: int) -> float:
    """Relative expected squared error: sampling plus the kept rows' rounding (rows that are whole groups)."""
    from gactx.kernels.variance import rounding_variance

    rounding = rounding_variance(x, bits, 256) if bits <= 8 else torch.zeros(())
    return float((sketch_variance(x, fraction) + rounding / fraction) / x.square().sum())


def test_per_byte_a_sketch_wins_near_one_bit_and_loses_at_four():
    """Where a sketch wins per byte and where it loses (the reason it is one of the allocator's choices,
    docs/adaptive.md#storage-choices), on Gaussian rows and on rows with outlier channels."""
    from gactx.kernels.variance import rounding_variance

    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(512, 256, generator=g)
    outliers = gaussian.clone()
    outliers[:, :4] *= 50
    for x in (gaussian, outliers):
        quantized = {b: float(rounding_variance(x, b, 256) / x.square().sum()) for b in (1, 2, 4)}
        n = x.numel()
        # 1/2 of the rows at 2 bits holds fewer bytes than 1 bit and errs less
        assert sketch_nbytes(n, 256, x.dtype, 1 / 2, 2) < sketch_nbytes(n, 256, x.dtype, 1, 1)
        assert _error(x, 1 / 2, 2) < quantized[1] / 2
        assert _error(x, 1 / 2, 4) > 5 * quantized[4]  # at 4 bits quantization wins
    # at 2 bits: quantization on Gaussian rows, the sketch with outlier channels
    assert _error(gaussian, 1 / 2, 4) > float(rounding_variance(gaussian, 2, 256) / gaussian.square().sum())
    assert _error(outliers, 1 / 2, 4) < float(rounding_variance(outliers, 2, 256) / outliers.square().sum()) / 2


@pytest.mark.parametrize("n_rows", [1, 2, 7, 257])
def test_a_sketch_and_its_complement_split_the_rows_and_average_to_the_tensor(n_rows):
    x = torch.randn(n_rows, 5, generator=torch.Generator().manual_seed(n_rows))
    a = sketch_rows(x, 0.5, 32, 11)
    b = sketch_rows(x, 0.5, 32, 11, complement=True)
    if n_rows == 1:  # the sketch keeps the only row; so does its complement
        assert torch.equal(a.decode(), x) and torch.equal(b.decode(), x)
        return
    assert sorted(a.rows().tolist() + b.rows().tolist()) == list(range(n_rows))
    assert a.n_kept + b.n_kept == n_rows and b.nbytes == b.n_kept * 5 * 4
    mixed = (a.decode() * a.n_kept + b.decode() * b.n_kept) / n_rows
    torch.testing.assert_close(mixed, x)
