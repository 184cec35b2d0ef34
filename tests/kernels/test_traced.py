"""gactx/kernels/traced.py: the noise hash, the run-time counters (seeds, ticks and their listeners) and bool
packing in ops that trace, eagerly and compiled by Inductor."""

import pytest
import torch

from gactx.kernels import traced
from tests.helpers import special_input


def _input(n, dtype, seed, specials=()):
    return special_input(n, dtype, seed, 3.0, specials, every=61)


def test_uniform_bits_are_uniform():
    bits = traced.uniform_bits(torch.arange(1 << 16), 3)
    assert int(bits.min()) >= 0 and int(bits.max()) < 1 << 23
    counts = torch.bincount(bits >> 19, minlength=16).float()  # 16 bins of 4096 expected
    assert ((counts - 4096).abs() < 5 * 4096**0.5).all()


def test_the_hash_has_no_zero_at_the_origin():
    # fmix32(0) is 0: the offset keeps (seed 0, element 0), and the first elements of small seeds, off u = 0.
    index = torch.arange(1 << 12)
    for seed in (0, 1, 2, 1 << 32, (1 << 32) + 1):
        assert int((traced.uniform_bits(index, seed) == 0).sum()) == 0, seed
    assert int(traced.fmix32(torch.tensor(0))) == 0, "the finalizer's fixed point the offset steps around"


def test_tick_tells_its_listener_each_run_of_a_compiled_graph():
    torch._dynamo.reset()
    heard = []

    def listener(token, like, count):
        heard.append((token, tuple(like.shape), int(count)))

    token = traced.new_token(listener)

    def f(x):
        y = x.sin()
        return y, traced.tick(y, token)

    compiled = torch.compile(f, fullgraph=True)
    _, first = compiled(torch.randn(3))
    _, second = compiled(torch.randn(5))
    assert [h[0] for h in heard] == [token, token] and [h[1] for h in heard] == [(3,), (5,)]
    assert int(second) == int(first) + 1 and heard[1][2] == int(second)


def test_a_token_holds_a_bound_method_weakly():
    class Owner:
        def __init__(self):
            self.heard = 0

        def hear(self, token, like, count):
            self.heard += 1

    owner = Owner()
    token = traced.new_token(owner.hear)
    traced.tick(torch.zeros(1), token)
    assert owner.heard == 1
    del owner
    traced.tick(torch.zeros(1), token)  # the owner is gone: nothing happens


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000])
def test_bool_packing_round_trips(n):
    t = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = traced.pack_bool(t)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)
    assert torch.equal(traced.unpack_bool(packed, n), t)
    assert int(packed[0]) == sum(int(v) << i for i, v in enumerate(t[:8].tolist()))


@pytest.mark.parametrize("n", [1, 9, 1000])
def test_bool_kernel_ops_are_the_traced_packing(n):
    t = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = traced.kernel_pack_bool(t, "auto")
    assert torch.equal(packed, traced.pack_bool(t))
    assert torch.equal(traced.kernel_unpack_bool(packed, n, "auto"), t)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def round_trip(x):
        mask = x > 0.5
        return traced.kernel_unpack_bool(traced.kernel_pack_bool(mask, "auto"), n, "auto")

    x = torch.rand(n, generator=torch.Generator().manual_seed(n + 1))
    assert torch.equal(round_trip(x), x > 0.5)
