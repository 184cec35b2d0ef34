"""The normal scheme's Triton kernels (the format: ``format.py``): quantize and dequantize, one program a run of
groups, and what the launchers pass them (``normal_quantize_launch``, ``normal_dequantize_launch``)."""

from __future__ import annotations

import torch

from gactx.kernels._grid import plan
from gactx.kernels._triton import constexpr, jit, launch, tl
from gactx.kernels.half import bf16_bits
from gactx.kernels.random import ROUNDS, philox
from gactx.kernels.schemes.normal.format import (
    DEV_SHIFT,
    FRACTION,
    INV_FRACTION,
    META_WORDS,
    NORMAL_BITS,
    NORMAL_WARPS,
    SHAPES,
    allocate,
)
from gactx.kernels.schemes.uniform.dequantize import decode
from gactx.kernels.schemes.uniform.format import FLT_MAX, MIN_STEP
from gactx.kernels.schemes.uniform.quantize import NUM_WARPS, _load_fp32, _nan_if_not_finite, program_rows

__all__ = ["normal_dequantize_launch", "normal_quantize_launch", "triton_normal_dequantize", "triton_normal_quantize"]

_FLT_MAX, _MIN_STEP, _FRACTION, _INV_FRACTION = (constexpr(v) for v in (FLT_MAX, MIN_STEP, FRACTION, INV_FRACTION))
_ROUNDS, _WORDS, _DEV_SHIFT = constexpr(ROUNDS), constexpr(META_WORDS), constexpr(DEV_SHIFT)
_SAFETY = constexpr(1.0 + 2.0**-20)  # the uniform scheme's margin, on the last segment
_POS_INF_BITS = constexpr(0x7F800000)
_NEG_INF_UBITS = constexpr(0xFF800000)
_NAN_BITS = constexpr(0x7FC00000)  # the canonical quiet NaN, stored as the kind of a group mixing non-finite values
_NEG_INF_BITS = constexpr(-0x800000)  # -Inf's pattern as int32


@jit
def _knots(lo, hi, c16, d16, special, LEVELS: tl.constexpr, TAIL: tl.constexpr, KNOT: tl.constexpr):
    """A group's segments from its stored words (module docstring): ``(scale, a0, a1, a2, step0, step1, step2,
    J1, J2, n0, n1, n2)``, ``J`` the first code of a segment, ``n`` its intervals (int32)."""
    INNER: tl.constexpr = LEVELS - 2 * TAIL
    base = tl.where(special, -hi, lo)
    scale = tl.where(hi - base <= _FLT_MAX, 1.0, 0.25)
    a0 = base * scale
    top = hi * scale
    unit = (top - a0) * _INV_FRACTION
    centre = a0 + c16.to(tl.float32) * unit
    spread = d16.to(tl.float32) * unit
    b1 = centre - spread * KNOT
    b2 = centre + spread * KNOT
    # A tail is kept where its intervals would be wider than the inner ones; else it is empty (module docstring).
    inner = (b2 - b1) * (TAIL / INNER)
    lower = ((b1 - a0) > inner) & ~special
    upper = ((top - b2) > inner) & ~special
    n0 = tl.where(lower, TAIL, 0)
    n2 = tl.where(upper, TAIL, 0)
    n1 = tl.where(special, LEVELS - 1, LEVELS - n0 - n2)
    step0 = tl.where(lower, tl.maximum((b1 - a0) * (1.0 / TAIL), _MIN_STEP), 0.0)
    a1 = a0 + n0.to(tl.float32) * step0
    f_inner = tl.where(lower, 1.0 / INNER, 1.0 / (INNER + TAIL))
    f_last = tl.where(special, _SAFETY / (LEVELS - 1), tl.where(lower, _SAFETY / (INNER + TAIL), _SAFETY / LEVELS))
    w1 = tl.where(upper, b2, top) - a1
    step1 = tl.where(w1 > 0.0, tl.maximum(w1 * tl.where(upper, f_inner, f_last), _MIN_STEP), 0.0)
    a2 = a1 + n1.to(tl.float32) * step1
    w2 = top - a2
    step2 = tl.where(upper & (w2 > 0.0), tl.maximum(w2 * (_SAFETY / TAIL), _MIN_STEP), 0.0)
    return scale, a0, a1, a2, step0, step1, step2, n0, n0 + n1, n0, n1, n2


@jit
def _inverse(step):
    return tl.where(step > 0.0, tl.math.div_rn(1.0, tl.where(step > 0.0, step, 1.0)), 0.0)


@jit
def _fraction(x, fin, a0, r, scale):
    """``U`` of the module docstring as int32; 0 where ``fin`` is false."""
    v = tl.minimum((x * scale - a0) * r, _FRACTION)
    return tl.where(fin, v + 0.5, 0.0).to(tl.int32)


@jit
def _code(x, fin, scale, a1, a2, origin0, inv0, inv1, inv2, j1, j2, n0, n1, n2, shift, LEVELS: tl.constexpr):
    """An element's code (int32): its segment by two comparisons, then uniform rounding inside it."""
    xs = x * scale
    up = xs >= a2
    mid = xs >= a1
    origin = tl.where(up, a2, tl.where(mid, a1, origin0))
    inv = tl.where(up, inv2, tl.where(mid, inv1, inv0))
    first = tl.where(up, j2, tl.where(mid, j1, 0))
    count = tl.where(up, n2, tl.where(mid, n1, n0))
    s = tl.minimum((xs - origin) * inv + shift, (count + 1).to(tl.float32))
    s = tl.where(fin, s, 1.0)
    return tl.where(fin, first + s.to(tl.int32) - 1, LEVELS)


@jit(do_not_specialize=["n", "seed", "full"])
def _normal_quantize_kernel(
    x_ptr, codes_ptr, meta_ptr, n, seed, full,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, REST_ROWS: tl.constexpr, SLICES: tl.constexpr,
    STOCHASTIC: tl.constexpr, IN_BF16: tl.constexpr, TAIL: tl.constexpr, KNOT: tl.constexpr, REST: tl.constexpr,
):  # fmt: skip
    """``full`` programs of ``ROWS`` groups, unmasked, then (``REST``) masked programs of ``REST_ROWS`` (``_grid.py``;
    ``TAIL``: the normal's tails, not the tensor's rest)."""
    if REST:
        if tl.program_id(0) < full:
            _normal_quantize_program(x_ptr, codes_ptr, meta_ptr, n, seed, 0, BITS, GROUP, ROWS, SLICES, STOCHASTIC,
                                     IN_BF16, TAIL, KNOT, False)  # fmt: skip
        else:  # a masked program's index counts in programs of its own size
            _normal_quantize_program(x_ptr, codes_ptr, meta_ptr, n, seed, full * (ROWS // REST_ROWS) - full, BITS,
                                     GROUP, REST_ROWS, SLICES, STOCHASTIC, IN_BF16, TAIL, KNOT, True)  # fmt: skip
    else:
        _normal_quantize_program(x_ptr, codes_ptr, meta_ptr, n, seed, 0, BITS, GROUP, ROWS, SLICES, STOCHASTIC,
                                 IN_BF16, TAIL, KNOT, False)  # fmt: skip


@jit
def _normal_quantize_program(
    x_ptr, codes_ptr, meta_ptr, n, seed, first,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, SLICES: tl.constexpr, STOCHASTIC: tl.constexpr,
    IN_BF16: tl.constexpr, TAIL: tl.constexpr, KNOT: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64) + first
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PLANES: tl.constexpr = 8 // BITS
    WIDTH: tl.constexpr = GROUP // SLICES
    SETS: tl.constexpr = SLICES // PLANES
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * GROUP + tl.arange(0, WIDTH).to(tl.int64)[None, :]
    xs = ()
    for i in tl.static_range(SLICES):
        xs = xs + (_load_fp32(x_ptr, offs + i * WIDTH, n, IN_BF16, MASKED),)

    # min and max of the finite values, and the largest patterns as signed and unsigned int32 (uniform/quantize.py).
    low = _nan_if_not_finite(xs[0], offs, n, MASKED)
    high = low
    sbits = xs[0].to(tl.int32, bitcast=True)
    ubits = xs[0].to(tl.uint32, bitcast=True)
    for i in tl.static_range(1, SLICES):
        z = _nan_if_not_finite(xs[i], offs + i * WIDTH, n, MASKED)
        low = tl.minimum(low, z)
        high = tl.maximum(high, z)
        sbits = tl.maximum(sbits, xs[i].to(tl.int32, bitcast=True))
        ubits = tl.maximum(ubits, xs[i].to(tl.uint32, bitcast=True))
    fmin = tl.min(low, axis=1)
    fmax = tl.max(high, axis=1)
    smax = tl.max(sbits, axis=1)
    umax = tl.max(ubits, axis=1)
    pos = smax >= _POS_INF_BITS
    neg = umax >= _NEG_INF_UBITS
    special = pos | neg
    nan = (smax > _POS_INF_BITS) | (umax > _NEG_INF_UBITS) | (pos & neg)
    kind = tl.where(nan, _NAN_BITS, tl.where(pos, _POS_INF_BITS, _NEG_INF_BITS))
    fmin = tl.where(fmin == fmin, fmin, 0.0) + 0.0  # NaN: no finite value; + 0.0 makes -0 +0 (any order)
    fmax = tl.where(fmax == fmax, fmax, 0.0) + 0.0
    lo = tl.where(special, 0.0, fmin)
    hi = tl.where(special, tl.maximum(-fmin, fmax) + 0.0, fmax)  # max(-0, 0) is either zero: +0

    # Mean and deviation in fixed point (module docstring): integer sums, the same in any order.
    base = tl.where(special, -hi, lo)
    scale = tl.where(hi - base <= _FLT_MAX, 1.0, 0.25)
    a0 = base * scale
    span = hi * scale - a0
    r = tl.where(span > 0.0, tl.minimum(tl.math.div_rn(_FRACTION, tl.where(span > 0.0, span, 1.0)), _FLT_MAX), 0.0)
    r = r[:, None]
    fins = ()
    us = ()
    total = tl.zeros((ROWS, WIDTH), tl.int32)
    for i in tl.static_range(SLICES):
        fin = tl.abs(xs[i]) < float("inf")
        if MASKED:
            fin = fin & (offs + i * WIDTH < n)
        fins = fins + (fin,)
        u = _fraction(xs[i], fin, a0[:, None], r, scale[:, None])
        us = us + (u,)
        total += u
    count = tl.minimum(tl.maximum(n - rows * GROUP, 1), GROUP).to(tl.int32)
    c16 = tl.minimum((tl.sum(total, axis=1) + count // 2) // count, 65535)
    squares = tl.zeros((ROWS, WIDTH), tl.int32)
    for i in tl.static_range(SLICES):
        e = (tl.abs(us[i] - c16[:, None]) + 32) >> _DEV_SHIFT
        squares += tl.where(fins[i], e * e, 0)
    var = tl.math.div_rn(tl.sum(squares, axis=1).to(tl.float32), count.to(tl.float32))
    d16 = tl.minimum((tl.math.sqrt_rn(var) * 64.0 + 0.5).to(tl.int32), 65535)
    c16 = tl.where(special, 0, c16)
    d16 = tl.where(special, 0, d16)

    mrow = meta_ptr + rows * _WORDS
    word0 = tl.where(special, kind, lo.to(tl.int32, bitcast=True))
    word1 = hi.to(tl.int32, bitcast=True)
    word2 = (c16.to(tl.uint32) | (d16.to(tl.uint32) << 16)).to(tl.int32, bitcast=True)
    if MASKED:
        live = rows < (n + GROUP - 1) // GROUP
        tl.store(mrow, word0, mask=live)
        tl.store(mrow + 1, word1, mask=live)
        tl.store(mrow + 2, word2, mask=live)
    else:
        tl.store(mrow, word0)
        tl.store(mrow + 1, word1)
        tl.store(mrow + 2, word2)

    scale, a0, a1, a2, step0, step1, step2, j1, j2, n0, n1, n2 = _knots(lo, hi, c16, d16, special, LEVELS, TAIL, KNOT)
    scale = scale[:, None]
    a0 = a0[:, None]
    a1 = a1[:, None]
    a2 = a2[:, None]
    inv0 = _inverse(step0)[:, None]
    inv1 = _inverse(step1)[:, None]
    inv2 = _inverse(step2)[:, None]
    j1 = j1[:, None]
    j2 = j2[:, None]
    n0 = n0[:, None]
    n1 = n1[:, None]
    n2 = n2[:, None]
    if STOCHASTIC:
        # One Philox call for four slices, as uniform/quantize.py: 1 + u with 23 random bits in the mantissa.
        local = (offs - pid * (ROWS * GROUP)).to(tl.uint32)
        block = local * 0 + pid.to(tl.uint32)
        data = xs[0].to(tl.uint32, bitcast=True)
        shifts = ()
        for call in tl.static_range(SLICES // 4):
            rs = philox(seed, local, block, local * 0 + call, data, _ROUNDS)
            for j in tl.static_range(4):
                shifts = shifts + (((rs[j] & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True),)
    else:
        shifts = ()
        for _ in tl.static_range(SLICES):
            shifts = shifts + (1.5,)
    qs = ()
    for i in tl.static_range(SLICES):
        q = _code(xs[i], fins[i], scale, a1, a2, a0, inv0, inv1, inv2, j1, j2, n0, n1, n2, shifts[i], LEVELS)
        if MASKED:
            q = tl.where(offs + i * WIDTH < n, q, 0)
        qs = qs + (q,)

    boffs = rows[:, None] * (GROUP * BITS // 8) + tl.arange(0, WIDTH).to(tl.int64)[None, :]
    for i in tl.static_range(SETS):
        packed = qs[i]
        for p in tl.static_range(1, PLANES):
            packed = packed | (qs[i + p * SETS] << (p * BITS))
        packed = packed.to(tl.uint8)
        if MASKED:
            tl.store(codes_ptr + boffs + i * WIDTH, packed, mask=rows[:, None] < (n + GROUP - 1) // GROUP)
        else:
            tl.store(codes_ptr + boffs + i * WIDTH, packed)


@jit(do_not_specialize=["n", "full"])
def _normal_dequantize_kernel(
    codes_ptr, meta_ptr, out_ptr, n, full,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, OUT_BF16: tl.constexpr, OUT_MAX: tl.constexpr,
    EMULATE: tl.constexpr, TAIL: tl.constexpr, KNOT: tl.constexpr, REST: tl.constexpr,
):  # fmt: skip
    """``full`` programs of ``ROWS`` groups, unmasked, then (``REST``) a masked one (``_grid.py``)."""
    if REST:
        if tl.program_id(0) < full:
            _normal_dequantize_program(codes_ptr, meta_ptr, out_ptr, n, BITS, GROUP, ROWS, OUT_BF16, OUT_MAX, EMULATE,
                                       TAIL, KNOT, False)  # fmt: skip
        else:
            _normal_dequantize_program(codes_ptr, meta_ptr, out_ptr, n, BITS, GROUP, ROWS, OUT_BF16, OUT_MAX, EMULATE,
                                       TAIL, KNOT, True)  # fmt: skip
    else:
        _normal_dequantize_program(codes_ptr, meta_ptr, out_ptr, n, BITS, GROUP, ROWS, OUT_BF16, OUT_MAX, EMULATE,
                                   TAIL, KNOT, False)  # fmt: skip


@jit
def _normal_dequantize_program(
    codes_ptr, meta_ptr, out_ptr, n,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, OUT_BF16: tl.constexpr, OUT_MAX: tl.constexpr,
    EMULATE: tl.constexpr, TAIL: tl.constexpr, KNOT: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PLANES: tl.constexpr = 8 // BITS
    WIDTH: tl.constexpr = GROUP // PLANES
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    boffs = rows[:, None] * WIDTH + tl.arange(0, WIDTH).to(tl.int64)[None, :]
    mrow = meta_ptr + rows * _WORDS
    if MASKED:
        in_range = rows < (n + GROUP - 1) // GROUP
        packed = tl.load(codes_ptr + boffs, mask=in_range[:, None], other=0).to(tl.int32)
        word0 = tl.load(mrow, mask=in_range, other=0)
        word1 = tl.load(mrow + 1, mask=in_range, other=0)
        word2 = tl.load(mrow + 2, mask=in_range, other=0)
    else:
        packed = tl.load(codes_ptr + boffs).to(tl.int32)
        word0 = tl.load(mrow)
        word1 = tl.load(mrow + 1)
        word2 = tl.load(mrow + 2)
    lo = word0.to(tl.float32, bitcast=True)
    hi = word1.to(tl.float32, bitcast=True)
    special = (tl.abs(lo) >= float("inf")) | (lo != lo)
    w2 = word2.to(tl.uint32, bitcast=True)
    c16 = (w2 & 0xFFFF).to(tl.int32)
    d16 = (w2 >> 16).to(tl.int32)
    scale, a0, a1, a2, step0, step1, step2, j1, j2, n0, n1, n2 = _knots(
        tl.where(special, 0.0, lo), hi, c16, d16, special, LEVELS, TAIL, KNOT
    )
    unscale = tl.where(scale < 1.0, 4.0, 1.0)[:, None]
    kind = tl.where(special, lo, 0.0)[:, None]
    special = special[:, None]
    a0 = a0[:, None]
    a1 = a1[:, None]
    a2 = a2[:, None]
    step0 = step0[:, None]
    step1 = step1[:, None]
    step2 = step2[:, None]
    j1 = j1[:, None]
    j2 = j2[:, None]
    offs = rows[:, None] * GROUP + tl.arange(0, WIDTH).to(tl.int64)[None, :]
    for p in tl.static_range(PLANES):
        q = (packed >> (p * BITS)) & LEVELS
        up = q >= j2
        mid = q >= j1
        origin = tl.where(up, a2, tl.where(mid, a1, a0))
        step = tl.where(up, step2, tl.where(mid, step1, step0))
        start = tl.where(up, j2, tl.where(mid, j1, 0))
        value = ((q - start).to(tl.float32) * step + origin) * unscale
        value = tl.minimum(tl.maximum(value, -OUT_MAX), OUT_MAX)
        value = tl.where(special & (q == LEVELS), kind, value)
        if OUT_BF16:
            value = bf16_bits(value, EMULATE)
        else:
            value = value.to(out_ptr.dtype.element_ty)
        if MASKED:
            tl.store(out_ptr + offs + p * WIDTH, value, mask=offs + p * WIDTH < n)
        else:
            tl.store(out_ptr + offs + p * WIDTH, value)


def normal_quantize_launch(
    n: int, dtype: torch.dtype, bits: int, group_size: int, stochastic: bool, interpret: bool = False
) -> tuple[int, int, dict]:
    """``(programs, full, meta-parameters)`` of the launch of ``_normal_quantize_kernel``: the programs of
    ``uniform/quantize.py`` (4096 elements, masked ones of 2048 for the rest) on 8 warps, four slices a group."""
    rows = program_rows(group_size, bits, dtype.itemsize, interpret)
    rest_rows = program_rows(group_size, bits, dtype.itemsize, interpret, masked=True)
    programs, full, rest = plan(n, rows * group_size, rest_rows * group_size)
    k, tail = SHAPES[bits]
    meta = dict(
        BITS=bits, GROUP=group_size, ROWS=rows, REST_ROWS=rest_rows, SLICES=4, STOCHASTIC=stochastic,
        IN_BF16=dtype == torch.bfloat16, TAIL=tail, KNOT=k, REST=rest, num_warps=NORMAL_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return programs, full, meta


def normal_dequantize_launch(
    n: int, dtype: torch.dtype, bits: int, group_size: int, interpret: bool = False
) -> tuple[int, int, dict]:
    """``(programs, full, meta-parameters)`` of the launch of ``_normal_dequantize_kernel``."""
    rows = program_rows(group_size, bits, dtype.itemsize, interpret)
    programs, full, rest = plan(n, rows * group_size)
    k, tail = SHAPES[bits]
    meta = dict(
        BITS=bits, GROUP=group_size, ROWS=rows, OUT_BF16=dtype == torch.bfloat16, OUT_MAX=torch.finfo(dtype).max,
        EMULATE=interpret, TAIL=tail, KNOT=k, REST=rest, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    if rest and bits == 8 and dtype.itemsize == 2:
        # With the masked program beside it, ptxas held the 8-bit group-32 kernel of 16-bit outputs to 80 registers and
        # spilled 16 bytes (sm_90); with no limit to meet it takes what it needs. Elsewhere ptxas is left alone: a limit
        # makes it take more registers than it needs (up to twice, fewer programs an SM), and at 128 it spills.
        meta["maxnreg"] = 255
    return programs, full, meta


def triton_normal_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, interpret: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous 1-D float tensor: ``(codes, meta)``, meta int32 ``[n_groups, 3]``."""
    assert flat.dim() == 1 and flat.is_contiguous() and bits in NORMAL_BITS
    n = flat.numel()
    codes, meta = allocate(n, bits, group_size, flat.device)
    if n == 0:
        return codes, meta
    x = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat
    programs, full, options = normal_quantize_launch(n, flat.dtype, bits, group_size, stochastic, interpret)
    launch(_normal_quantize_kernel, programs, x, codes, meta, n, seed, full, **options)
    return codes, meta


def triton_normal_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype,
    interpret: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Decode ``n`` elements from ``(codes, meta)`` into a new contiguous 1-D tensor of ``dtype``."""
    return decode(
        _normal_dequantize_kernel, normal_dequantize_launch, codes, meta, bits, group_size, n, dtype, interpret
    )
