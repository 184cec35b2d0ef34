"""Unpack and dequantize 1/2/4/8-bit codes: ``_dequantize_kernel``, ``triton_dequantize``, ``torch_dequantize``.

A code ``q`` of a group with finite ``lo`` decodes to ``q * step + lo``. A group with non-finite ``lo``
(it held NaN or +-Inf, see ``format.py``) decodes its top code to ``lo`` and the others to
``(q - (2**bits - 2) // 2) * step``. The result is cast to the output dtype (round to nearest even). Both
implementations round the product and the sum separately (the kernel is compiled with
``enable_fp_fusion=False``), so they decode to identical bits.

At the edges of the range:

- Where ``L * step`` overflows float32 and ``lo < -1`` (a group spanning more than FLT_MAX, or within the margin
  of it), ``q * step`` can overflow while ``q * step + lo`` does not: there the value is computed on halves,
  ``(q * (step / 2) + lo / 2) * 2`` (every factor and sum exact or rounded as before: the same value wherever
  the plain form is finite). Where ``lo >= -1`` an overflowing product means a value past FLT_MAX anyway, and
  halving a subnormal ``lo`` would round it: those groups, and all others, use the plain form.
- Decoded finite values saturate at the output dtype's largest finite value (FLT_MAX, 65504 for float16,
  about 3.3895e38 for bfloat16): the step's margin can carry a group that reaches that value past it, and a
  16-bit cast rounds a value a hair beyond it to inf. A finite input never comes back as inf.
"""

from __future__ import annotations

import torch

from gactx.kernels._grid import plan
from gactx.kernels._triton import constexpr, jit, tl
from gactx.kernels.half import bf16_bits
from gactx.kernels.quantize import FLT_MAX, NUM_WARPS, program_rows

__all__ = ["triton_dequantize", "torch_dequantize", "dequantize_launch"]

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
    out = torch.empty(n, dtype=dtype, device=codes.device)
    if n == 0:
        return out
    target = out.view(torch.int16) if dtype == torch.bfloat16 else out
    programs, full, launch = dequantize_launch(n, dtype, bits, group_size, interpret)
    _dequantize_kernel[(programs,)](codes, meta, target, n, full, **launch)
    return out


def torch_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """The reference and CPU path of :func:`triton_dequantize`: same contract, same arithmetic."""
    n_groups = meta.shape[0]
    if n_groups == 0:
        return torch.empty(n, dtype=dtype, device=codes.device)
    levels, per_byte = (1 << bits) - 1, 8 // bits
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32)[:, None] * bits
    planes = codes.view(n_groups, 1, group_size // per_byte).to(torch.int32) >> shifts  # see format.py
    q = (planes & levels).view(n_groups, group_size)

    lo, step = meta[:, 0:1], meta[:, 1:2]
    special = ~torch.isfinite(lo)
    base = torch.where(special, 0.0, lo)
    wide = (base < -1) & (levels * step > FLT_MAX)  # see the module docstring
    half, twice = torch.where(wide, 0.5, 1.0), torch.where(wide, 2.0, 1.0)
    step, base = step * half, base * half
    centre = torch.where(special, (levels - 1) // 2, 0)
    out_max = torch.finfo(dtype).max  # the output's largest finite value: finite values saturate there
    top = torch.where(special, lo, ((levels * step + base) * twice).clamp(-out_max, out_max))
    value = (((q - centre).float() * step + base) * twice).clamp(-out_max, out_max)
    value = torch.where(q == levels, top, value)
    return value.view(-1)[:n].to(dtype)
