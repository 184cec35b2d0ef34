"""Lossless 1-bit packing of bool masks: ``_pack_bool_kernel`` / ``_unpack_bool_kernel``, their launchers
``triton_pack_bool`` / ``triton_unpack_bool`` and torch twins ``torch_pack_bool`` / ``torch_unpack_bool``.

Dropout and ReLU-style masks are saved as bool (one byte an element); packed they take one bit::

    byte k:  bit  7    6    5    4    3    2    1    0
               [ m7 | m6 | m5 | m4 | m3 | m2 | m1 | m0 ]    m_i = mask[8k + i]
"""

from __future__ import annotations

import torch

from gactx.kernels._grid import plan
from gactx.kernels._triton import jit, launch, tl

__all__ = ["bitmask_launch", "triton_pack_bool", "triton_unpack_bool", "torch_pack_bool", "torch_unpack_bool"]

# Bytes of packed output a program: 2048 cover 16384 mask elements, 128 a thread at 4 warps: 16-byte loads
# of the mask and 16-byte stores of the packed bits.
BYTES_PER_PROGRAM = 2048
NUM_WARPS = 4
INTERPRET_BYTES_PER_PROGRAM = 1 << 15  # the interpreter runs programs one after another: fewer, larger


def bitmask_launch(n: int, interpret: bool = False) -> tuple[int, int, dict]:
    """``(programs, full, meta-parameters)`` of the launch of the pack or unpack kernel for ``n`` mask elements
    (``_grid.plan``, ``aot.py``)."""
    block = INTERPRET_BYTES_PER_PROGRAM if interpret else BYTES_PER_PROGRAM
    programs, full, rest = plan(n, block * 8)
    return programs, full, dict(BLOCK=block, REST=rest, num_warps=NUM_WARPS)


@jit(do_not_specialize=["n", "full"])
def _pack_bool_kernel(mask_ptr, out_ptr, n, full, BLOCK: tl.constexpr, REST: tl.constexpr):
    """``full`` programs of ``BLOCK`` bytes, unmasked, then (``REST``) a masked one (``_grid.py``)."""
    if REST:
        if tl.program_id(0) < full:
            _pack_bool_program(mask_ptr, out_ptr, n, BLOCK, False)
        else:
            _pack_bool_program(mask_ptr, out_ptr, n, BLOCK, True)
    else:
        _pack_bool_program(mask_ptr, out_ptr, n, BLOCK, False)


@jit
def _pack_bool_program(mask_ptr, out_ptr, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK * 8 + tl.arange(0, BLOCK * 8).to(tl.int64)
    if MASKED:
        m = tl.load(mask_ptr + offs, mask=offs < n, other=0).to(tl.int32)
    else:
        m = tl.load(mask_ptr + offs).to(tl.int32)
    packed = tl.sum(tl.reshape(m, (BLOCK, 8)) << tl.arange(0, 8)[None, :], axis=1).to(tl.uint8)
    boffs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    if MASKED:
        tl.store(out_ptr + boffs, packed, mask=boffs < (n + 7) // 8)
    else:
        tl.store(out_ptr + boffs, packed)


@jit(do_not_specialize=["n", "full"])
def _unpack_bool_kernel(packed_ptr, out_ptr, n, full, BLOCK: tl.constexpr, REST: tl.constexpr):
    """``full`` programs of ``BLOCK`` bytes, unmasked, then (``REST``) a masked one (``_grid.py``)."""
    if REST:
        if tl.program_id(0) < full:
            _unpack_bool_program(packed_ptr, out_ptr, n, BLOCK, False)
        else:
            _unpack_bool_program(packed_ptr, out_ptr, n, BLOCK, True)
    else:
        _unpack_bool_program(packed_ptr, out_ptr, n, BLOCK, False)


@jit
def _unpack_bool_program(packed_ptr, out_ptr, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    boffs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    if MASKED:
        packed = tl.load(packed_ptr + boffs, mask=boffs < (n + 7) // 8, other=0).to(tl.int32)
    else:
        packed = tl.load(packed_ptr + boffs).to(tl.int32)
    m = tl.reshape((packed[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK * 8,)).to(tl.uint8)
    offs = pid * BLOCK * 8 + tl.arange(0, BLOCK * 8).to(tl.int64)
    if MASKED:
        tl.store(out_ptr + offs, m, mask=offs < n)
    else:
        tl.store(out_ptr + offs, m)


def triton_pack_bool(flat: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """Pack a contiguous 1-D bool tensor into ``ceil(n / 8)`` bytes."""
    n = flat.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8, device=flat.device)
    if n:
        programs, full, options = bitmask_launch(n, interpret)
        launch(_pack_bool_kernel, programs, flat.view(torch.uint8), out, n, full, **options)
    return out


def triton_unpack_bool(packed: torch.Tensor, n: int, interpret: bool = False) -> torch.Tensor:
    """Unpack ``n`` bools from ``packed`` into a new contiguous 1-D bool tensor."""
    out = torch.empty(n, dtype=torch.bool, device=packed.device)
    if n:
        programs, full, options = bitmask_launch(n, interpret)
        launch(_unpack_bool_kernel, programs, packed, out.view(torch.uint8), n, full, **options)
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
