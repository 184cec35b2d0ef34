"""Lossless 1-bit packing of bool masks: ``_pack_bool_kernel`` / ``_unpack_bool_kernel``, their launchers
``triton_pack_bool`` / ``triton_unpack_bool`` and torch twins ``torch_pack_bool`` / ``torch_unpack_bool``.

Dropout and ReLU-style masks are saved as bool (one byte an element); packed they take one bit::

    byte k:  bit  7    6    5    4    3    2    1    0
               [ m7 | m6 | m5 | m4 | m3 | m2 | m1 | m0 ]    m_i = mask[8k + i]
"""

from __future__ import annotations

import torch

from gactx.kernels._triton import jit, tl, triton

__all__ = ["triton_pack_bool", "triton_unpack_bool", "torch_pack_bool", "torch_unpack_bool"]

# Bytes a program writes: 2048 bytes cover 16384 mask elements, about 4 KiB of traffic at 4 warps.
BYTES_PER_PROGRAM = 2048
INTERPRET_BYTES_PER_PROGRAM = 1 << 15


def _grid(n_bytes: int, interpret: bool) -> tuple[int, tuple[int]]:
    block = min(INTERPRET_BYTES_PER_PROGRAM if interpret else BYTES_PER_PROGRAM, triton.next_power_of_2(n_bytes))
    return block, (triton.cdiv(n_bytes, block),)


@jit
def _pack_bool_kernel(mask_ptr, out_ptr, n, n_bytes, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK * 8 + tl.arange(0, BLOCK * 8).to(tl.int64)
    m = tl.load(mask_ptr + offs, mask=offs < n, other=0).to(tl.int32)
    m = tl.reshape(m, (BLOCK, 8))
    packed = tl.sum(m << tl.arange(0, 8)[None, :], axis=1)
    boffs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    tl.store(out_ptr + boffs, packed.to(tl.uint8), mask=boffs < n_bytes)


@jit
def _unpack_bool_kernel(packed_ptr, out_ptr, n, n_bytes, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    boffs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    packed = tl.load(packed_ptr + boffs, mask=boffs < n_bytes, other=0).to(tl.int32)
    m = (packed[:, None] >> tl.arange(0, 8)[None, :]) & 1
    m = tl.reshape(m, (BLOCK * 8,))
    offs = pid * BLOCK * 8 + tl.arange(0, BLOCK * 8).to(tl.int64)
    tl.store(out_ptr + offs, m.to(tl.uint8), mask=offs < n)


def triton_pack_bool(flat: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """Pack a contiguous 1-D bool tensor into ``ceil(n / 8)`` bytes."""
    n = flat.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8, device=flat.device)
    if n:
        block, grid = _grid(out.numel(), interpret)
        _pack_bool_kernel[grid](flat.view(torch.uint8), out, n, out.numel(), BLOCK=block)
    return out


def triton_unpack_bool(packed: torch.Tensor, n: int, interpret: bool = False) -> torch.Tensor:
    """Unpack ``n`` bools from ``packed`` into a new contiguous 1-D bool tensor."""
    out = torch.empty(n, dtype=torch.bool, device=packed.device)
    if n:
        block, grid = _grid(packed.numel(), interpret)
        _unpack_bool_kernel[grid](packed, out.view(torch.uint8), n, packed.numel(), BLOCK=block)
    return out


def torch_pack_bool(flat: torch.Tensor) -> torch.Tensor:
    """The reference and CPU path of :func:`triton_pack_bool`."""
    n = flat.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=flat.device)
    padded[:n] = flat.view(torch.uint8)
    shifts = torch.arange(8, device=flat.device, dtype=torch.uint8)
    return (padded.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


def torch_unpack_bool(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The reference and CPU path of :func:`triton_unpack_bool`."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()
