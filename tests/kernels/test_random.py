"""gactx/kernels/random.py: Philox4x32 from widening multiplies gives exactly the numbers of ``tl.philox``."""

import pytest
import torch

from gactx.kernels._triton import jit, tl
from gactx.kernels.random import ROUNDS, philox

N = 512


# A seed of 1 would be specialized to a constant, as gactx's kernels never let it be (do_not_specialize).
@jit(do_not_specialize=["seed"])
def _compare_kernel(out_ptr, seed, N_ROUNDS: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N).to(tl.uint32)
    c0, c1, c2, c3 = i * 2654435761, i ^ 0x5BD1E995, (i >> 3) + 7, i * 0 + 0xFFFFFFFF
    ours = philox(seed, c0, c1, c2, c3, N_ROUNDS)
    theirs = tl.philox(seed, c0, c1, c2, c3, N_ROUNDS)
    for j in tl.static_range(4):
        tl.store(out_ptr + j * N + tl.arange(0, N), ours[j].to(tl.int64) - theirs[j].to(tl.int64))
    tl.store(out_ptr + 4 * N + tl.arange(0, N), ours[0].to(tl.int64))


@pytest.mark.parametrize("rounds", [ROUNDS, 10])
@pytest.mark.parametrize("seed", [0, 1, 0x9E3779B97F4A7C15 >> 2, (1 << 62) - 1])
def test_philox_equals_triton_philox(triton_device, rounds, seed):
    out = torch.empty(5 * N, dtype=torch.int64, device=triton_device)
    _compare_kernel[(1,)](out, seed, N_ROUNDS=rounds, N=N)
    assert (out[: 4 * N] == 0).all(), "an output differs from tl.philox"
    first = out[4 * N :]
    assert first.unique().numel() > N - 2, "outputs should look random, not repeat"
