"""The uniform scheme's arithmetic: per-group codes of 1, 2, 4 or 8 bits (the layout of the bytes:
``gactx/kernels/format.py``).

For a group with finite values in ``[min, max]`` and ``L = 2**bits - 1``::

    step = max((max - min) * f, 2**-126)                  # fp32, f = (1 + 2**-20) / L rounded to fp32: the
                                                          # margin keeps (x - min) / step < L
    inv  = 1 / step                                       # once a group (IEEE division), not once an element
    q    = trunc((x - min) * inv + (1 + u)) - 1           # u ~ U[0, 1): E[q * step + min] = x (unbiased)
                                                          # u = 1/2 with stochastic=False (round half up)

The margin costs 2**-19 of variance and guarantees that no code is clamped, so the rounding stays unbiased.
``(x - min) * inv + (1 + u)`` lies in ``[1, L + 2)``, where truncation is floor. The step is at least the
smallest normal float32, so that ``inv`` is finite; a group whose range is smaller than that (values within
a few subnormal ulps of each other) is rounded, still unbiasedly, on that coarser grid. A group of identical
values has step 0 and decodes exactly. ``u`` has 23 random bits (Philox in Triton, ``torch.rand`` in torch).

At the edges of the float32 range, ``max - min`` overflows to inf when a group holds values of both signs more
than FLT_MAX apart (each end then at least ``2**103`` from zero: ``-2e38`` and ``2e38``, say). Such a group gets
the same grid, computed with no intermediate that overflows::

    step = max * f - min * f                              # each product below FLT_MAX when L >= 3 (f < 1/2)
    q    = trunc((x * s - min * s) * inv + (1 + u)) - 1   # s = 1/4, inv = 1 / (step * s): a quarter of the
                                                          # values, and 1 / (step / 4) stays a normal float

Every other group computes ``s = 1`` and ``x * 1`` is exact, so its bytes are those of the first formulas. The
margin covers the roundings of the new form too: no code passes ``L``. Two bounded exceptions to unbiasedness,
both at the top of the range: at 1 bit (``f > 1``) such a group's step is clamped to FLT_MAX, the largest the
metadata holds, and its elements more than FLT_MAX above ``min`` take the top code, ``min + FLT_MAX``: rounded
down, but within a step. And a level above FLT_MAX (the margin can put the top one there) decodes to FLT_MAX
(below), which moves the mean of an element between it and the level below by less than the
margin, ``L * 2**-20`` of a step. A finite input always decodes to a finite value within one step of it.

Groups that hold NaN or +-Inf (see ``format.py``): finite elements are quantized on a grid of ``L`` levels
centred on zero, ``step = 2 * max|x| / (L - 1)`` and ``q = trunc(x * inv + c + 1 + u) - 1`` with
``c = (L - 1) // 2``, unbiased for ``bits >= 2``; at 1 bit they have one level, zero. Their non-finite
elements get the top code and come back as the group's non-finite value.

Both implementations compute the same float32 operations in the same order (IEEE division, no fused
multiply-add: the kernel is compiled with ``enable_fp_fusion=False``), so with ``stochastic=False`` they
produce identical bytes. With ``stochastic=True`` the noise differs and only the statistics agree.

Decoding
--------

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

import functools

import numpy as np
import torch

__all__ = ["FLT_MAX", "MIN_STEP", "SAFETY", "allocate", "step_factor"]

# float32 constants shared by both implementations.
SAFETY = 1.0 + 2.0**-20  # step margin, see the module docstring
FLT_MAX = 3.4028234663852886e38
MIN_STEP = 2.0**-126  # smallest normal float32: its reciprocal, 2**126, is finite


@functools.cache
def step_factor(intervals: int) -> float:
    """``(1 + 2**-20) / intervals`` rounded to float32 (0 for no interval): ``step = span * factor``, one
    multiplication a group instead of a division; the margin covers the rounding of the factor."""
    return float(np.float32(SAFETY / intervals)) if intervals else 0.0


def allocate(flat: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = flat.numel()
    n_groups = -(-n // group_size)
    codes = torch.empty(n_groups * group_size * bits // 8, dtype=torch.uint8, device=flat.device)
    meta = torch.empty((n_groups, 2), dtype=torch.float32, device=flat.device)
    return codes, meta
