"""gactx/kernels/schemes/uniform/traced.py: the uniform scheme in ops that trace gives the twin's bytes (deterministic),
the C++ kernels' bytes (stochastic, same seed), eagerly and compiled by Inductor; its kernels as custom ops."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gactx.kernels import cpu, traced
from gactx.kernels.schemes.uniform import traced as uniform
from gactx.kernels.schemes.uniform.reference import torch_dequantize, torch_quantize
from tests.helpers import extreme_input, same_values, special_input


def _input(n, dtype, seed, specials=()):
    return special_input(n, dtype, seed, 3.0, specials, every=61)


@settings(max_examples=40)
@given(
    n=st.integers(1, 3000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    bits=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([32, 256]),
    specials=st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0]), max_size=3),
    seed=st.integers(0, 2**31),
)
def test_deterministic_bytes_are_the_twins(n, dtype, bits, group, specials, seed):
    x = _input(n, dtype, seed, specials)
    codes, meta = uniform.quantize(x, bits, group, stochastic=False)
    twin_codes, twin_meta = torch_quantize(x, bits, group, False, 0)
    assert torch.equal(codes, twin_codes) and same_values(meta, twin_meta)
    assert same_values(
        uniform.dequantize(codes, meta, bits, group, n, dtype), torch_dequantize(codes, meta, bits, group, n, dtype)
    )


@pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built here")
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stochastic_bytes_are_the_cpp_kernels(bits):
    x = _input(5000, torch.float32, 0)
    seed = (7 << 40) + 12345  # both halves of the 64-bit seed are used
    codes, meta = uniform.quantize(x, bits, 256, stochastic=True, seed=seed)
    cpp_codes, cpp_meta = cpu.quantize(x, bits, 256, True, seed)
    assert torch.equal(codes, cpp_codes) and torch.equal(meta, cpp_meta)
    codes_t, _ = uniform.quantize(x, bits, 256, stochastic=True, seed=torch.tensor(seed))
    assert torch.equal(codes_t, codes), "a seed tensor draws what the same int draws"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_extreme_groups_are_the_twins_and_the_cpp_kernels(dtype, bits):
    """Groups at the edges of the range: deterministic bytes and decoded values are the twin's; stochastic
    bytes are the C++ kernels' for the same seed."""
    x = extreme_input(dtype)
    codes, meta = uniform.quantize(x, bits, 32, stochastic=False)
    twin_codes, twin_meta = torch_quantize(x, bits, 32, False, 0)
    assert torch.equal(codes, twin_codes) and same_values(meta, twin_meta)
    decoded = uniform.dequantize(codes, meta, bits, 32, x.numel(), dtype)
    assert torch.isfinite(decoded).all()
    assert same_values(decoded, torch_dequantize(codes, meta, bits, 32, x.numel(), dtype))
    if cpu.available():
        codes, meta = uniform.quantize(x, bits, 32, stochastic=True, seed=21)
        cpp_codes, cpp_meta = cpu.quantize(x, bits, 32, True, 21)
        assert torch.equal(codes, cpp_codes) and same_values(meta, cpp_meta)


def _eager_and_compiled(x: torch.Tensor, group: int, stochastic: bool, seed: int):
    """``(codes, meta, decoded)`` of a 4-bit round trip of ``x``, eagerly and compiled by Inductor, and the
    compiled function (for another seed)."""
    torch._dynamo.reset()

    def roundtrip(x, seed):
        codes, meta = uniform.quantize(x, 4, group, stochastic, seed)
        return codes, meta, uniform.dequantize(codes, meta, 4, group, x.numel(), x.dtype)

    compiled = torch.compile(roundtrip, fullgraph=True)
    return roundtrip(x, torch.tensor(seed)), compiled(x, torch.tensor(seed)), compiled


def test_a_fresh_seed_is_read_at_run_time_in_a_compiled_graph():
    torch._dynamo.reset()
    x = _input(1024, torch.float32, 2)

    def codes(x):
        return uniform.quantize(x, 2, 256, True, traced.fresh_seed(x))[0]

    compiled = torch.compile(codes, fullgraph=True)
    first, second = compiled(x), compiled(x)
    assert not torch.equal(first, second), "each call draws a new seed: the noise does not repeat"
    a, b = traced.fresh_seed(x), traced.fresh_seed(x)
    assert a.dtype == torch.int64 and a.shape == () and not torch.equal(a, b)


def test_the_saved_value_ops_tick_and_encode_in_one_op():
    """``quantize_saved`` and ``pack_bool_saved``: the kernel's bytes for a value in any layout (they take
    whatever strides Inductor hands them), and the listener told once each."""
    heard = []
    token = traced.new_token(lambda token, like, count: heard.append((tuple(like.shape), int(count))))
    x = torch.randn(24, 40).t()  # not contiguous
    codes, meta, count = uniform.kernel_quantize_saved(x, 4, 32, False, 7, "auto", token)
    ref_codes, ref_meta = uniform.kernel_quantize(x.reshape(-1), 4, 32, False, 7, "auto")
    assert torch.equal(codes, ref_codes) and torch.equal(meta, ref_meta)
    mask = x > 0
    packed, count2 = traced.kernel_pack_bool_saved(mask, "auto", token)
    assert torch.equal(packed, traced.pack_bool(mask.reshape(-1)))
    assert heard == [((40, 24), int(count)), ((40, 24), int(count2))] and int(count2) == int(count) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_ops_on_triton_store_and_decode_what_the_kernels_api_does(dtype, triton_device, monkeypatch):
    """``quantize_saved``, ``quantize`` and ``dequantize`` on Triton (under the interpreter here; the ops a compiled
    graph calls on a GPU), their launches planned once a size and the value read where it lies: the bytes and values
    of ``gactx.quantize`` and ``gactx.dequantize`` (deterministic rounding), for a value in any layout."""
    import gactx

    token = traced.new_token(lambda token, like, count: None)
    values = (_input(3000, dtype, 2), _input(777, dtype, 3).reshape(21, 37), _input(960, dtype, 4).reshape(24, 40).t())
    for x in (v.to(triton_device) for v in values):
        codes, meta, _ = uniform.kernel_quantize_saved(x, 4, 32, False, 7, "triton", token)
        q = gactx.quantize(x.reshape(-1), 4, 32, stochastic=False, backend="triton")
        assert torch.equal(codes, q.data) and torch.equal(meta, q.meta), x.shape
        again = uniform.kernel_quantize(x.reshape(-1), 4, 32, False, 7, "triton")
        assert torch.equal(again[0], q.data) and torch.equal(again[1], q.meta)
        decoded = uniform.kernel_dequantize(codes, meta, 4, 32, x.numel(), dtype, "triton")
        assert decoded.shape == (x.numel(),) and same_values(decoded, gactx.dequantize(q, backend="triton"))
    from gactx.kernels import functional

    for name in ("quantize_checked", "dequantize"):  # a contiguous value: the planned launches alone
        monkeypatch.setattr(functional, name, lambda *a, **k: pytest.fail("the kernels' whole path was taken"))
    x = values[1].to(triton_device)
    codes, meta, _ = uniform.kernel_quantize_saved(x, 4, 32, True, 7, "triton", token)
    assert uniform.kernel_dequantize(codes, meta, 4, 32, x.numel(), dtype, "triton").shape == (x.numel(),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_groups_compiled_by_inductor_give_the_eager_bytes(dtype):
    eager, compiled, _ = _eager_and_compiled(extreme_input(dtype), 32, True, 5)
    assert torch.equal(eager[0], compiled[0]) and same_values(eager[1], compiled[1])
    assert same_values(eager[2], compiled[2]) and torch.isfinite(compiled[2]).all()


@pytest.mark.parametrize("stochastic", [False, True])
def test_compiled_by_inductor_gives_the_same_bytes(stochastic):
    x = _input(3000, torch.float32, 1, [float("nan")])
    eager, compiled, roundtrip = _eager_and_compiled(x, 256, stochastic, 99)
    assert (
        torch.equal(eager[0], compiled[0]) and same_values(eager[1], compiled[1]) and same_values(eager[2], compiled[2])
    )
    again = roundtrip(x, torch.tensor(100))
    assert stochastic != torch.equal(again[0], compiled[0]), "a new seed tensor: new noise, same graph"
