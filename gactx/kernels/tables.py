"""Table codes on a GPU, one launch a call: ``_encode_bins_kernel`` (FewBit's bins), ``_encode_compare_kernel``
(a mask's test against its bounds) and ``_decode_table_kernel`` (any code width), with their launchers.

They write and read the format of :mod:`gactx.kernels.codes`: codes in memory order, ``8 / bits`` to a byte,
element ``k`` of a run in bits ``k * bits`` and up; 1-bit codes as :mod:`gactx.kernels.bitmask` packs a bool mask.
Their bytes equal the C++ kernels' (``csrc/codes.cpp``, ``csrc/bitmask.cpp``) and the torch ops' that
:mod:`gactx.kernels.codes` falls back to (``torch.bucketize``, the comparisons, the shifts): the tests compare
them bit for bit. Without them a CUDA tensor's codes took five to seven torch launches a call each way.

- Encoding compares in float32: a float16 or bfloat16 value, its edges and its bounds are exact there. The bin of a
  value is the count of edges that are not ``>=`` it (``torch.bucketize``, ``right=False``; NaN: past the last
  edge). Up to 15 edges it is counted edge by edge (scalar loads, no branch); above, a binary search of
  ``ceil(log2(count + 1))`` steps reads the edges by gathers from a table the caches hold.
- Decoding is a gather from the table: the values are moved as integers of their width, never as floats, so a
  decoded value is the table's bit for bit (NaN payloads, signed zeros, bfloat16 included).
"""

from __future__ import annotations

import torch

from gactx.kernels._grid import plan
from gactx.kernels._triton import constexpr, jit, launch, tl

__all__ = [
    "COMPARE_KINDS",
    "ELEMENTS",
    "encode_bins_launch",
    "decode_table_launch",
    "triton_encode_bins",
    "triton_encode_compare",
    "triton_decode_table",
]

ELEMENTS = 4096  # elements a program: 32 a thread at 4 warps
NUM_WARPS = 4
INTERPRET_ELEMENTS = 1 << 16  # the interpreter runs programs one after another: fewer, larger
COUNTED = constexpr(15)  # up to this many edges a bin is counted edge by edge, above by a binary search
# The tests of a mask against its bounds (``cpu.pack_compare``'s kinds, in its order).
COMPARE_KINDS = {"gt": 0, "open": 1, "outside": 2, "closed": 3, "ge": 4, "le": 5}
# Pointer types by width: values moved, not computed with (decoding), or read as their float type (encoding).
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _launch(n: int, bits: int, interpret: bool) -> tuple[int, int, dict]:
    elements = INTERPRET_ELEMENTS if interpret else ELEMENTS
    programs, full, rest = plan(n, elements)
    return programs, full, dict(BITS=bits, BLOCK=elements * bits // 8, REST=rest, num_warps=NUM_WARPS)


def encode_bins_launch(n: int, bits: int, count: int, dtype: torch.dtype, interpret: bool = False):
    """``(programs, full, meta-parameters)`` of the bins' encoding of ``n`` elements among ``count`` edges."""
    programs, full, meta = _launch(n, bits, interpret)
    return programs, full, meta | dict(COUNT=count, STEPS=count.bit_length(), BF16=dtype == torch.bfloat16)


def encode_compare_launch(n: int, kind: str, dtype: torch.dtype, interpret: bool = False):
    """``(programs, full, meta-parameters)`` of the test of ``n`` elements against their bounds (1-bit codes)."""
    programs, full, meta = _launch(n, 1, interpret)
    return programs, full, meta | dict(KIND=COMPARE_KINDS[kind], BF16=dtype == torch.bfloat16)


def decode_table_launch(n: int, bits: int, interpret: bool = False):
    """``(programs, full, meta-parameters)`` of the decoding of ``n`` codes of ``bits``."""
    return _launch(n, bits, interpret)


@jit
def _as_float(v, BF16: tl.constexpr):
    """A loaded value in float32: bfloat16 comes as its int16 bits (the interpreter has no bfloat16 math)."""
    if BF16:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@jit
def _left(n, pid, ELEMENTS: tl.constexpr):
    """The elements from a program's first to ``n``, at most ``ELEMENTS``, as int32: a masked program's elements are
    tested against it, not their int64 offsets against ``n`` (two instructions and two registers an element more;
    with them ptxas spilled in the masked programs of decoding and of the 8-bit bins under Triton 3.7.1)."""
    return tl.minimum(n - pid * ELEMENTS, ELEMENTS).to(tl.int32)


@jit
def _store_codes(out_ptr, q, pid, left, BITS: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Pack a program's codes (``BLOCK * 8 / BITS`` of them, int32, 0 past ``left``, :func:`_left`) into its
    ``BLOCK`` bytes."""
    per_byte: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, per_byte) * BITS
    packed = tl.sum(tl.reshape(q, (BLOCK, per_byte)) << shifts[None, :], axis=1).to(tl.uint8)
    boffs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    if MASKED:
        tl.store(out_ptr + boffs, packed, mask=tl.arange(0, BLOCK) < (left + per_byte - 1) // per_byte)
    else:
        tl.store(out_ptr + boffs, packed)


@jit(do_not_specialize=["n", "full"])
def _encode_bins_kernel(
    x_ptr, edges_ptr, out_ptr, n, full, BITS: tl.constexpr, COUNT: tl.constexpr, STEPS: tl.constexpr,
    BF16: tl.constexpr, BLOCK: tl.constexpr, REST: tl.constexpr,
):  # fmt: skip
    """``full`` programs of ``BLOCK`` bytes, unmasked, then (``REST``) a masked one (``_grid.py``)."""
    if REST:
        if tl.program_id(0) < full:
            _encode_bins_program(x_ptr, edges_ptr, out_ptr, n, BITS, COUNT, STEPS, BF16, BLOCK, False)
        else:
            _encode_bins_program(x_ptr, edges_ptr, out_ptr, n, BITS, COUNT, STEPS, BF16, BLOCK, True)
    else:
        _encode_bins_program(x_ptr, edges_ptr, out_ptr, n, BITS, COUNT, STEPS, BF16, BLOCK, False)


@jit
def _encode_bins_program(
    x_ptr, edges_ptr, out_ptr, n, BITS: tl.constexpr, COUNT: tl.constexpr, STEPS: tl.constexpr, BF16: tl.constexpr,
    BLOCK: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    elements: tl.constexpr = BLOCK * 8 // BITS
    offs = pid * elements + tl.arange(0, elements).to(tl.int64)
    left = _left(n, pid, elements)
    if MASKED:
        v = _as_float(tl.load(x_ptr + offs, mask=tl.arange(0, elements) < left, other=0), BF16)
    else:
        v = _as_float(tl.load(x_ptr + offs), BF16)
    if COUNT <= COUNTED:
        q = tl.zeros((elements,), tl.int32)
        for j in tl.static_range(COUNT):
            edge = _as_float(tl.load(edges_ptr + j), BF16)
            q += (~(edge >= v)).to(tl.int32)
    else:  # lower bound: lo is the first edge >= v, COUNT where none is (NaN)
        lo = tl.zeros((elements,), tl.int32)
        hi = tl.full((elements,), COUNT, tl.int32)
        for _ in tl.static_range(STEPS):
            active = lo < hi
            mid = (lo + hi) >> 1
            edge = _as_float(tl.load(edges_ptr + mid, mask=active, other=0), BF16)
            above = edge >= v
            lo = tl.where(active & ~above, mid + 1, lo)
            hi = tl.where(active & above, mid, hi)
        q = lo
    if MASKED:
        q = tl.where(tl.arange(0, elements) < left, q, 0)
    _store_codes(out_ptr, q, pid, left, BITS, BLOCK, MASKED)


@jit(do_not_specialize=["n", "full"])
def _encode_compare_kernel(
    x_ptr, out_ptr, n, full, lo, hi, KIND: tl.constexpr, BF16: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    REST: tl.constexpr,
):  # fmt: skip
    """``full`` programs of ``BLOCK`` bytes, unmasked, then (``REST``) a masked one (``_grid.py``)."""
    if REST:
        if tl.program_id(0) < full:
            _encode_compare_program(x_ptr, out_ptr, n, lo, hi, KIND, BF16, BITS, BLOCK, False)
        else:
            _encode_compare_program(x_ptr, out_ptr, n, lo, hi, KIND, BF16, BITS, BLOCK, True)
    else:
        _encode_compare_program(x_ptr, out_ptr, n, lo, hi, KIND, BF16, BITS, BLOCK, False)


@jit
def _encode_compare_program(
    x_ptr, out_ptr, n, lo, hi, KIND: tl.constexpr, BF16: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    elements: tl.constexpr = BLOCK * 8
    offs = pid * elements + tl.arange(0, elements).to(tl.int64)
    left = _left(n, pid, elements)
    if MASKED:
        v = _as_float(tl.load(x_ptr + offs, mask=tl.arange(0, elements) < left, other=0), BF16)
    else:
        v = _as_float(tl.load(x_ptr + offs), BF16)
    if KIND == 0:  # gt
        test = v > lo
    elif KIND == 1:  # open
        test = (v > lo) & (v < hi)
    elif KIND == 2:  # outside: not lo <= v <= hi (NaN is outside)
        test = ~((v >= lo) & (v <= hi))
    elif KIND == 3:  # closed
        test = (v >= lo) & (v <= hi)
    elif KIND == 4:  # ge
        test = v >= lo
    else:  # le
        test = v <= hi
    q = test.to(tl.int32)
    if MASKED:
        q = tl.where(tl.arange(0, elements) < left, q, 0)
    _store_codes(out_ptr, q, pid, left, BITS, BLOCK, MASKED)


@jit(do_not_specialize=["n", "full"])
def _decode_table_kernel(
    packed_ptr, table_ptr, out_ptr, n, full, BITS: tl.constexpr, BLOCK: tl.constexpr, REST: tl.constexpr
):
    """``full`` programs of ``BLOCK`` bytes, unmasked, then (``REST``) a masked one (``_grid.py``)."""
    if REST:
        if tl.program_id(0) < full:
            _decode_table_program(packed_ptr, table_ptr, out_ptr, n, BITS, BLOCK, False)
        else:
            _decode_table_program(packed_ptr, table_ptr, out_ptr, n, BITS, BLOCK, True)
    else:
        _decode_table_program(packed_ptr, table_ptr, out_ptr, n, BITS, BLOCK, False)


@jit
def _decode_table_program(packed_ptr, table_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr,
                          MASKED: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    per_byte: tl.constexpr = 8 // BITS
    boffs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    left = _left(n, pid, BLOCK * per_byte)
    if MASKED:
        packed = tl.load(packed_ptr + boffs, mask=tl.arange(0, BLOCK) < (left + per_byte - 1) // per_byte, other=0)
        packed = packed.to(tl.int32)
    else:
        packed = tl.load(packed_ptr + boffs).to(tl.int32)
    shifts = tl.arange(0, per_byte) * BITS
    codes = tl.reshape((packed[:, None] >> shifts[None, :]) & ((1 << BITS) - 1), (BLOCK * per_byte,))
    values = tl.load(table_ptr + codes)
    offs = pid * BLOCK * per_byte + tl.arange(0, BLOCK * per_byte).to(tl.int64)
    if MASKED:
        tl.store(out_ptr + offs, values, mask=tl.arange(0, BLOCK * per_byte) < left)
    else:
        tl.store(out_ptr + offs, values)


def _as_loaded(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def triton_encode_bins(flat: torch.Tensor, edges: torch.Tensor, bits: int, interpret: bool = False) -> torch.Tensor:
    """The ``bits``-bit codes of a contiguous 1-D float tensor's bins among ``edges`` (sorted, its dtype), packed."""
    n = flat.numel()
    per_byte = 8 // bits
    out = torch.empty(-(-n // per_byte), dtype=torch.uint8, device=flat.device)
    if n:
        edges = _as_loaded(edges.to(flat.dtype).contiguous())
        programs, full, meta = encode_bins_launch(n, bits, edges.numel(), flat.dtype, interpret)
        launch(_encode_bins_kernel, programs, _as_loaded(flat), edges, out, n, full, **meta)
    return out


def triton_encode_compare(flat: torch.Tensor, kind: str, lo: float, hi: float, interpret: bool = False):
    """A contiguous 1-D float tensor's test against its bounds (``COMPARE_KINDS``, as ``cpu.pack_compare``), packed
    as a bool mask is (:mod:`gactx.kernels.bitmask`)."""
    n = flat.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8, device=flat.device)
    if n:
        programs, full, meta = encode_compare_launch(n, kind, flat.dtype, interpret)
        launch(_encode_compare_kernel, programs, _as_loaded(flat), out, n, full, float(lo), float(hi), **meta)
    return out


def triton_decode_table(packed: torch.Tensor, table: torch.Tensor, n: int, bits: int, interpret: bool = False):
    """``table[codes]`` of ``n`` codes of ``bits`` packed in ``packed``: a new contiguous 1-D tensor of the table's
    dtype."""
    out = torch.empty(n, dtype=table.dtype, device=packed.device)
    if n:
        as_int = _AS_INT[table.element_size()]
        programs, full, meta = decode_table_launch(n, bits, interpret)
        values = table.contiguous().view(as_int)
        launch(_decode_table_kernel, programs, packed, values, out.view(as_int), n, full, **meta)
    return out
