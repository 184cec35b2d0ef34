"""gactx/kernels/functional.py: the public quantize/dequantize API on every kind of input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import gactx
from gactx.kernels import cpu
from gactx.kernels.format import expected_nbytes
from tests.conftest import TRITON_DEVICE
from tests.helpers import assert_same_bits, group_steps

BACKENDS = ["torch", "triton"]


def _on(x: torch.Tensor, backend: str) -> torch.Tensor:
    """``x`` where ``backend`` runs here: Triton's cases on the GPU where there is one."""
    return x.to(TRITON_DEVICE) if backend == "triton" else x


def _layouts():
    g = torch.Generator().manual_seed(0)
    yield "0-d", torch.tensor(3.5)
    yield "empty", torch.empty(0, 7)
    yield "one element", torch.tensor([-2.0])
    yield "odd size", torch.randn(3, 5, 17, generator=g)
    yield "channels_last", torch.randn(2, 3, 5, 7, generator=g).to(memory_format=torch.channels_last)
    yield "channels_last_3d", torch.randn(2, 3, 2, 3, 5, generator=g).to(memory_format=torch.channels_last_3d)
    yield "transposed", torch.randn(33, 9, generator=g).t()
    yield "strided slice", torch.randn(16, 40, generator=g)[::3, 1::2]
    yield "expanded", torch.randn(5, 1, generator=g).expand(5, 9)


LAYOUTS = list(_layouts())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("name,x", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_shape_dtype_device_and_strides_come_back(name, x, bits, backend):
    for dtype in (torch.float32, torch.bfloat16):
        xd = _on(x, backend).to(dtype)
        q = gactx.quantize(xd, bits, 32, stochastic=False, backend=backend)
        y = gactx.dequantize(q, backend=backend)
        assert y.shape == xd.shape and y.dtype == dtype and y.device == xd.device
        if xd.is_contiguous() or xd.is_contiguous(memory_format=torch.channels_last):
            assert y.stride() == xd.stride() or xd.numel() <= 1
        assert q.nbytes == expected_nbytes(xd.numel(), dtype, bits, 32) or bits == 32
        if bits <= 8 and xd.numel():
            codes_step = q.meta[:, 1].max()
            assert (y.float() - xd.float()).abs().max() <= codes_step / 2 * (1 + 1e-5) + 1e-2 * (dtype != torch.float32)


def test_channels_last_is_compressed_without_a_copy():
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    q = gactx.quantize(x, 8, 32, stochastic=False, backend="torch")
    # Groups run along memory order (channels fastest): one group is 32 channels-last neighbours.
    first_group = x.permute(0, 2, 3, 1).reshape(-1)[:32]
    assert q.meta[0, 0] == first_group.min()


def test_bits_32_keeps_the_tensor_and_16_keeps_half_tensors():
    x = torch.randn(10)
    q = gactx.quantize(x, 32)
    assert q.data is x and gactx.dequantize(q) is x and q.nbytes == 40
    h = torch.randn(10).half()
    q = gactx.quantize(h, 16)
    assert q.data is h and q.nbytes == 20


def test_bits_16_stores_float32_as_bfloat16():
    x = torch.tensor([1e30, -3.0, 1.0 + 2**-12])
    q = gactx.quantize(x, 16, stochastic=False, backend="torch")
    assert q.data.dtype == torch.bfloat16 and q.nbytes == 6
    assert torch.equal(gactx.dequantize(q), x.to(torch.bfloat16).float())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [1, 2, 8, 32])
def test_bool_masks_are_packed_losslessly_whatever_the_bits(bits, backend):
    mask = _on(torch.rand(3, 11, 7) < 0.5, backend)
    q = gactx.quantize(mask, bits, backend=backend)
    assert q.nbytes == -(-mask.numel() // 8)
    assert torch.equal(gactx.dequantize(q, backend=backend), mask)


def test_nbytes_meets_the_compression_targets():
    x = torch.randn(1 << 18)
    assert gactx.quantize(x, 2).nbytes * 12 <= x.nbytes
    assert gactx.quantize(x, 4).nbytes * 7 <= x.nbytes
    assert x.nbytes / gactx.quantize(x, 2).nbytes >= 14


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"bits": 3}, ValueError, r"bits=3 is not allowed; allowed values are \(1, 2, 4, 8, 16, 32\)"),
        ({"bits": True}, ValueError, "bits=True"),
        ({"bits": 2.0}, ValueError, "bits=2.0 is not allowed"),
        ({"bits": 2, "group_size": 256.0}, ValueError, "group_size=256.0 is not allowed"),
        ({"bits": 2, "group_size": 100}, ValueError, r"allowed values are \(32, 64"),
        ({"bits": 2, "backend": "cuda"}, ValueError, r"allowed values are \('auto', 'triton', 'cpp', 'torch'\)"),
        ({"bits": 2, "seed": -1}, ValueError, "seed=-1"),
        ({"bits": 2, "seed": 1.5}, ValueError, "seed=1.5"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        gactx.quantize(torch.randn(4), **kwargs)


@pytest.mark.parametrize("x", [torch.arange(4), torch.randn(4).double(), torch.randn(4, dtype=torch.complex64)])
def test_unsupported_dtypes_are_named(x):
    with pytest.raises(ValueError, match=f"dtype {x.dtype} is not supported; allowed dtypes are torch.float32"):
        gactx.quantize(x, 4)


def test_sparse_and_non_tensors_are_refused():
    with pytest.raises(ValueError, match="dense"):
        gactx.quantize(torch.eye(3).to_sparse(), 4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        gactx.quantize(np.ones(3), 4)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        gactx.dequantize(torch.ones(3))


def test_nested_meta_and_subclass_tensors_are_refused_and_history_is_dropped():
    from torch.testing._internal.two_tensor import TwoTensor

    with pytest.raises(ValueError, match="nested"):
        gactx.quantize(torch.nested.nested_tensor([torch.randn(3), torch.randn(5)]), 4)
    with pytest.raises(ValueError, match="meta tensor has none"):
        gactx.quantize(torch.empty(8, device="meta"), 4)
    with pytest.raises(ValueError, match="subclass TwoTensor: its data lives in the tensors it wraps"):
        gactx.quantize(TwoTensor(torch.randn(4), torch.randn(4)), 4)

    class Tagged(torch.Tensor):
        pass

    with pytest.raises(ValueError, match=r"subclass Tagged: a QuantizedTensor decodes to a plain torch.Tensor"):
        gactx.quantize(torch.randn(4).as_subclass(Tagged), 4)
    x = torch.randn(4096, requires_grad=True)
    y = gactx.dequantize(gactx.quantize(x * 2, 4))
    assert not y.requires_grad and y.grad_fn is None
    assert gactx.dequantize(gactx.quantize(torch.nn.Parameter(torch.randn(64)), 8)).shape == (64,)


def test_seed_none_follows_torch_manual_seed():
    x = torch.randn(1000)
    torch.manual_seed(5)
    a = gactx.quantize(x, 2)
    torch.manual_seed(5)
    b = gactx.quantize(x, 2)
    assert torch.equal(a.data, b.data)


def test_auto_backend_uses_torch_on_cpu_tensors(monkeypatch):
    import gactx.kernels.functional as functional

    def fail(*args, **kwargs):
        raise AssertionError("the Triton launcher must not run for a CPU tensor under backend='auto'")

    monkeypatch.setattr(functional, "triton_quantize", fail)
    gactx.quantize(torch.randn(100), 4)


finite_floats = st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(
    x=arrays(np.float32, st.integers(1, 700), elements=finite_floats),
    bits=st.sampled_from([1, 2, 4, 8]),
    group_size=st.sampled_from([32, 64, 256]),
    seed=st.integers(0, 2**40),
)
def test_property_every_element_within_one_step(x, bits, group_size, seed):
    t = torch.from_numpy(x)
    q = gactx.quantize(t, bits, group_size, seed=seed)
    y = gactx.dequantize(q)
    step = group_steps(q.meta, group_size, t.numel())
    assert y.shape == t.shape and y.dtype == t.dtype
    assert ((y - t).abs() <= step * (1 + 1e-5) + 1e-30).all()
    assert q.nbytes == expected_nbytes(t.numel(), t.dtype, bits, group_size)


@settings(max_examples=40, deadline=None)
@given(
    codes=arrays(np.int64, st.integers(2, 200), elements=st.integers(0, 255)),
    bits=st.sampled_from([1, 2, 4, 8]),
)
def test_property_codes_survive_pack_and_unpack(codes, bits):
    """Integer inputs spanning [0, 2**bits - 1] are their own codes: the packed bytes must match the
    documented layout (planes of a group, plane 0 in the lowest bits) and decode back to the same integers."""
    levels = (1 << bits) - 1
    c = torch.from_numpy(codes % (levels + 1))
    c[0], c[-1] = 0, levels  # pin min and max so that lo = 0 and step = 1 (plus the margin)
    q = gactx.quantize(c.float(), bits, 256, stochastic=False)
    per_byte = 8 // bits
    padded = torch.zeros(-(-c.numel() // 256) * 256, dtype=torch.int64)  # whole groups, zero codes past the end
    padded[: c.numel()] = c
    planes = padded.view(-1, per_byte, 256 // per_byte)  # [group, plane, element of the plane]
    expected = (planes << (torch.arange(per_byte) * bits)[:, None]).sum(1).flatten().to(torch.uint8)
    assert torch.equal(q.data, expected)
    assert torch.equal(gactx.dequantize(q).round().long(), c)


@settings(max_examples=40, deadline=None)
@given(
    x=arrays(np.float32, st.integers(1, 300), elements=st.floats(width=32)),  # NaN and +-Inf included
    bits=st.sampled_from([1, 2, 4, 8]),
)
def test_property_non_finite_stays_non_finite_and_finite_groups_stay_finite(x, bits):
    t = torch.from_numpy(x)
    y = gactx.dequantize(gactx.quantize(t, bits, 32))
    assert (~torch.isfinite(y))[~torch.isfinite(t)].all(), "a NaN or Inf came back finite"
    clean = torch.isfinite(t).view(-1)
    groups_clean = torch.zeros(-(-t.numel() // 32) * 32, dtype=torch.bool)
    groups_clean[: t.numel()] = clean
    groups_clean[t.numel() :] = True
    group_ok = groups_clean.view(-1, 32).all(1).repeat_interleave(32)[: t.numel()]
    assert torch.isfinite(y)[group_ok].all(), "a finite group came back with a non-finite value"


# Every backend, the C++ kernels too where they are built.
EDGE_BACKENDS = [*BACKENDS, pytest.param("cpp", marks=pytest.mark.skipif(not cpu.available(), reason="no C++ build"))]


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
def test_a_range_wider_than_float32_comes_back_within_half_a_step(backend):
    x = _on(torch.tensor([2e38, -2e38, 0.0, 1e38]), backend)
    q = gactx.quantize(x, 8, 32, stochastic=False, backend=backend)
    y = gactx.dequantize(q, backend=backend)
    step = q.meta[0, 1].double()
    assert 255 * step <= (x[0].double() - x[1].double()) * (1 + 2**-19), "not the grid of the ends"
    assert torch.isfinite(y).all() and ((y.double() - x.double()).abs() <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_16_bit_inputs_near_their_maximum_come_back_finite(backend, dtype, bits):
    top = torch.finfo(dtype).max
    x = _on(torch.tensor([3e38, -1e38, 0.0, top] if dtype == torch.bfloat16 else [top, -top, 0.0, 65000.0]), backend)
    x = x.to(dtype)
    for stochastic in (False, True):
        q = gactx.quantize(x, bits, 32, stochastic=stochastic, seed=1, backend=backend)
        y = gactx.dequantize(q, backend=backend)
        assert y.dtype == dtype and torch.isfinite(y).all(), y
        assert ((y.double() - x.double()).abs() <= q.meta[0, 1].double() * (1 + 1e-5) + top * 2**-8).all()


@pytest.mark.parametrize("backend", EDGE_BACKENDS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_16_bits_store_float32_max_as_the_largest_bfloat16(backend, stochastic):
    flt_max = torch.finfo(torch.float32).max
    x = _on(torch.tensor([flt_max, -flt_max, float("inf"), float("nan")]), backend)
    y = gactx.dequantize(gactx.quantize(x, 16, stochastic=stochastic, backend=backend), backend=backend)
    bf16_max = torch.finfo(torch.bfloat16).max
    assert y[0] == bf16_max and y[1] == -bf16_max and y[2] == float("inf") and y[3].isnan()


# Every finite float32, subnormals included, and often the far ends, so that groups span more than FLT_MAX.
finite_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False) | st.sampled_from([3e38, -3e38, -2e38])


@settings(max_examples=60, deadline=None)
@given(
    x=arrays(np.float32, st.integers(1, 300), elements=finite_float32),
    bits=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**40),
)
def test_property_every_finite_float32_comes_back_finite_within_one_step(x, bits, seed):
    """Within one step of a step that is the group's own: L steps span its range (plus the margin), or are the
    smallest step (a range below 2**-126), or at 1 bit FLT_MAX, the most a step can be."""
    t = torch.from_numpy(x)
    q = gactx.quantize(t, bits, 32, seed=seed)
    y = gactx.dequantize(q)
    padded = torch.cat([t.double(), t[-1:].double().expand(-t.numel() % 32)]).view(-1, 32)
    span = padded.amax(1) - padded.amin(1)
    levels = (1 << bits) - 1
    assert (levels * q.meta[:, 1].double() <= torch.clamp(span * (1 + 2**-19), min=levels * 2.0**-126)).all()
    step = group_steps(q.meta, 32, t.numel()).double()
    assert torch.isfinite(y).all()
    assert ((y.double() - t.double()).abs() <= step * (1 + 1e-5)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_bytes_through_the_public_api(backend):
    x = _on(torch.randn(4, 257), backend)
    ref = gactx.quantize(x, 4, stochastic=False, backend="torch")
    q = gactx.quantize(x, 4, stochastic=False, backend=backend)
    assert torch.equal(q.data, ref.data)
    assert_same_bits(q.meta, ref.meta)


SUBNORMAL_GROUPS = [
    ("float32 1e-40", torch.float32, 1e-40),
    ("float32 a few ulps", torch.float32, 3e-45),
    ("bfloat16 1e-39", torch.bfloat16, 1e-39),
]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.parametrize("name, dtype, scale", SUBNORMAL_GROUPS, ids=[g[0] for g in SUBNORMAL_GROUPS])
def test_subnormal_groups_round_unbiasedly_on_the_smallest_normal_step(backend, bits, name, dtype, scale):
    # A group's step is at least 2**-126 (its reciprocal must be finite): a group of subnormal values is rounded on
    # that grid, finer than any normal value's, not on range / L. Every decode is within that step, and the mean
    # of many is the input (to the noise's 23 bits: 2**-24 of a step, under half the smallest subnormal).
    if backend == "cpp" and not cpu.available():
        pytest.skip("the C++ CPU kernels could not be built here")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(512, generator=g) * scale).to(dtype)
    x[:3] = torch.tensor([0.0, 1e-45, -1e-45]).to(dtype)
    draws = 1500
    decoded = torch.stack(
        [gactx.dequantize(gactx.quantize(x, bits, seed=s, backend=backend)).double() for s in range(draws)]
    )
    q = gactx.quantize(x, bits, seed=0, backend=backend)
    step = q.meta[:, 1].double().repeat_interleave(256)[: x.numel()]
    assert (step == 2.0**-126).all()
    exact = x.double()
    assert ((decoded - exact).abs() <= step).all(), "within a step"
    p = ((exact - q.meta[:, 0].double().repeat_interleave(256)[: x.numel()]) / step).remainder(1.0)
    standard_error = step * (p * (1 - p)).sqrt() / draws**0.5
    assert ((decoded.mean(0) - exact).abs() <= 5 * standard_error + 2.0**-24 * step).all(), "unbiased"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bound_triton_encoders_store_and_decode_what_the_whole_path_does(dtype, monkeypatch):
    """A replayed save's Triton encoder and decoder, their launches planned once and the tensor read where it is (no
    view, no detach): the same bytes and values as the whole path, for a contiguous tensor of any shape that requires
    grad; a tensor in another layout takes the whole path."""
    from gactx.kernels.functional import bound_dequantize, bound_quantize, quantize_checked

    g = torch.Generator().manual_seed(0)
    for shape, bits in (((7, 33), 4), ((256,), 2), ((3, 4, 50), 8)):
        leaf = (torch.randn(shape, generator=g) * 3).to(dtype).to(TRITON_DEVICE).requires_grad_(True)
        t = leaf * 1.0  # a saved activation: it has history
        encode = bound_quantize(t, bits, 32, True, "triton")
        others = (t.detach().flip(0), t.detach().reshape(-1)[:-1], t.detach().transpose(0, -1))
        for x in (t, *others):  # contiguous; contiguous; of another size; in another layout (the 1-d one: the same)
            bound, whole = encode(x, 1234), quantize_checked(x, bits, 32, True, 1234, "triton")
            assert torch.equal(bound.data, whole.data) and torch.equal(bound.meta, whole.meta), (shape, x.shape)
            assert (bound.shape, bound.dense_shape, bound.perm) == (whole.shape, whole.dense_shape, whole.perm)
            decoded, expected = bound_dequantize(bound, "triton")(bound), gactx.dequantize(whole, backend="triton")
            assert torch.equal(decoded, expected) and decoded.stride() == expected.stride()
            assert not decoded.requires_grad
    # The bound path is its own: a contiguous tensor of the bound size never takes the whole path's calls.
    from gactx.kernels import functional

    for name in ("quantize_checked", "dequantize", "memory_order"):
        monkeypatch.setattr(functional, name, lambda *a, **k: pytest.fail("the whole path was taken"))
    stored = encode(t, 99)
    assert bound_dequantize(stored, "triton")(stored).shape == t.shape
    monkeypatch.undo()
    # A decoder bound for one layout given another: the whole path, which restores its strides.
    transposed = quantize_checked(torch.randn(33, 9, generator=g).t().to(TRITON_DEVICE), 4, 32, True, 7, "triton")
    decode = bound_dequantize(quantize_checked(torch.randn(9, 33).to(TRITON_DEVICE), 4, 32, True, 7, "triton"))
    assert decode(transposed).stride() == gactx.dequantize(transposed, backend="triton").stride() == (1, 9)
