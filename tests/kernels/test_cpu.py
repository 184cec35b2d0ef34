"""gactx/kernels/cpu.py: the C++ CPU kernels give the torch twins' bytes, round unbiasedly, and allocate
nothing but their output."""

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gactx
from gactx.kernels import cpu
from gactx.kernels.codes import decode_codes, encode_bins
from gactx.kernels.format import FLOAT_DTYPES
from gactx.kernels.schemes.normal import torch_normal_dequantize, torch_normal_quantize
from gactx.kernels.schemes.uniform.reference import torch_dequantize, torch_quantize
from tests.helpers import assert_unbiased_at_the_edges, extreme_input, group_steps, same_values, special_input

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ CPU kernels could not be built here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=60)
@given(
    n=st.integers(0, 5000),
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([32, 256, 4096]),
    scale=st.sampled_from([1e-30, 1.0, 1e4, 3e38]),
    specials=st.lists(st.sampled_from([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 3e38]), max_size=4),
    seed=st.integers(0, 2**31),
)
def test_deterministic_bytes_and_values_are_the_twins(n, dtype, bits, group, scale, specials, seed):
    x = special_input(n, dtype, seed, scale, specials)
    codes, meta = cpu.quantize(x, bits, group, False, 0)
    twin_codes, twin_meta = torch_quantize(x, bits, group, False, 0)
    assert torch.equal(codes, twin_codes)
    assert same_values(meta, twin_meta)  # equal values; the sign of a zero minimum is the reduction order's
    out = cpu.dequantize(codes, meta, bits, group, n, dtype)
    assert out.dtype == dtype and same_values(out, torch_dequantize(codes, meta, bits, group, n, dtype))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stochastic_rounding_is_unbiased_and_seeded(bits):
    x = torch.randn(4096)
    draws = torch.stack([gactx.dequantize(gactx.quantize(x, bits, seed=s)) for s in range(400)])
    q = gactx.quantize(x, bits, seed=0)
    step = q.meta[:, 1].repeat_interleave(256)
    # The mean of 400 draws is within 5 standard errors of x (the rounding error of one draw is at most a step).
    assert ((draws.mean(0) - x).abs() <= 5 * step / 2 / 400**0.5 + 1e-7).all()
    assert ((draws - x).abs() <= step * (1 + 1e-6)).all(), "never more than a level away"
    assert torch.equal(gactx.quantize(x, bits, seed=7).data, gactx.quantize(x, bits, seed=7).data)
    assert not torch.equal(gactx.quantize(x, bits, seed=7).data, gactx.quantize(x, bits, seed=8).data)


def test_no_seed_rounds_a_fixed_element_down_every_time():
    # murmur3's finalizer maps 0 to 0: without an offset, element 0 of seed 0 drew u = 0 on every call, and a one at
    # the top of its group decoded as 0 at 1 bit (GACT's test_quantize_1bit: a one-hot 1000 x 1000, seed 0).
    one_hot = torch.zeros(1000, 1000)
    one_hot[torch.arange(1000), torch.arange(1000) * 7 % 1000] = 1.0
    one_hot[0, 0] = 1.0
    decoded = gactx.dequantize(gactx.quantize(one_hot, 1, seed=0, backend="cpp"))  # a one is its group's top level
    assert torch.equal(decoded > 0.5, one_hot > 0.5)
    first = torch.zeros(256)
    first[0] = 1.0
    for seed in range(64):
        assert gactx.dequantize(gactx.quantize(first, 1, seed=seed, backend="cpp"))[0] > 0.5, seed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_extreme_groups_are_the_twins_and_decode_within_a_step(dtype, bits):
    """Groups at the edges of the range (spans past FLT_MAX, values near the dtype's maximum): deterministic
    bytes and decoded values (float32 and the dtype) are the twin's; stochastic decodes are finite, within a
    step."""
    x = extreme_input(dtype)
    codes, meta = cpu.quantize(x, bits, 32, False, 0)
    twin_codes, twin_meta = torch_quantize(x, bits, 32, False, 0)
    assert torch.equal(codes, twin_codes) and same_values(meta, twin_meta)
    for out in (torch.float32, dtype):
        decoded = cpu.dequantize(codes, meta, bits, 32, x.numel(), out)
        assert torch.isfinite(decoded).all()
        assert same_values(decoded, torch_dequantize(codes, meta, bits, 32, x.numel(), out))
    codes, meta = cpu.quantize(x, bits, 32, True, 17)
    xhat = cpu.dequantize(codes, meta, bits, 32, x.numel(), torch.float32).double()
    step = group_steps(meta, 32, x.numel()).double()
    assert torch.isfinite(xhat).all() and ((xhat - x.double()).abs() <= step * (1 + 1e-5)).all()


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_stochastic_rounding_is_unbiased_past_the_float32_range(bits):
    assert_unbiased_at_the_edges(lambda x, bits, seed: cpu.quantize(x, bits, 32, True, seed), bits, 300)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_bins_are_bucketize_and_decode_through_the_table(dtype, bits):
    edges = torch.linspace(-2, 2, (1 << bits) - 1).to(dtype)
    table = torch.arange(1 << bits).to(dtype)
    x = torch.cat([torch.randn(999) * 2, edges.float(), torch.tensor([float("nan"), float("inf"), -float("inf")])])
    x = x.to(dtype).view(1, -1).expand(3, -1).t()  # a transposed layout: binned in memory order
    coded = encode_bins(x, edges, bits, table, backend="cpp")
    expected = table[torch.bucketize(x, edges)]
    assert torch.equal(decode_codes(coded), expected)
    twin = encode_bins(x, edges, bits, table, backend="torch")
    assert torch.equal(decode_codes(twin), expected)
    assert coded.codes.numel() == -(-x.numel() * bits // 8)
    assert torch.equal(coded.codes, twin.codes), "the same bytes, the codes past the end 0"


def test_auto_is_cpp_on_the_cpu_and_torch_where_the_build_failed(monkeypatch):
    x = torch.randn(1000)
    from gactx.kernels.functional import choose_backend

    assert choose_backend(x, "auto") == "cpp"
    monkeypatch.setattr(cpu, "built", None)
    assert choose_backend(x, "auto") == "torch"
    with pytest.raises(RuntimeError, match="could not be built"):
        gactx.quantize(x, 2, backend="cpp")
    q = gactx.quantize(x, 2, stochastic=False)
    assert torch.equal(q.data, torch_quantize(x, 2, 256, False, 0)[0])


def test_a_failed_build_warns_and_falls_back(monkeypatch):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.warns(RuntimeWarning, match="falling back to the torch kernels"):
        assert cpu._build() is None


def test_a_failed_builds_warning_gives_the_compilers_error_not_the_command_line(monkeypatch):
    from torch.utils import cpp_extension

    flags = " ".join(f"-isystem /opt/include/{i}" for i in range(40))
    log = (
        f"Error building extension 'gactx_cpu_0': [1/7] c++ -MMD -MF graph_ops.o.d {flags} -c graph_ops.cpp\n"
        "FAILED: graph_ops.o\n"
        "graph_ops.cpp:91:52: error: too few arguments to function 'f'\n"
        "ninja: build stopped: subcommand failed."
    )

    def fail(*args, **kwargs):
        raise RuntimeError(log)

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.warns(RuntimeWarning, match="graph_ops.cpp:91:52: error: too few arguments") as caught:
        assert cpu._build() is None
    assert "-isystem" not in str(caught[0].message)


def test_cpp_refuses_other_devices():
    from gactx.kernels.functional import choose_backend

    with pytest.raises(ValueError, match="runs on CPU tensors"):
        choose_backend(torch.randn(10, device="meta"), "cpp")
    with pytest.raises(ValueError, match="a meta tensor has none"):  # quantize says first that it has no values
        gactx.quantize(torch.randn(10, device="meta"), 2, backend="cpp")


@pytest.mark.parametrize("bits", [2, 4])
def test_peak_memory_is_the_output_and_a_group_a_thread(bits):
    x = torch.randn(1 << 20)  # 4 MiB
    q = gactx.quantize(x, bits)
    with gactx.PeakMemory("cpu") as meter:
        q2 = gactx.quantize(x, bits)
    assert meter.peak <= q2.nbytes + 64 * 1024, (meter.peak, q2.nbytes)
    with gactx.PeakMemory("cpu") as meter:
        out = gactx.dequantize(q)
    assert meter.peak <= out.numel() * 4 + 64 * 1024
    with gactx.PeakMemory("cpu") as meter, warnings.catch_warnings():
        gactx.quantize(x, bits, backend="torch")
    assert meter.peak > 4 * x.numel() * 4, "the twins hold temporaries several times the input"


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099])
def test_bool_masks_pack_as_the_twin_and_come_back(n):
    from gactx.kernels.bitmask import torch_pack_bool

    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = cpu.pack_bool(mask)
    assert torch.equal(packed, torch_pack_bool(mask))
    assert torch.equal(cpu.unpack_bool(packed, n), mask)
    assert torch.equal(gactx.dequantize(gactx.quantize(mask, 1)), mask)


def test_one_bit_codes_decode_through_the_table_without_a_mask():
    from gactx.kernels.codes import encode_codes

    t = torch.randn(64, 47).t()  # transposed: decoded in memory order, back in the layout
    table = torch.tensor([-1.5, 2.5])
    coded = encode_codes(t > 0, 1, table, backend="cpp")
    assert torch.equal(decode_codes(coded), torch.where(t > 0, 2.5, -1.5))
    assert decode_codes(coded).stride() == t.stride()


COMPARES = {
    "gt": lambda t, lo, hi: t > lo,
    "open": lambda t, lo, hi: (t > lo) & (t < hi),
    "outside": lambda t, lo, hi: ~((t >= lo) & (t <= hi)),
    "closed": lambda t, lo, hi: (t >= lo) & (t <= hi),
    "ge": lambda t, lo, hi: t >= lo,
    "le": lambda t, lo, hi: t <= hi,
}


@pytest.mark.parametrize("kind", list(COMPARES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 9, 4099])
def test_a_comparison_packs_as_torch_compares_then_packs(kind, dtype, n):
    """Bounds of float32 tensors round to float32 as torch's scalar does (0.1 is not a float32); 16-bit
    tensors' bounds are exact in their dtype (mask_values keeps the others as they are); NaN and the
    bounds themselves included."""
    from gactx.kernels.bitmask import torch_pack_bool

    lo, hi = (0.1, 0.7) if dtype == torch.float32 else (0.125, 0.75)
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[::5] = lo
    x[1::7] = hi
    x[2::11] = float("nan")
    x[3::13] = float("inf")
    expected = COMPARES[kind](x, lo, hi)
    assert torch.equal(cpu.pack_compare(x, kind, lo, hi), torch_pack_bool(expected))


def test_a_mask_is_made_in_one_pass_and_decodes_as_the_tested_one():
    from gactx.kernels.codes import encode_codes, encode_compare

    t = torch.randn(64, 47).t()  # transposed: tested in memory order, back in the layout
    table = torch.tensor([0.0, 1.0])
    coded = encode_compare(t, "gt", 0.0, 0.0, table, backend="auto")
    reference = encode_codes(t > 0, 1, table, backend="torch")
    assert torch.equal(coded.codes.data, reference.codes.data)
    assert torch.equal(decode_codes(coded), decode_codes(reference))
    assert decode_codes(coded).stride() == t.stride()
    assert encode_compare(t, "gt", 0.0, 0.0, table, backend="torch") is None
    assert encode_compare(t.double(), "gt", 0.0, 0.0, table.double()) is None


# ------------------------------------------------------------------------------------------- the normal scheme

NORMAL_SIZES = [1, 255, 257, 4099]


def _normal_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """test_normal.py's samples (an outlier in one group in three), special and extreme groups."""
    from tests.kernels.schemes.test_normal import _sample, _special

    return {"sample": _sample(4099, dtype, "cpu"), "special": _special(dtype, "cpu"), "extreme": extreme_input(dtype)}


@pytest.mark.parametrize("n", NORMAL_SIZES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 256])
def test_normal_deterministic_bytes_and_decodes_are_the_twins(n, bits, dtype, group):
    from tests.kernels.schemes.test_normal import _same, _sample

    x = _sample(n, dtype, "cpu", seed=n)
    codes, meta = cpu.normal_quantize(x, bits, group, False, 0)
    twin_codes, twin_meta = torch_normal_quantize(x, bits, group, False, 0)
    assert codes.dtype == torch.uint8 and meta.dtype == torch.int32 and meta.shape == (-(-n // group), 3)
    assert torch.equal(codes, twin_codes) and torch.equal(meta, twin_meta)
    for out in (dtype, torch.float32):
        decoded = cpu.normal_dequantize(codes, meta, bits, group, n, out)
        assert decoded.dtype == out and _same(decoded, torch_normal_dequantize(codes, meta, bits, group, n, out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normal_metadata_of_many_small_groups_is_the_twins(dtype):
    """Thousands of deviations, each a square root: the twin's must be IEEE's, as the kernels' are (a CPU's float32
    sqrt may be a unit in the last place off, and that moves a stored deviation by one)."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(7)).to(dtype)
    for seed_x in (x, x * 3 + 1):
        _, meta = cpu.normal_quantize(seed_x, 4, 32, False, 0)
        assert torch.equal(meta, torch_normal_quantize(seed_x, 4, 32, False, 0)[1])


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_normal_special_and_extreme_groups_are_the_twins(bits, dtype):
    """NaN and +-Inf groups (the canonical NaN in word 0), constant, tiny and huge groups, spans past FLT_MAX
    (scale 1/4), values at the dtype's largest: the twin's bytes, and its decodes, saturated in the dtype."""
    from tests.kernels.schemes.test_normal import _same

    for name, x in _normal_inputs(dtype).items():
        codes, meta = cpu.normal_quantize(x, bits, 32, False, 0)
        twin_codes, twin_meta = torch_normal_quantize(x, bits, 32, False, 0)
        assert torch.equal(meta, twin_meta), name
        assert torch.equal(codes, twin_codes), name
        for out in (dtype, torch.float32):
            decoded = cpu.normal_dequantize(codes, meta, bits, 32, x.numel(), out)
            assert _same(decoded, torch_normal_dequantize(codes, meta, bits, 32, x.numel(), out)), (name, out)
            assert torch.equal(torch.isfinite(decoded), torch.isfinite(x)), name
    special_meta = torch_normal_quantize(_normal_inputs(dtype)["special"], bits, 32, False, 0)[1]
    kinds = set(special_meta[:, 0].tolist())
    assert {0x7FC00000, 0x7F800000, -0x800000} <= kinds, "NaN, +Inf and -Inf groups in word 0"


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_normal_any_codes_decode_as_the_twin(bits, dtype):
    """Every code of every group (random bytes, not only those the encoder writes) decodes to the twin's bits,
    through the metadata of ordinary, special and extreme groups."""
    from tests.kernels.schemes.test_normal import _same

    g = torch.Generator().manual_seed(bits)
    for name, x in _normal_inputs(dtype).items():
        for group in (32, 256):
            codes, meta = torch_normal_quantize(x, bits, group, False, 0)
            codes = torch.randint(0, 256, codes.shape, generator=g, dtype=torch.uint8)
            n = x.numel()
            for out in (dtype, torch.float32):
                decoded = cpu.normal_dequantize(codes, meta, bits, group, n, out)
                assert _same(decoded, torch_normal_dequantize(codes, meta, bits, group, n, out)), (name, group, out)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_normal_stochastic_rounding_is_unbiased_and_seeded(bits):
    from tests.kernels.schemes.test_normal import _gaps, _sample

    n, group, seeds = 257, 32, 400
    x = _sample(n, torch.float32, "cpu", seed=1)
    below, above = _gaps(x, bits, group)
    _, twin_meta = torch_normal_quantize(x, bits, group, False, 0)
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(seeds):
        codes, meta = cpu.normal_quantize(x, bits, group, True, seed)
        assert torch.equal(meta, twin_meta), "the metadata does not depend on the noise"
        y = cpu.normal_dequantize(codes, meta, bits, group, n, torch.float32).double()
        assert ((y == below) | (y == above)).all(), "an element left its two neighbouring levels"
        total += y
    # A draw's variance is at most gap**2 / 4: the mean is within 5 standard errors of x.
    assert ((total / seeds - x.double()).abs() <= 5 * (above - below) / 2 / seeds**0.5 + 1e-6).all()
    a, b, c = (cpu.normal_quantize(x, bits, group, True, s)[0] for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("backend", ["cpp", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_normal_memory_order_round_trip_runs_the_cpp_kernels(backend, dtype):
    """channels_last and transposed tensors: quantized in memory order without a copy, the twin's bytes, decoded
    with their strides."""
    from tests.kernels.schemes.test_normal import _same

    base = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(0)) * 2
    for x, perm in ((base.to(memory_format=torch.channels_last), (0, 2, 3, 1)), (base[0, 0].t(), (1, 0))):
        x = x.to(dtype)
        q = gactx.quantize(x, 4, 32, scheme="normal", stochastic=False, backend=backend)
        flat = x.permute(perm).reshape(-1)
        twin_codes, twin_meta = torch_normal_quantize(flat, 4, 32, False, 0)
        assert torch.equal(q.data, twin_codes) and torch.equal(q.meta, twin_meta)
        y = gactx.dequantize(q, backend=backend)
        assert y.shape == x.shape and y.dtype == dtype and y.stride() == x.stride()
        assert _same(
            y.permute(perm).reshape(-1), torch_normal_dequantize(twin_codes, twin_meta, 4, 32, flat.numel(), dtype)
        )


def test_normal_auto_runs_cpp_and_allocates_the_output_and_a_group_a_thread(monkeypatch):
    x = torch.randn(1 << 20)  # 4 MiB
    q = gactx.quantize(x, 4, scheme="normal")
    with gactx.PeakMemory("cpu") as meter:
        q2 = gactx.quantize(x, 4, scheme="normal")
    assert meter.peak <= q2.nbytes + 64 * 1024, (meter.peak, q2.nbytes)
    with gactx.PeakMemory("cpu") as meter:
        out = gactx.dequantize(q)
    assert meter.peak <= out.numel() * 4 + 64 * 1024
    calls = []
    monkeypatch.setattr(cpu, "normal_quantize", lambda *args: calls.append(args) or torch_normal_quantize(*args))
    gactx.quantize(x[:100], 4, scheme="normal")
    gactx.quantize(x[:100], 4, scheme="normal", backend="torch")
    assert len(calls) == 1, "auto runs the C++ kernels, torch the twin"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", ["gelu", "tanh", "sigmoid"])
def test_8_bit_fewbit_bins_are_bucketize(dtype, fn):
    """255 edges: found through a grid of cells (one edge a cell: GELU's; crowded edges searched: tanh's at +-1;
    edges that rounding to bfloat16 made equal), exactly torch.bucketize's bins, NaN and infinities included."""
    from gactx.kernels.fewbit import fewbit_table

    table = fewbit_table(fn, (), 8)
    edges = torch.tensor(table.edges).to(dtype)
    x = torch.cat([torch.randn(5000) * 3, torch.rand(2000) * 2 - 1, edges.float(), edges.float().nextafter(
        torch.tensor(float("inf"))), torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])])  # fmt: skip
    x = x.to(dtype)
    coded = encode_bins(x, edges, 8, torch.arange(256).to(torch.float32), backend="cpp")
    assert torch.equal(coded.codes, torch.bucketize(x, edges).to(torch.uint8))


@settings(max_examples=40)
@given(
    edges=st.lists(st.floats(-1e3, 1e3, width=32), min_size=255, max_size=255),
    values=st.lists(st.floats(-2e3, 2e3, width=32) | st.sampled_from([math.nan, math.inf, -math.inf]), max_size=300),
)
def test_8_bit_bins_of_any_sorted_edges_are_bucketize(edges, values):
    e = torch.tensor(sorted(edges), dtype=torch.float32)
    x = torch.tensor(values + sorted(edges), dtype=torch.float32)
    coded = encode_bins(x, e, 8, torch.arange(256).to(torch.float32), backend="cpp")
    assert torch.equal(coded.codes, torch.bucketize(x, e).to(torch.uint8))


def test_8_bit_bins_follow_the_edges_given_not_a_table_kept_from_an_earlier_call():
    """The kernel keeps the index of the last tables of 255 edges it met (building one took longer than the codes of a
    small tensor): a call with other edges of the same length, or the same tensor changed in place, is binned by the
    edges it gives, and more tables than are kept come back right after being dropped."""
    x = torch.randn(3000) * 2
    tables = [torch.linspace(-3, 3, 255) * scale for scale in (1.0, 0.5, 2.0)]
    tables += [torch.sort(torch.randn(255) * (k + 1)).values for k in range(20)]  # more than are kept
    for _ in range(2):
        for edges in tables:
            coded = encode_bins(x, edges, 8, torch.arange(256).to(torch.float32), backend="cpp")
            assert torch.equal(coded.codes, torch.bucketize(x, edges).to(torch.uint8))
    edges = tables[0].clone()
    encode_bins(x, edges, 8, torch.arange(256).to(torch.float32), backend="cpp")
    edges.mul_(0.25)
    coded = encode_bins(x, edges, 8, torch.arange(256).to(torch.float32), backend="cpp")
    assert torch.equal(coded.codes, torch.bucketize(x, edges).to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_8_bit_bins_are_bucketize_from_any_start_and_at_any_length(dtype):
    """The cell grid's loop takes eight values at a time where the CPU has vector gathers and finishes one at a time:
    each start (a view's offset) and length is binned alike, values on each side of every edge included."""
    from gactx.kernels.fewbit import fewbit_table

    edges = torch.tensor(fewbit_table("gelu", (), 8).edges).to(dtype)
    e = edges.float()
    x = torch.cat([e, e.nextafter(torch.tensor(math.inf)), e.nextafter(torch.tensor(-math.inf)), torch.randn(301) * 4,
                   torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e30])]).to(dtype)  # fmt: skip
    for start in range(9):
        for length in (0, 1, 7, 8, 9, 17, x.numel() - start):
            part = x[start : start + length]
            coded = encode_bins(part, edges, 8, torch.arange(256).to(torch.float32), backend="cpp")
            assert torch.equal(coded.codes, torch.bucketize(part.float(), e).to(torch.uint8)), (start, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bound_encoders_store_what_the_kernels_api_stores(dtype):
    """A replayed save's encoders and decoders, their arguments bound once: the same bytes and values as the kernels'
    own calls, for a contiguous tensor (the C++ kernel called directly) and a transposed one (its order restored)."""
    from gactx.kernels.codes import bound_decode_codes, bound_encode_bins
    from gactx.kernels.fewbit import fewbit_table
    from gactx.kernels.functional import bound_dequantize, bound_quantize, quantize_checked

    x = (torch.randn(48, 80) * 3).to(dtype)
    edges = torch.tensor(fewbit_table("gelu", (), 4).edges).to(dtype)
    points = torch.arange(16).to(dtype)
    for t in (x, x.t()):
        for bits in (1, 2, 4, 8):
            bound = bound_quantize(t, bits, 64, True, "auto")(t, 12345)
            full = quantize_checked(t, bits, 64, True, 12345, "cpp")
            assert torch.equal(bound.data, full.data) and torch.equal(bound.meta, full.meta)
            assert (bound.shape, bound.dense_shape, bound.perm, bound.dtype) == (
                full.shape, full.dense_shape, full.perm, full.dtype
            )  # fmt: skip
            decoded = bound_dequantize(bound)(bound)
            assert torch.equal(decoded, gactx.dequantize(full)) and decoded.stride() == gactx.dequantize(full).stride()
        coded = bound_encode_bins(t, edges, 4, points)(t, 0)
        assert torch.equal(bound_decode_codes(coded)(coded), decode_codes(encode_bins(t, edges, 4, points)))
        assert torch.equal(coded.codes, encode_bins(t, edges, 4, points).codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_compiled_graphs_ops_store_and_decode_what_the_kernels_do(dtype, bits):
    """``gactx_cpu::quantize_saved(t, token)`` stores by what is registered under the token (``cpu.register_saved``;
    its step factors derived from ``bits`` in C++) the kernel's codes then its ``(lo, step)`` in one buffer, and
    ``dequantize_saved(stored, token)`` decodes them in the registered shape and dtype to the kernel's values
    (``dequantize_shaped``: in the shape it is given)."""
    x = torch.cat([special_input(900, dtype, 5, 3.0, [float("nan"), float("inf")], every=61), extreme_input(dtype)])
    x = x[: x.numel() // 5 * 5].view(-1, 5)
    codes, meta = cpu.quantize(x.reshape(-1), bits, 32, False, 0)
    token = 10**9 + bits  # a token no graph takes; not logged
    assert cpu.register_saved(token, bits, 32, False, 0, False, FLOAT_DTYPES.index(dtype), x.shape)
    stored = torch.ops.gactx_cpu.quantize_saved(x, token)
    assert torch.equal(stored, torch.cat([codes, meta.view(torch.uint8).reshape(-1)]))
    expected = cpu.dequantize(codes, meta, bits, 32, x.shape, dtype)
    decoded = torch.ops.gactx_cpu.dequantize_saved(stored, token)
    assert decoded.shape == x.shape and decoded.dtype == dtype and same_values(decoded, expected)
    flat = torch.ops.gactx_cpu.dequantize_shaped(stored, token, [x.numel()])
    assert flat.shape == (x.numel(),) and same_values(flat, expected.reshape(-1))


def test_a_compiled_graphs_op_under_a_token_never_registered_says_so():
    with pytest.raises(RuntimeError, match="no compressed save is registered under token"):
        torch.ops.gactx_cpu.quantize_saved(torch.randn(64), 10**9 - 1)


# -- a replayed save's handle (csrc/saved.h): native_quantize and native_encode_bins ----------------------------------


def _modified(t, version):  # what the pack path registers (store.modified_in_place), as a marker here
    return RuntimeError(f"modified: version {t._version}, expected {version}")


@settings(max_examples=30)
@given(
    shape=st.sampled_from([(0,), (7,), (64, 64), (3, 5, 129)]),
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from([1, 2, 4, 8]),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**62 - 1),
)
def test_a_native_handle_stores_the_kernels_bytes_and_decodes_them(shape, dtype, bits, stochastic, seed):
    from gactx.kernels.functional import native_quantize

    x = torch.randn(shape).to(dtype)
    packer = native_quantize(x, bits, 256, stochastic, "auto")
    handle = packer(x.clone(), seed)  # its own copy, freed now: the handle decodes
    codes, meta = cpu.quantize(x, bits, 256, stochastic, seed)
    assert torch.equal(handle.data, codes) and torch.equal(handle.meta, meta) and handle.bits == bits
    assert handle.nbytes == codes.numel() + meta.numel() * 4
    out = handle.unpack()
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, cpu.dequantize(codes, meta, bits, 256, x.shape, dtype))


def test_a_native_handle_of_bins_looks_its_table_up():
    from gactx.kernels.codes import native_encode_bins

    x = torch.randn(33, 65)
    edges, table = torch.tensor([-1.0, 0.0, 0.5]), torch.tensor([10.0, 20.0, 30.0, 40.0])
    handle = native_encode_bins(x, edges, 2, table)(x.clone(), 0)
    assert torch.equal(handle.data, cpu.encode_bins(x.reshape(-1), edges, 2))
    assert torch.equal(handle.unpack(), table[torch.bucketize(x, edges)])
    assert native_encode_bins(x, edges, 1, table[:2]) is None, "a 1-bit mask's codes are the Python path's"


def test_a_native_handle_reads_a_live_unchanged_tensor_itself_and_raises_on_a_change_in_place():
    from gactx.kernels.functional import native_quantize

    cpu.extension().set_modified_error(_modified)
    x = torch.randn(64, 64)
    packer = native_quantize(x, 2, 256, True, "auto")
    handle = packer(x, 1)
    out = handle.unpack()
    assert torch.equal(out, x) and out.data_ptr() == x.data_ptr(), "alive and unchanged: its own values"
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified: version 1, expected 0"):
        handle.unpack()


def test_a_native_handle_of_a_view_follows_its_base():
    from gactx.kernels.functional import native_quantize

    cpu.extension().set_modified_error(_modified)
    base = torch.randn(8, 64)
    view = base[2:6]  # contiguous, at an offset
    handle = native_quantize(view, 4, 256, True, "auto")(view, 3)
    out = handle.unpack()
    assert torch.equal(out, view) and out.data_ptr() == view.data_ptr()
    del view  # the view gone, its base still counts for it
    base[0].zero_()
    with pytest.raises(RuntimeError, match="expected 0"):
        handle.unpack()
    other = torch.randn(8, 64)
    view = other[2:6]
    handle = native_quantize(view, 4, 256, True, "auto")(view, 3)
    del view, other  # both gone: decoded
    assert handle.unpack().shape == (4, 64)


def test_a_native_packer_leaves_other_tensors_to_the_python_path_and_handles_are_counted():
    from gactx.kernels.functional import native_quantize

    x = torch.randn(16, 32)
    packer = native_quantize(x, 4, 256, True, "auto")
    assert packer(x.t(), 0) is None, "not contiguous: stored in memory order by the Python path"
    assert native_quantize(x, 4, 256, True, "torch") is None and native_quantize(x, 16, 256, True, "auto") is None
    alive = cpu.extension().Saved.alive()
    handles = [packer(x, 0) for _ in range(3)]
    assert cpu.extension().Saved.alive() == alive + 3
    del handles
    assert cpu.extension().Saved.alive() == alive


def test_building_under_a_cuda_build_with_no_gpu_says_nothing_of_a_cuda_runtime():
    """A CUDA build of torch on a machine with no GPU logs "No CUDA runtime is found" as ``torch.utils.cpp_extension``
    is imported; gactx imports it only to build CPU kernels, which need none, and holds that notice back (a child
    process, in which torch passes for a CUDA build with no GPU)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "torch.cuda._is_compiled = lambda: True\n"
        "torch.version.cuda = '12.8'\n"
        "torch.cuda.is_available = lambda: False\n"
        "if sys.argv[1] == 'gactx':\n"
        "    from gactx.kernels import cpu\n"
        "    cpu._cpp_extension()\n"
        "else:\n"
        "    from torch.utils import cpp_extension\n"
    )
    env = {**os.environ, "CUDA_HOME": os.path.dirname(__file__)}  # any folder that exists
    runs = {
        how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, env=env, timeout=300)
        for how in ("plain", "gactx")
    }
    assert all(done.returncode == 0 for done in runs.values()), {k: v.stderr for k, v in runs.items()}
    assert "No CUDA runtime is found" in runs["plain"].stderr  # what torch logs, so that the check below means it
    assert "No CUDA runtime" not in runs["gactx"].stderr


def test_the_first_build_says_why_the_first_step_waits(tmp_path, monkeypatch, capsys):
    """Building the extension takes about a minute, once a machine and torch: the first build says so on stderr, and a
    process that finds it built says nothing."""
    from types import SimpleNamespace

    folder = tmp_path / "built"
    folder.mkdir()
    fake = SimpleNamespace(_get_build_directory=lambda name, verbose: str(folder), load=lambda name, *a, **k: name)
    monkeypatch.setattr(cpu, "_cpp_extension", lambda: fake)
    assert cpu._build() == cpu._name()
    assert "gactx: building its C++ CPU kernels, once for this machine and torch" in capsys.readouterr().err
    (folder / f"{cpu._name()}.so").write_bytes(b"")
    assert cpu._build() == cpu._name()
    assert capsys.readouterr().err == ""
