"""Levels placed by a normal fitted to each group (after SmaQ): ``_normal_quantize_kernel``,
``triton_normal_quantize``, ``torch_normal_quantize`` and their dequantize counterparts.

Activations are close to normal, and uniform min-max levels spend most codes where few values are (the tails
of a bell, the gap up to an outlier). Here each group gets a piecewise-uniform compander in
``z = (x - mean) / std``: an inner segment ``|z| <= K`` and two tails out to the group's min and max. Each
segment has a fixed number of equal intervals; segment ends are levels, and the outermost levels are the
min and the max, so every element lies between two neighbouring levels and stochastic rounding between
them, ``p(up) = (x - t_j) / (t_{j+1} - t_j)``, is unbiased. Outliers are handled explicitly: a tail holds
them on its own intervals, the bulk keeps the fine inner ones. Finding an element's segment takes two
comparisons and rounding inside it is the uniform scheme's; no transcendental function an element::

    levels of a 4-bit group (15 intervals: 2 + 11 + 2), K = 1.7:

    lo                  mean - K std                      mean + K std                        hi (outlier)
    |---------|---------|--|--|--|--|--|--|--|--|--|--|--|-----------------|-----------------|
     lower tail: 2       inner: 11 equal intervals         upper tail: 2
    codes 0 .. 2         2 .. 13                           13 .. 15

    A tail narrower than its intervals would be at the inner step (``b1 - lo <= (b2 - b1) * tail / inner``,
    which includes an end at or past the group's min) is empty: its intervals go to the inner segment (lo,
    13 inner, 2 upper), so no code is spent finer than the bulk's; with both empty the grid is uniform (the
    case of uniform-distributed groups, whose fitted normal reaches past their ends).

Constants (``SHAPES``: ``K`` and intervals a tail; the inner segment has the rest of ``2**bits - 1``):

    bits  K    tail  inner   rounding variance / uniform's, 256-element groups (script below)
    2     0.7  1     1       normal 0.84, normal + one 20-sigma outlier 0.14, Student-t(3) 0.35, uniform 1.08
    4     1.7  2     11      normal 0.80, outlier 0.11, Student-t(3) 0.47, uniform-distributed 1.37
    8     1.8  28    199     normal 0.81, outlier 0.16, Student-t(3) 0.59, uniform-distributed 1.07

found by a grid search (K in steps of 0.1 from 0.6 to 3, every tail count at 2 and 4 bits, 8 to 76 in steps
of 4 at 8 bits) minimising the expected stochastic-rounding variance ``sum (x - t_j)(t_{j+1} - x)`` of 1,500
(8 bits: 400) groups of 256 standard normal samples, with numpy in float64. The standard deviation beat the
mean absolute deviation as the spread on the outlier and Student-t groups at equal normal-group variance
(an outlier widens the inner segment to cover the bulk). Five segments (a shoulder between inner and tail)
gained 2% more at 4 bits for two more comparisons an element: not taken.

Metadata, 12 bytes a group (uniform: 8), int32 ``[n_groups, 3]``::

    word 0: lo, float32 bits     the group's min (special groups: NaN, +Inf or -Inf, as format.py)
    word 1: hi, float32 bits     the group's max (special groups: max |x| of the finite elements)
    word 2: bits 0-15 C, 16-31 D mean and standard deviation as fractions of hi - lo, in 1/65536

Mean and deviation, the same in any summation order: each element's fraction of the range,
``U = round((x - lo) * (65536 / (hi - lo)))`` (an integer in ``[0, 65536]``), is summed as an integer
(at most ``4096 * 2**16 = 2**28``: int32), ``C = round(sum U / count)``; then the deviations, at 1/1024
of the range, ``e = (|U - C| + 32) >> 6``, ``D = round(sqrt(sum e**2 / count) * 64)``: ``sum e**2`` is at
most ``count * 2**18 + 2**22 < 2**31`` because no variance of values in a range exceeds a quarter of its
square. Encoder and decoder both derive the knots from the stored words, in the same float32 operations
(IEEE division and square root, no fused multiply-add: ``enable_fp_fusion=False``), so the Triton kernels
and the torch twins agree bit for bit with ``stochastic=False``; so do the C++ CPU kernels (``cpu.py``:
``normal_quantize``, ``normal_dequantize``, a group a thread), which run this scheme on CPU tensors.

Knots, one group, in float32, ``s = 1`` or ``1/4`` where ``hi - lo`` overflows (as ``quantize.py``'s scale)::

    a0 = lo * s;  span = hi * s - a0;  unit = span / 65536;  centre = a0 + C * unit;  spread = D * unit
    b1 = centre - K * spread;  b2 = centre + K * spread;  w = (b2 - b1) * (tail / inner)
    lower tail present when b1 - a0 > w;  upper tail when hi * s - b2 > w
    step0 = max((b1 - a0) / tail, 2**-126)        a1 = a0 + n_lower * step0
    step1 = max((end - a1) * f, 2**-126)           a2 = a1 + n_inner * step1   (end = b2, or hi * s when last)
    step2 = max((hi * s - a2) * f', 2**-126)       f, f' = 1 / n, or (1 + 2**-20) / n for the last segment

Each knot is computed from the one before, so a segment's top level is exactly the next one's first; the
last segment's margin (``quantize.py``'s) puts the top level at or just above ``hi``. A segment of zero width
has step 0 and holds no element. Level ``j`` of segment ``k`` is ``(a_k + (j - J_k) * step_k) / s`` (J the
segment's first code), saturated at the output dtype's largest finite value. An element ``x`` of segment ``k``
(``a_k <= x * s < a_{k+1}``) gets ``J_k + min(trunc((x * s - a_k) / step_k + 1 + u), n_k + 1) - 1``, ``u ~
U[0, 1)`` (``1/2``: round half up); the clamp acts only on a float32 rounding at a segment's end (bias under
``2**-20`` of a step).

Groups that hold NaN or +-Inf (format.py's special groups): word 0 is the non-finite value, the top code
stands for it at its places, and the finite elements use one uniform segment of ``L - 1`` intervals on
``[-max|x|, max|x|]``, as the uniform scheme's centred grid. Extreme finite groups (spans past FLT_MAX, values
near 65504 in float16, subnormal ranges, constant groups) decode finite and between their two levels. A
group whose range is subnormal gets a coarse mean (``U`` saturates) and the 2**-126 floor on steps: still
unbiased, on coarser levels. ``rounding_variance`` (``variance.py``) gives the expected squared error.

Bits: 2, 4, 8 (``NORMAL_BITS``). 1 bit is refused: two levels are the min and the max, the uniform grid.
"""

from __future__ import annotations

import numpy as np
import torch

from gactx.kernels._grid import plan
from gactx.kernels._triton import constexpr, jit, tl
from gactx.kernels.format import pack_planes, unpack_planes
from gactx.kernels.half import bf16_bits
from gactx.kernels.quantize import (
    FLT_MAX,
    MIN_STEP,
    NUM_WARPS,
    ROUNDS,
    _load_fp32,
    _nan_if_not_finite,
    philox,
    program_rows,
    step_factor,
)

__all__ = [
    "NORMAL_BITS",
    "SHAPES",
    "normal_nbytes",
    "triton_normal_quantize",
    "torch_normal_quantize",
    "triton_normal_dequantize",
    "torch_normal_dequantize",
    "normal_quantize_launch",
    "normal_dequantize_launch",
    "normal_levels",
]

NORMAL_BITS = (2, 4, 8)
SHAPES = {2: (0.7, 1), 4: (1.7, 2), 8: (1.8, 28)}  # bits -> (K, intervals a tail): see the module docstring
META_WORDS = 3  # int32 words a group: 12 bytes
FRACTION = 65536.0  # C and D are in 1/65536 of the range
DEV_SHIFT = 6  # deviations summed in units of 64/65536 of the range (1/1024): the sum of squares fits int32
INV_FRACTION = 1.0 / FRACTION
# Quantize keeps each element's fraction U as well as its value through the program (two reductions): with 4
# warps (32 elements a thread) ptxas spills at 128 registers a thread (8-16 bytes, float32) and at 168 (160
# bytes, 16-bit inputs). 8 warps, 16 elements a thread, hold them in 128.
NORMAL_MAX_REGISTERS = 128
NORMAL_WARPS = 8
_FLT_MAX, _MIN_STEP, _FRACTION, _INV_FRACTION = (constexpr(v) for v in (FLT_MAX, MIN_STEP, FRACTION, INV_FRACTION))
_ROUNDS, _WORDS, _DEV_SHIFT = constexpr(ROUNDS), constexpr(META_WORDS), constexpr(DEV_SHIFT)
_SAFETY = constexpr(1.0 + 2.0**-20)  # quantize.py's margin, on the last segment
_POS_INF_BITS = constexpr(0x7F800000)
_NEG_INF_UBITS = constexpr(0xFF800000)
_NAN_BITS = constexpr(0x7FC00000)  # the canonical quiet NaN, stored as the kind of a group mixing non-finite values
_NEG_INF_BITS = constexpr(-0x800000)  # -Inf's pattern as int32


def normal_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of codes and metadata for ``numel`` elements: the uniform payload plus 12 bytes a group."""
    n_groups = -(-numel // group_size)
    return n_groups * group_size * bits // 8 + 4 * META_WORDS * n_groups


def _f32(v: float) -> float:
    return float(np.float32(v))


def _factors(bits: int) -> dict[str, float]:
    """The float32 factors of the knots: ``1/n`` of a segment that is not last, ``(1 + 2**-20)/n`` of the last."""
    levels = (1 << bits) - 1
    k, tail = SHAPES[bits]
    inner = levels - 2 * tail
    return dict(
        k=_f32(k), share=_f32(tail / inner), tail=_f32(1.0 / tail), last_tail=step_factor(tail),
        inner_both=_f32(1.0 / inner), inner_no_lower=_f32(1.0 / (inner + tail)),
        last_with_lower=step_factor(inner + tail), last_alone=step_factor(levels), last_special=step_factor(levels - 1),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- Triton


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

    # min and max of the finite values, and the largest patterns as signed and unsigned int32 (quantize.py).
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
        # One Philox call for four slices, as quantize.py: 1 + u with 23 random bits in the mantissa.
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
    ``quantize.py`` (4096 elements, masked ones of 2048 for the rest) on 8 warps, four slices a group."""
    rows = program_rows(group_size, bits, dtype.itemsize, interpret)
    rest_rows = program_rows(group_size, bits, dtype.itemsize, interpret, masked=True)
    programs, full, rest = plan(n, rows * group_size, rest_rows * group_size)
    k, tail = SHAPES[bits]
    meta = dict(
        BITS=bits, GROUP=group_size, ROWS=rows, REST_ROWS=rest_rows, SLICES=4, STOCHASTIC=stochastic,
        IN_BF16=dtype == torch.bfloat16, TAIL=tail, KNOT=k, REST=rest, num_warps=NORMAL_WARPS, enable_fp_fusion=False,
        maxnreg=NORMAL_MAX_REGISTERS,
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


def _allocate(n: int, bits: int, group_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    n_groups = -(-n // group_size)
    codes = torch.empty(n_groups * group_size * bits // 8, dtype=torch.uint8, device=device)
    return codes, torch.empty((n_groups, META_WORDS), dtype=torch.int32, device=device)


def triton_normal_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, interpret: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous 1-D float tensor: ``(codes, meta)``, meta int32 ``[n_groups, 3]``."""
    assert flat.dim() == 1 and flat.is_contiguous() and bits in NORMAL_BITS
    n = flat.numel()
    codes, meta = _allocate(n, bits, group_size, flat.device)
    if n == 0:
        return codes, meta
    x = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat
    programs, full, launch = normal_quantize_launch(n, flat.dtype, bits, group_size, stochastic, interpret)
    _normal_quantize_kernel[(programs,)](x, codes, meta, n, seed, full, **launch)
    return codes, meta


def triton_normal_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype,
    interpret: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Decode ``n`` elements from ``(codes, meta)`` into a new contiguous 1-D tensor of ``dtype``."""
    out = torch.empty(n, dtype=dtype, device=codes.device)
    if n == 0:
        return out
    target = out.view(torch.int16) if dtype == torch.bfloat16 else out
    programs, full, launch = normal_dequantize_launch(n, dtype, bits, group_size, interpret)
    _normal_dequantize_kernel[(programs,)](codes, meta, target, n, full, **launch)
    return out


# ---------------------------------------------------------------------------------------------------- torch


def _torch_knots(lo: torch.Tensor, hi: torch.Tensor, c16: torch.Tensor, d16: torch.Tensor, special, bits: int):
    """:func:`_knots` in torch, on ``[n_groups]`` tensors: the same float32 operations in the same order."""
    f = _factors(bits)
    levels = (1 << bits) - 1
    tail = SHAPES[bits][1]
    base = torch.where(special, -hi, lo)
    scale = torch.where(hi - base <= FLT_MAX, 1.0, 0.25)
    a0 = base * scale
    top = hi * scale
    unit = (top - a0) * INV_FRACTION
    centre = a0 + c16.float() * unit
    spread = d16.float() * unit
    b1 = centre - spread * f["k"]
    b2 = centre + spread * f["k"]
    inner = (b2 - b1) * f["share"]
    lower = ((b1 - a0) > inner) & ~special
    upper = ((top - b2) > inner) & ~special
    zero = torch.zeros((), dtype=torch.int32, device=lo.device)
    n0 = torch.where(lower, tail, zero)
    n2 = torch.where(upper, tail, zero)
    n1 = torch.where(special, levels - 1, levels - n0 - n2).to(torch.int32)
    step0 = torch.where(lower, ((b1 - a0) * f["tail"]).clamp(min=MIN_STEP), 0.0)
    a1 = a0 + n0.float() * step0
    f_inner = torch.where(lower, f["inner_both"], f["inner_no_lower"])
    f_last = torch.where(special, f["last_special"], torch.where(lower, f["last_with_lower"], f["last_alone"]))
    w1 = torch.where(upper, b2, top) - a1
    step1 = torch.where(w1 > 0, (w1 * torch.where(upper, f_inner, f_last)).clamp(min=MIN_STEP), 0.0)
    a2 = a1 + n1.float() * step1
    w2 = top - a2
    step2 = torch.where(upper & (w2 > 0), (w2 * f["last_tail"]).clamp(min=MIN_STEP), 0.0)
    return scale, (a0, a1, a2), (step0, step1, step2), (n0, n0 + n1), (n0, n1, n2)


def _unpack_meta(meta: torch.Tensor):
    """``(lo, hi, C, D, special, kind)`` of int32 metadata ``[n_groups, 3]``."""
    lo, hi = meta[:, 0].contiguous().view(torch.float32), meta[:, 1].contiguous().view(torch.float32)
    special = ~torch.isfinite(lo)
    c16, d16 = meta[:, 2] & 0xFFFF, (meta[:, 2] >> 16) & 0xFFFF
    return torch.where(special, 0.0, lo), hi, c16, d16, special, lo


def _encode_meta(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Int32 metadata ``[n_groups, 3]`` of the padded groups ``x`` (``valid`` marks real elements)."""
    inf = float("inf")
    finite = valid & torch.isfinite(x)
    fmin = torch.where(finite, x, inf).amin(1)
    fmax = torch.where(finite, x, -inf).amax(1)
    has_nan, has_pinf, has_ninf = ((valid & m).any(1) for m in (x.isnan(), x == inf, x == -inf))
    special = has_nan | has_pinf | has_ninf
    fmin = torch.where(fmin < inf, fmin, 0.0) + 0.0  # -0 as +0, as the kernel (any reduction order)
    fmax = torch.where(fmax > -inf, fmax, 0.0) + 0.0
    lo = torch.where(special, 0.0, fmin)
    hi = torch.where(special, torch.maximum(-fmin, fmax) + 0.0, fmax)

    base = torch.where(special, -hi, lo)
    scale = torch.where(hi - base <= FLT_MAX, 1.0, 0.25)
    a0 = base * scale
    span = hi * scale - a0
    r = torch.where(span > 0, (FRACTION / torch.where(span > 0, span, 1.0)).clamp(max=FLT_MAX), 0.0)
    v = ((x * scale[:, None] - a0[:, None]) * r[:, None]).clamp(max=FRACTION)
    u = torch.where(finite, v + 0.5, 0.0).to(torch.int32)
    count = valid.sum(1, dtype=torch.int32).clamp(min=1)
    c16 = torch.div(u.sum(1, dtype=torch.int32) + count // 2, count, rounding_mode="floor").clamp(max=65535)
    e = ((u - c16[:, None]).abs() + 32) >> DEV_SHIFT
    squares = torch.where(finite, e * e, 0).sum(1, dtype=torch.int32)
    var = squares.float() / count.float()
    # float64's square root rounded to float32 is IEEE's float32 square root (the kernels' sqrt_rn); torch's own
    # float32 sqrt on a CPU may be a unit in the last place off.
    d16 = (var.double().sqrt().float() * 64.0 + 0.5).to(torch.int32).clamp(max=65535)
    c16 = torch.where(special, 0, c16)
    d16 = torch.where(special, 0, d16)

    kind = torch.where(has_nan | (has_pinf & has_ninf), 0x7FC00000, torch.where(has_pinf, 0x7F800000, -0x800000))
    word0 = torch.where(special, kind.to(torch.int32), lo.view(torch.int32))
    word2 = (c16.long() | (d16.long() << 16)).to(torch.int32)
    return torch.stack([word0, hi.view(torch.int32), word2], dim=1)


def _segments(x: torch.Tensor, meta: torch.Tensor, bits: int):
    """Per element (``[n_groups, group_size]``): scaled value, segment origin, step, first code, intervals, and
    the group's scale, from the metadata."""
    lo, hi, c16, d16, special, _ = _unpack_meta(meta)
    scale, (a0, a1, a2), steps, (j1, j2), counts = _torch_knots(lo, hi, c16, d16, special, bits)
    xs = x * scale[:, None]
    up, mid = xs >= a2[:, None], xs >= a1[:, None]

    def pick(k2, k1, k0):
        return torch.where(up, k2[:, None], torch.where(mid, k1[:, None], k0[:, None]))

    zero = torch.zeros_like(j1)
    return xs, pick(a2, a1, a0), pick(*steps[::-1]), pick(j2, j1, zero), pick(*counts[::-1]), scale


def _codes(x, meta, bits, one_plus_u):
    """Codes (int32, ``[n_groups, group_size]``) of the padded groups ``x``: ``one_plus_u`` the noise."""
    xs, origin, step, first, count, _ = _segments(x, meta, bits)
    inv = torch.where(step > 0, 1.0 / torch.where(step > 0, step, 1.0), 0.0)
    s = torch.minimum((xs - origin) * inv + one_plus_u, (count + 1).float())
    fin = torch.isfinite(x)
    s = torch.where(fin, s, 1.0)
    return torch.where(fin, first + s.to(torch.int32) - 1, (1 << bits) - 1)


def _levels(q: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 levels of codes ``q`` (``[n_groups, group_size]``), before any saturation, non-finite codes as the
    group's non-finite value: what :func:`torch_normal_dequantize` writes, unsaturated."""
    lo, hi, c16, d16, special, kind = _unpack_meta(meta)
    scale, (a0, a1, a2), (s0, s1, s2), (j1, j2), _ = _torch_knots(lo, hi, c16, d16, special, bits)
    up, mid = q >= j2[:, None], q >= j1[:, None]

    def pick(k2, k1, k0):
        return torch.where(up, k2[:, None], torch.where(mid, k1[:, None], k0[:, None]))

    origin, step = pick(a2, a1, a0), pick(s2, s1, s0)
    start = pick(j2, j1, torch.zeros_like(j1))
    value = ((q - start).float() * step + origin) * torch.where(scale < 1, 4.0, 1.0)[:, None]
    return value, special[:, None] & (q == (1 << bits) - 1), kind[:, None]


def _padded(flat: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = flat.numel()
    n_groups = -(-n // group_size)
    x = torch.nn.functional.pad(flat.float(), (0, n_groups * group_size - n)).view(n_groups, group_size)
    index = torch.arange(n_groups * group_size, device=flat.device).view(n_groups, group_size)
    return x, index < n


def torch_normal_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of :func:`triton_normal_quantize` and of the C++ kernels (the CPU path where those cannot be
    built): same contract, same arithmetic; the noise from ``torch.rand`` of a ``torch.Generator`` seeded with
    ``seed``."""
    assert bits in NORMAL_BITS
    if flat.numel() == 0:
        return _allocate(0, bits, group_size, flat.device)
    x, valid = _padded(flat, group_size)
    meta = _encode_meta(x, valid)
    if stochastic:
        gen = torch.Generator(device=flat.device).manual_seed(seed)
        one_plus_u = 1.0 + torch.rand(x.shape, generator=gen, device=flat.device)
    else:
        one_plus_u = 1.5
    q = torch.where(valid, _codes(x, meta, bits, one_plus_u), 0)
    return pack_planes(q, bits), meta


def torch_normal_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """The reference of :func:`triton_normal_dequantize` and of the C++ kernels (the CPU path where those cannot be
    built)."""
    if meta.shape[0] == 0:
        return torch.empty(n, dtype=dtype, device=codes.device)
    value, non_finite, kind = _levels(unpack_planes(codes, bits, group_size), meta, bits)
    out_max = torch.finfo(dtype).max
    value = torch.where(non_finite, kind, value.clamp(-out_max, out_max))
    return value.view(-1)[:n].to(dtype)


def normal_levels(flat: torch.Tensor, bits: int, group_size: int):
    """``(x, below, above, live)``, each ``[n_groups, group_size]``: the padded groups in float32, the two levels
    between which stochastic rounding puts each element (decoded as float32, saturated at FLT_MAX) from the
    metadata the quantizer stores, and which elements are real and finite. For ``variance.py``."""
    x, valid = _padded(flat, group_size)
    meta = _encode_meta(x, valid)
    q = _codes(x, meta, bits, 1.0)  # u = 0: the level below
    top = (1 << bits) - 1
    below, _, _ = _levels(q, meta, bits)
    above, _, _ = _levels(torch.clamp(q + 1, max=top), meta, bits)
    return x, below.clamp(-FLT_MAX, FLT_MAX), above.clamp(-FLT_MAX, FLT_MAX), valid & torch.isfinite(x)
