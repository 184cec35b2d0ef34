"""The normal scheme's format: levels placed by a normal fitted to each group (after SmaQ). Its kernels:
``triton.py`` (``_normal_quantize_kernel``, ``triton_normal_quantize``, ...), ``reference.py`` (the torch twins,
the oracle), ``normal.cpp`` (the CPU's); ``scheme.py`` is its entry in the storage schemes' registry.

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

Knots, one group, in float32, ``s = 1`` or ``1/4`` where ``hi - lo`` overflows (as ``uniform/format.py``'s scale)::

    a0 = lo * s;  span = hi * s - a0;  unit = span / 65536;  centre = a0 + C * unit;  spread = D * unit
    b1 = centre - K * spread;  b2 = centre + K * spread;  w = (b2 - b1) * (tail / inner)
    lower tail present when b1 - a0 > w;  upper tail when hi * s - b2 > w
    step0 = max((b1 - a0) / tail, 2**-126)        a1 = a0 + n_lower * step0
    step1 = max((end - a1) * f, 2**-126)           a2 = a1 + n_inner * step1   (end = b2, or hi * s when last)
    step2 = max((hi * s - a2) * f', 2**-126)       f, f' = 1 / n, or (1 + 2**-20) / n for the last segment

Each knot is computed from the one before, so a segment's top level is exactly the next one's first; the
last segment's margin (``uniform/format.py``'s) puts the top level at or just above ``hi``. A segment of zero width
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

from gactx.kernels.schemes.uniform.format import step_factor

__all__ = ["META_WORDS", "NORMAL_BITS", "SHAPES", "allocate", "factors", "normal_nbytes"]

NORMAL_BITS = (2, 4, 8)
SHAPES = {2: (0.7, 1), 4: (1.7, 2), 8: (1.8, 28)}  # bits -> (K, intervals a tail): see the module docstring
META_WORDS = 3  # int32 words a group: 12 bytes
FRACTION = 65536.0  # C and D are in 1/65536 of the range
DEV_SHIFT = 6  # deviations summed in units of 64/65536 of the range (1/1024): the sum of squares fits int32
INV_FRACTION = 1.0 / FRACTION
# Quantize keeps each element's fraction U as well as its value through the program (two reductions): with 4
# warps (32 elements a thread) ptxas spills at 128 registers a thread (8-16 bytes, float32) and at 168 (160
# bytes, 16-bit inputs). 8 warps, 16 elements a thread, need 80-116 registers (2 programs an SM) with no limit;
# a limit of 128 made ptxas take all of them, issue 4-7 more instructions an element, and, under Triton 3.7.1's
# ptxas, spill 16-24 bytes (float32, 4 bits).
NORMAL_WARPS = 8


def normal_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of codes and metadata for ``numel`` elements: the uniform payload plus 12 bytes a group."""
    n_groups = -(-numel // group_size)
    return n_groups * group_size * bits // 8 + 4 * META_WORDS * n_groups


def f32(v: float) -> float:
    return float(np.float32(v))


def factors(bits: int) -> dict[str, float]:
    """The float32 factors of the knots: ``1/n`` of a segment that is not last, ``(1 + 2**-20)/n`` of the last."""
    levels = (1 << bits) - 1
    k, tail = SHAPES[bits]
    inner = levels - 2 * tail
    return dict(
        k=f32(k), share=f32(tail / inner), tail=f32(1.0 / tail), last_tail=step_factor(tail),
        inner_both=f32(1.0 / inner), inner_no_lower=f32(1.0 / (inner + tail)),
        last_with_lower=step_factor(inner + tail), last_alone=step_factor(levels), last_special=step_factor(levels - 1),
    )  # fmt: skip


def allocate(n: int, bits: int, group_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    n_groups = -(-n // group_size)
    codes = torch.empty(n_groups * group_size * bits // 8, dtype=torch.uint8, device=device)
    return codes, torch.empty((n_groups, META_WORDS), dtype=torch.int32, device=device)
