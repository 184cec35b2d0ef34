"""gactx/kernels/_grid.py: one launch covers every element once, whole programs unmasked, the rest masked."""

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gactx.kernels._grid import plan
from gactx.kernels.codes import encode_codes
from gactx.kernels.schemes.normal import torch_normal_dequantize, torch_normal_quantize
from gactx.kernels.schemes.uniform.reference import torch_dequantize, torch_quantize


@given(n=st.integers(0, 10**7), block=st.sampled_from([32, 4096, 8192, 1 << 16]), split=st.sampled_from([1, 2, 4]))
def test_a_launch_covers_each_element_once_and_masks_only_the_rest(n, block, split):
    rest_block = max(1, block // split)
    programs, full, rest = plan(n, block, rest_block)
    assert rest == (n % block != 0)
    covered = []  # (start, end, masked) of each program, as a kernel maps its index (schemes/uniform/quantize.py)
    for p in range(programs):
        if p < full:
            covered.append((p * block, (p + 1) * block, False))
        else:
            index = p + full * (block // rest_block) - full  # in programs of the rest's size
            covered.append((index * rest_block, (index + 1) * rest_block, True))
    starts = [start for start, _, _ in covered]
    assert starts == [0, *(end for _, end, _ in covered[:-1])][: len(covered)], "a gap or an overlap between programs"
    assert not covered or (covered[-1][0] < n <= covered[-1][1]), "the last program holds the last element"
    assert all(end <= n for _, end, masked in covered if not masked), "an unmasked program reaches past the end"
    assert all(masked for _, _, masked in covered[full:]), "masked programs come last"


@pytest.mark.parametrize(
    ("n", "expected"),
    [(0, (0, 0, False)), (5, (1, 0, True)), (8192, (1, 1, False)), (3 * 8192 + 2049, (5, 3, True))],
)
def test_plan_examples(n, expected):
    assert plan(n, 8192, 2048) == expected


class _Counting:
    """A Triton kernel whose launches are counted."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def __getattr__(self, name):  # the kernel's signature, for a direct launch (_triton.launch)
        return getattr(self.kernel, name)


def _round_trips(n: int, device: str) -> dict:
    """Each kernel family's launcher on ``n`` elements, with the GPU's programs (``interpret=False``), and what its
    torch twin gives: ``family -> (kernel module, kernel name, run)``."""
    bitmask, dequantize, half, normal, quantize, tables = (
        importlib.import_module(f"gactx.kernels.{m}")
        for m in ("bitmask", "schemes.uniform.dequantize", "half", "schemes.normal.triton", "schemes.uniform.quantize",
                  "tables")
    )  # the modules: gactx.kernels exports functions of some of these names  # fmt: skip

    x = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 3).to(device)
    mask = x > 0
    codes, meta = torch_quantize(x, 4, 256, False, 0)
    ncodes, nmeta = torch_normal_quantize(x, 4, 256, False, 0)
    packed = bitmask.torch_pack_bool(mask)
    edges = torch.linspace(-2, 2, 15, device=device)
    bins = torch.bucketize(x, edges)
    table = torch.randn(16, generator=torch.Generator().manual_seed(2)).to(device)
    binned = encode_codes(bins, 4, table, backend="torch").codes
    return {
        "quantize": (quantize, "_quantize_kernel",
                     lambda: quantize.triton_quantize(x, 4, 256, False, 0, interpret=False), (codes, meta)),
        "dequantize": (dequantize, "_dequantize_kernel",
                       lambda: dequantize.triton_dequantize(codes, meta, 4, 256, n, torch.float32, interpret=False),
                       torch_dequantize(codes, meta, 4, 256, n, torch.float32)),
        "normal_quantize": (normal, "_normal_quantize_kernel",
                            lambda: normal.triton_normal_quantize(x, 4, 256, False, 0, interpret=False),
                            (ncodes, nmeta)),
        "normal_dequantize": (normal, "_normal_dequantize_kernel",
                              lambda: normal.triton_normal_dequantize(ncodes, nmeta, 4, 256, n, torch.float32,
                                                                      interpret=False),
                              torch_normal_dequantize(ncodes, nmeta, 4, 256, n, torch.float32)),
        # Stochastic: round to nearest is the hardware conversion when compiled, which the interpreter does not run.
        "round_bf16": (half, "_round_bf16_kernel", lambda: half.triton_round_bf16(x, True, 9, interpret=False),
                       _neighbours(x)),
        "pack_bool": (bitmask, "_pack_bool_kernel", lambda: bitmask.triton_pack_bool(mask, interpret=False), packed),
        "unpack_bool": (bitmask, "_unpack_bool_kernel", lambda: bitmask.triton_unpack_bool(packed, n, interpret=False),
                        mask),
        "encode_bins": (tables, "_encode_bins_kernel", lambda: tables.triton_encode_bins(x, edges, 4, interpret=False),
                        binned),
        "encode_compare": (tables, "_encode_compare_kernel",
                           lambda: tables.triton_encode_compare(x, "gt", 0.0, 0.0, interpret=False), packed),
        "decode_table": (tables, "_decode_table_kernel",
                         lambda: tables.triton_decode_table(binned, table, n, 4, interpret=False), table[bins]),
    }  # fmt: skip


def _neighbours(x: torch.Tensor):
    """A check that each element of a bfloat16 rounding of ``x`` is one of its two neighbours, not all the lower."""

    def check(y: torch.Tensor) -> None:
        y = y.float()
        down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
        up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
        assert ((y == down) | (y == up)).all()
        assert (y == up).any(), "every element rounded down: a program skipped"

    return check


FAMILIES = ["quantize", "dequantize", "normal_quantize", "normal_dequantize", "round_bf16", "pack_bool", "unpack_bool",
            "encode_bins", "encode_compare", "decode_table"]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [2 * 16384 + 2048 + 300, 2 * 16384, 77])  # whole programs and a rest, whole, a rest
def test_one_launch_a_call_with_the_twins_bytes(triton_device, family, n, monkeypatch):
    """Every kernel launches once a call, whether the tensor ends in whole programs or not (the interpreter counts
    the launches of the GPU's programs), and gives its torch twin's bytes."""
    module, name, run, expected = _round_trips(n, triton_device)[family]
    counting = _Counting(getattr(module, name))
    monkeypatch.setattr(module, name, counting)
    got = run()
    assert counting.launches == 1
    if callable(expected):
        expected(got)
        return
    got, expected = (v if isinstance(v, tuple) else (v,) for v in (got, expected))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), family
