"""The uniform scheme's Triton dequantize: ``_dequantize_kernel`` and ``triton_dequantize`` (how codes decode, at the
edges of the range too: ``format.py``; the twin: ``reference.py``).
"""

from __future__ import annotations

import torch

from gactx.kernels._grid import plan
from gactx.kernels._triton import constexpr, jit, launch, tl
from gactx.kernels.half import bf16_bits
from gactx.kernels.schemes.uniform.format import FLT_MAX
from gactx.kernels.schemes.uniform.quantize import NUM_WARPS, program_rows

__all__ = ["decode", "decode_into", "dequantize_launch", "dequantize_into", "triton_dequantize"]

_FLT_MAX = constexpr(FLT_MAX)


@jit(do_not_specialize=["n", "full"])  # one compiled kernel whatever n is (but int32 or int64)
def _dequantize_kernel(
    codes_ptr, meta_ptr, out_ptr, n, full,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, OUT_BF16: tl.constexpr, OUT_MAX: tl.constexpr,
    EMULATE: tl.constexpr, REST: tl.constexpr,
):  # fmt: skip
    """``full`` programs of ``ROWS`` groups, unmasked, then (``REST``) a masked one (``_grid.py``)."""
    if REST:
        if tl.program_id(0) < full:
            _dequantize_program(codes_ptr, meta_ptr, out_ptr, n, BITS, GROUP, ROWS, OUT_BF16, OUT_MAX, EMULATE, False)
        else:
            _dequantize_program(codes_ptr, meta_ptr, out_ptr, n, BITS, GROUP, ROWS, OUT_BF16, OUT_MAX, EMULATE, True)
    else:
        _dequantize_program(codes_ptr, meta_ptr, out_ptr, n, BITS, GROUP, ROWS, OUT_BF16, OUT_MAX, EMULATE, False)


@jit
def _dequantize_program(
    codes_ptr, meta_ptr, out_ptr, n,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, OUT_BF16: tl.constexpr, OUT_MAX: tl.constexpr,
    EMULATE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    CENTRE: tl.constexpr = (LEVELS - 1) // 2
    PLANES: tl.constexpr = 8 // BITS  # codes a byte
    WIDTH: tl.constexpr = GROUP // PLANES  # elements a plane, bytes a group
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    boffs = rows[:, None] * WIDTH + tl.arange(0, WIDTH).to(tl.int64)[None, :]
    if MASKED:
        in_range = rows < (n + GROUP - 1) // GROUP
        packed = tl.load(codes_ptr + boffs, mask=in_range[:, None], other=0).to(tl.int32)
        lo = tl.load(meta_ptr + rows * 2, mask=in_range, other=0.0)
        step = tl.load(meta_ptr + rows * 2 + 1, mask=in_range, other=0.0)
    else:
        packed = tl.load(codes_ptr + boffs).to(tl.int32)
        lo = tl.load(meta_ptr + rows * 2)
        step = tl.load(meta_ptr + rows * 2 + 1)

    special = (tl.abs(lo) >= float("inf")) | (lo != lo)  # NaN compares false
    base = tl.where(special, 0.0, lo)
    # Halves (1/2, then 2) where q * step can overflow while the value does not; 1 elsewhere (module docstring).
    wide = (base < -1.0) & (LEVELS * step > _FLT_MAX)
    half = tl.where(wide, 0.5, 1.0)
    twice = tl.where(wide, 2.0, 1.0)
    step = step * half
    base = base * half
    top = tl.where(special, lo, tl.minimum(tl.maximum((LEVELS * step + base) * twice, -OUT_MAX), OUT_MAX))[:, None]
    centre = tl.where(special, CENTRE, 0)[:, None]
    base = base[:, None]
    step = step[:, None]
    twice = twice[:, None]
    offs = rows[:, None] * GROUP + tl.arange(0, WIDTH).to(tl.int64)[None, :]
    for p in tl.static_range(PLANES):  # plane p: elements p * WIDTH .. (p + 1) * WIDTH - 1 (format.py)
        q = (packed >> (p * BITS)) & LEVELS
        value = ((q - centre).to(tl.float32) * step + base) * twice
        value = tl.minimum(tl.maximum(value, -OUT_MAX), OUT_MAX)
        value = tl.where(q == LEVELS, top, value)
        if OUT_BF16:  # out_ptr is the int16 view of a bfloat16 tensor
            value = bf16_bits(value, EMULATE)
        else:
            value = value.to(out_ptr.dtype.element_ty)
        if MASKED:
            tl.store(out_ptr + offs + p * WIDTH, value, mask=offs + p * WIDTH < n)
        else:
            tl.store(out_ptr + offs + p * WIDTH, value)


def dequantize_launch(
    n: int, dtype: torch.dtype, bits: int, group_size: int, interpret: bool = False
) -> tuple[int, int, dict]:
    """``(programs, full, meta-parameters)`` of the launch of ``_dequantize_kernel`` for ``n`` elements of ``dtype``
    (``_grid.plan``; the programs of quantize), for :func:`triton_dequantize` and for ``aot.py``."""
    rows = program_rows(group_size, bits, dtype.itemsize, interpret)
    programs, full, rest = plan(n, rows * group_size)
    meta = dict(
        BITS=bits, GROUP=group_size, ROWS=rows, OUT_BF16=dtype == torch.bfloat16, OUT_MAX=torch.finfo(dtype).max,
        EMULATE=interpret, REST=rest, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return programs, full, meta


def triton_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype,
    interpret: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Decode ``n`` elements from ``(codes, meta)`` into a new contiguous 1-D tensor of ``dtype``."""
    return decode(_dequantize_kernel, dequantize_launch, codes, meta, bits, group_size, n, dtype, interpret)


def decode(kernel, launcher, codes, meta, bits: int, group_size: int, n: int, dtype: torch.dtype, interpret: bool):
    """``kernel`` (a scheme's dequantize, launched as ``launcher`` says) decoding ``n`` elements from ``(codes, meta)``
    into a new contiguous 1-D tensor of ``dtype``: the output, bfloat16 as its int16 bits, and one launch."""
    out = torch.empty(n, dtype=dtype, device=codes.device)
    if n == 0:
        return out
    decode_into(kernel, codes, meta, out, launcher(n, dtype, bits, group_size, interpret))
    return out


def decode_into(kernel, codes: torch.Tensor, meta: torch.Tensor, out: torch.Tensor, planned: tuple) -> None:
    """The one launch of ``kernel`` decoding ``(codes, meta)`` into ``out`` (contiguous, of any shape; bfloat16 written
    as its int16 bits), as its launcher ``planned`` it for ``out``'s number of elements and dtype."""
    programs, full, options = planned
    target = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    launch(kernel, programs, codes, meta, target, out.numel(), full, **options)


def dequantize_into(codes: torch.Tensor, meta: torch.Tensor, out: torch.Tensor, planned: tuple) -> None:
    """The uniform scheme's :func:`decode_into`: ``_dequantize_kernel`` as :func:`dequantize_launch` ``planned`` it."""
    decode_into(_dequantize_kernel, codes, meta, out, planned)
