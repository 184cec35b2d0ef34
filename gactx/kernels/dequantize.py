"""Unpack and dequantize 1/2/4/8-bit codes: ``_dequantize_kernel``, ``triton_dequantize``, ``torch_dequantize``.

A code ``q`` of a group with finite ``lo`` decodes to ``q * step + lo``. A group with non-finite ``lo``
(it held NaN or +-Inf, see ``format.py``) decodes its top code to ``lo`` and the others to
``(q - (2**bits - 2) // 2) * step``. Decoded finite values are clamped to +-FLT_MAX (the step's margin
could carry a group that reaches FLT_MAX past it). The result is cast to the output dtype (round to
nearest even).
"""

from __future__ import annotations

import torch

from gactx.kernels._triton import jit, tl, triton
from gactx.kernels.half import bf16_bits_rne
from gactx.kernels.quantize import FLT_MAX, launch_config

__all__ = ["triton_dequantize", "torch_dequantize"]


@jit
def _dequantize_kernel(
    codes_ptr,
    meta_ptr,
    out_ptr,
    n,
    n_bytes,
    n_groups,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PER_BYTE: tl.constexpr = 8 // BITS
    GROUP_BYTES: tl.constexpr = GROUP // PER_BYTE
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    boffs = rows[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES).to(tl.int64)[None, :]
    packed = tl.load(codes_ptr + boffs, mask=boffs < n_bytes, other=0).to(tl.int32)
    shifts = tl.arange(0, PER_BYTE) * BITS
    q = (packed[:, :, None] >> shifts[None, None, :]) & LEVELS
    q = tl.reshape(q, (ROWS, GROUP)).to(tl.float32)

    in_range = rows < n_groups
    lo = tl.load(meta_ptr + rows * 2, mask=in_range, other=0.0)[:, None]
    step = tl.load(meta_ptr + rows * 2 + 1, mask=in_range, other=0.0)[:, None]
    special = (tl.abs(lo) >= float("inf")) | (lo != lo)  # NaN compares false
    centre: tl.constexpr = (LEVELS - 1) // 2
    # The step margin may carry a group whose max is near FLT_MAX past it: clamp, never make inf.
    value = tl.where(special, (q - centre) * step, q * step + lo)
    value = tl.minimum(tl.maximum(value, -FLT_MAX), FLT_MAX)
    value = tl.where(special & (q == LEVELS), lo, value)

    offs = rows[:, None] * GROUP + tl.arange(0, GROUP).to(tl.int64)[None, :]
    if OUT_BF16:  # out_ptr is the int16 view of a bfloat16 tensor
        tl.store(out_ptr + offs, bf16_bits_rne(value), mask=offs < n)
    else:
        tl.store(out_ptr + offs, value.to(out_ptr.dtype.element_ty), mask=offs < n)


def triton_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype,
    interpret: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Decode ``n`` elements from ``(codes, meta)`` into a new contiguous 1-D tensor of ``dtype``."""
    out = torch.empty(n, dtype=dtype, device=codes.device)
    n_groups = meta.shape[0]
    if n_groups == 0:
        return out
    rows, num_warps = launch_config(n_groups, group_size, interpret)
    grid = (triton.cdiv(n_groups, rows),)
    out_bf16 = dtype == torch.bfloat16
    _dequantize_kernel[grid](
        codes, meta, out.view(torch.int16) if out_bf16 else out, n, codes.numel(), n_groups,
        BITS=bits, GROUP=group_size, ROWS=rows, OUT_BF16=out_bf16, num_warps=num_warps,
    )  # fmt: skip
    return out


def torch_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """The reference and CPU path of :func:`triton_dequantize`: same contract, same arithmetic."""
    n_groups = meta.shape[0]
    if n_groups == 0:
        return torch.empty(n, dtype=dtype, device=codes.device)
    levels, per_byte = (1 << bits) - 1, 8 // bits
    group_bytes = group_size // per_byte
    padded = torch.zeros(n_groups * group_bytes, dtype=torch.int32, device=codes.device)
    padded[: codes.numel()] = codes
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    q = ((padded.view(n_groups, group_bytes, 1) >> shifts) & levels).view(n_groups, group_size).float()

    lo, step = meta[:, 0:1], meta[:, 1:2]
    special = ~torch.isfinite(lo)
    value = torch.where(special, (q - (levels - 1) // 2) * step, q * step + lo).clamp(-FLT_MAX, FLT_MAX)
    value = torch.where(special & (q == levels), lo, value)
    return value.view(-1)[:n].to(dtype)
