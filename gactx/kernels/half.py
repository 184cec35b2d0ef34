"""16-bit storage of float32: ``_round_bf16_kernel``, ``triton_round_bf16``, ``torch_round_bf16``.

bfloat16 keeps float32's exponent range (float16 would turn 7e4 into inf). It keeps the top 16 bits of the
float32 pattern; stochastic rounding adds a uniform 16-bit integer to the pattern before truncation, which
rounds the magnitude up with probability equal to the dropped fraction, so the expected value is x::

    float32  [ s | exponent (8) | mantissa hi (7) | mantissa lo (16) ]
                                                   ^ + r, r ~ U{0 .. 65535}, then keep the top 16 bits

With ``stochastic=False`` it is the usual round-to-nearest-even conversion. Both saturate: a finite value
whose magnitude is above bfloat16's largest finite value, ``BF16_MAX`` (about 3.3895e38; float32 goes on to
FLT_MAX, about 3.4028e38), is stored as +-``BF16_MAX``, never as inf (round to nearest would carry anything
from about 3.3961e38 up to inf; stochastic rounding keeps the magnitude rounded down there, so values above
``BF16_MAX`` are the one place where it is biased, by less than 0.4%). NaN stays NaN, +-Inf stays +-Inf.
"""

from __future__ import annotations

import torch

from gactx.kernels._grid import plan
from gactx.kernels._triton import constexpr, jit, launch, tl
from gactx.kernels.random import ROUNDS, philox

__all__ = ["BF16_MAX", "bf16_bits", "bf16_bits_to_float", "round_bf16_launch", "triton_round_bf16", "torch_round_bf16"]

_ROUNDS = constexpr(ROUNDS)
BF16_MAX = torch.finfo(torch.bfloat16).max  # 0x7F7F: 3.3895313892515355e38, exact in float32
_BF16_MAX = constexpr(BF16_MAX)

# Elements a program: 8192 at 4 warps is 64 a thread, 8 consecutive ones in each of eight slices (128-bit
# loads), and one Philox call (128 random bits) for the 16 random bits of each of eight elements.
ELEMENTS_PER_PROGRAM = 8192
NUM_WARPS = 4
INTERPRET_ELEMENTS_PER_PROGRAM = 1 << 16  # the interpreter runs programs one after another: fewer, larger
SLICES = constexpr(8)


def round_bf16_launch(n: int, stochastic: bool, interpret: bool = False) -> tuple[int, int, dict]:
    """``(programs, full, meta-parameters)`` of the launch of ``_round_bf16_kernel`` (``_grid.plan``, ``aot.py``)."""
    block = INTERPRET_ELEMENTS_PER_PROGRAM if interpret else ELEMENTS_PER_PROGRAM
    programs, full, rest = plan(n, block)
    return programs, full, dict(STOCHASTIC=stochastic, BLOCK=block, EMULATE=interpret, REST=rest, num_warps=NUM_WARPS)


@jit
def bf16_bits(x, EMULATE: tl.constexpr):
    """float32 -> bfloat16 bit pattern (int16), round to nearest even, NaN kept NaN.

    Compiled, the hardware conversion (two elements an instruction on sm_80+). Under the interpreter, whose
    own cast truncates, the same rounding done on the bits, so that both backends agree with torch's cast.
    """
    if EMULATE:
        pattern = x.to(tl.int32, bitcast=True)
        rounded = (pattern + 0x7FFF + ((pattern >> 16) & 1)) >> 16
        quiet_nan = (pattern >> 16) | 0x40  # keep sign and exponent, set the quiet bit
        return tl.where(x != x, quiet_nan, rounded).to(tl.int16)
    return x.to(tl.bfloat16).to(tl.int16, bitcast=True)


@jit
def bf16_bits_to_float(bits):
    """bfloat16 bit pattern (int16) -> float32, exactly (subnormals too; the interpreter's cast flushes them)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@jit
def _saturate_bf16(x):
    """``x`` with finite magnitudes above ``BF16_MAX`` brought down to it (NaN and +-Inf kept): rounded to
    nearest afterwards, a finite value stays finite."""
    return tl.where(tl.abs(x) < float("inf"), tl.minimum(tl.maximum(x, -_BF16_MAX), _BF16_MAX), x)


@jit
def _stochastic_bf16_bits(x, r):
    """bfloat16 bit pattern of ``x`` rounded up with probability (dropped bits) / 2**16, ``r ~ U{0 .. 65535}``."""
    pattern = x.to(tl.int32, bitcast=True)
    up = (pattern + r) >> 16
    # Rounding up must not turn a finite value into inf (exponent field all ones); NaN stays NaN.
    keep_up = ((up & 0x7F80) != 0x7F80) | (tl.abs(x) >= float("inf"))
    half = tl.where(keep_up, up, pattern >> 16)
    return tl.where(x != x, (pattern >> 16) | 0x40, half).to(tl.int16)


@jit(do_not_specialize=["n", "seed", "full"])
def _round_bf16_kernel(x_ptr, out_ptr, n, seed, full, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr,
                       EMULATE: tl.constexpr, REST: tl.constexpr):  # fmt: skip
    """``full`` programs of ``BLOCK`` elements, unmasked, then (``REST``) a masked one (``_grid.py``)."""
    if REST:
        if tl.program_id(0) < full:
            _round_bf16_program(x_ptr, out_ptr, n, seed, STOCHASTIC, BLOCK, EMULATE, False)
        else:
            _round_bf16_program(x_ptr, out_ptr, n, seed, STOCHASTIC, BLOCK, EMULATE, True)
    else:
        _round_bf16_program(x_ptr, out_ptr, n, seed, STOCHASTIC, BLOCK, EMULATE, False)


@jit
def _round_bf16_program(x_ptr, out_ptr, n, seed, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr,
                        EMULATE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    WIDTH: tl.constexpr = BLOCK // SLICES
    offs = pid * BLOCK + tl.arange(0, WIDTH).to(tl.int64)
    xs = ()
    for i in tl.static_range(SLICES):
        if MASKED:
            xs = xs + (tl.load(x_ptr + offs + i * WIDTH, mask=offs + i * WIDTH < n, other=0.0),)
        else:
            xs = xs + (tl.load(x_ptr + offs + i * WIDTH),)
    if STOCHASTIC:
        # One Philox call a position: its four 32-bit outputs are eight 16-bit draws, one a slice. The counter
        # (position in the program, program, 0, bits of slice 0) is unique and in the loads' layout.
        local = (offs - pid * BLOCK).to(tl.uint32)
        block = local * 0 + pid.to(tl.uint32)
        r0, r1, r2, r3 = philox(seed, local, block, local * 0, xs[0].to(tl.uint32, bitcast=True), _ROUNDS)
        rs = ((r0 & 0xFFFF).to(tl.int32), (r1 & 0xFFFF).to(tl.int32), (r2 & 0xFFFF).to(tl.int32),
              (r3 & 0xFFFF).to(tl.int32), (r0 >> 16).to(tl.int32), (r1 >> 16).to(tl.int32), (r2 >> 16).to(tl.int32),
              (r3 >> 16).to(tl.int32))  # fmt: skip
    for i in tl.static_range(SLICES):
        if STOCHASTIC:
            half = _stochastic_bf16_bits(xs[i], rs[i])
        else:
            half = bf16_bits(_saturate_bf16(xs[i]), EMULATE)
        if MASKED:
            tl.store(out_ptr + offs + i * WIDTH, half, mask=offs + i * WIDTH < n)
        else:
            tl.store(out_ptr + offs + i * WIDTH, half)


def triton_round_bf16(flat: torch.Tensor, stochastic: bool, seed: int, interpret: bool = False) -> torch.Tensor:
    """Round a contiguous 1-D float32 tensor to bfloat16."""
    n = flat.numel()
    out = torch.empty(n, dtype=torch.bfloat16, device=flat.device)
    if n:
        programs, full, options = round_bf16_launch(n, stochastic, interpret)
        launch(_round_bf16_kernel, programs, flat, out.view(torch.int16), n, seed, full, **options)
    return out


def torch_round_bf16(flat: torch.Tensor, stochastic: bool, seed: int) -> torch.Tensor:
    """The reference and CPU path of :func:`triton_round_bf16`."""
    if not stochastic:  # clamp keeps NaN; the infinities are kept apart
        return torch.where(flat.isinf(), flat, flat.clamp(-BF16_MAX, BF16_MAX)).to(torch.bfloat16)
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    r = torch.randint(0, 1 << 16, flat.shape, generator=gen, device=flat.device, dtype=torch.int32)
    pattern = flat.view(torch.int32)
    up = (pattern + r) >> 16
    down = pattern >> 16
    keep_up = ((up & 0x7F80) != 0x7F80) | flat.isinf()
    half = torch.where(keep_up, up, down).to(torch.int16).view(torch.bfloat16)
    return torch.where(flat.isnan(), flat.to(torch.bfloat16), half)
