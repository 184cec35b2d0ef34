"""16-bit storage of float32: ``_round_bf16_kernel``, ``triton_round_bf16``, ``torch_round_bf16``.

bfloat16 keeps float32's exponent range, so nothing overflows (float16 would turn 7e4 into inf). It keeps
the top 16 bits of the float32 pattern; stochastic rounding adds a uniform 16-bit integer to the pattern
before truncation, which rounds the magnitude up with probability equal to the dropped fraction, so the
expected value is x::

    float32  [ s | exponent (8) | mantissa hi (7) | mantissa lo (16) ]
                                                   ^ + r, r ~ U{0 .. 65535}, then keep the top 16 bits

Finite values that would round up to inf are truncated instead; NaN stays NaN, +-Inf stays +-Inf.
With ``stochastic=False`` it is the usual round-to-nearest-even conversion.
"""

from __future__ import annotations

import torch

from gactx.kernels._triton import jit, tl, triton

__all__ = ["bf16_bits_rne", "bf16_bits_to_float", "triton_round_bf16", "torch_round_bf16"]

BLOCK = 4096  # elements a program: 16 KiB read, 8 KiB written
INTERPRET_BLOCK = 1 << 16


@jit
def bf16_bits_rne(x):
    """float32 -> bfloat16 bit pattern (int16), round to nearest even, NaN kept NaN.

    Done on the bits because the interpreter's own fp32 -> bf16 cast truncates, while CUDA and torch round
    to nearest even: spelling it out makes both backends agree to the bit everywhere.
    """
    pattern = x.to(tl.int32, bitcast=True)
    rounded = (pattern + 0x7FFF + ((pattern >> 16) & 1)) >> 16
    quiet_nan = (pattern >> 16) | 0x40  # keep sign and exponent, set the quiet bit
    return tl.where(x != x, quiet_nan, rounded).to(tl.int16)


@jit
def bf16_bits_to_float(bits):
    """bfloat16 bit pattern (int16) -> float32, exactly (subnormals too; the interpreter's cast flushes them)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@jit
def _round_bf16_kernel(x_ptr, out_ptr, n, seed, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = offs < n
    x = tl.load(x_ptr + offs, mask=valid, other=0.0)
    if STOCHASTIC:
        zero = tl.zeros_like(offs).to(tl.uint32)
        r, _, _, _ = tl.philox(seed, offs.to(tl.uint32), (offs >> 32).to(tl.uint32), zero, zero)
        pattern = x.to(tl.int32, bitcast=True)
        up = (pattern + (r & 0xFFFF).to(tl.int32)) >> 16
        down = pattern >> 16
        # Rounding up must not turn a finite value into inf (exponent field all ones).
        keep_up = ((up & 0x7F80) != 0x7F80) | (tl.abs(x) >= float("inf"))
        half = tl.where(keep_up, up, down).to(tl.int16)
        half = tl.where(x != x, bf16_bits_rne(x), half)
    else:
        half = bf16_bits_rne(x)
    tl.store(out_ptr + offs, half, mask=valid)


def triton_round_bf16(flat: torch.Tensor, stochastic: bool, seed: int, interpret: bool = False) -> torch.Tensor:
    """Round a contiguous 1-D float32 tensor to bfloat16."""
    out = torch.empty(flat.numel(), dtype=torch.bfloat16, device=flat.device)
    if flat.numel():
        block = min(INTERPRET_BLOCK if interpret else BLOCK, triton.next_power_of_2(flat.numel()))
        grid = (triton.cdiv(flat.numel(), block),)
        _round_bf16_kernel[grid](flat, out.view(torch.int16), flat.numel(), seed, STOCHASTIC=stochastic, BLOCK=block)
    return out


def torch_round_bf16(flat: torch.Tensor, stochastic: bool, seed: int) -> torch.Tensor:
    """The reference and CPU path of :func:`triton_round_bf16`."""
    if not stochastic:
        return flat.to(torch.bfloat16)
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    r = torch.randint(0, 1 << 16, flat.shape, generator=gen, device=flat.device, dtype=torch.int32)
    pattern = flat.view(torch.int32)
    up = (pattern + r) >> 16
    down = pattern >> 16
    keep_up = ((up & 0x7F80) != 0x7F80) | flat.isinf()
    half = torch.where(keep_up, up, down).to(torch.int16).view(torch.bfloat16)
    return torch.where(flat.isnan(), flat.to(torch.bfloat16), half)
