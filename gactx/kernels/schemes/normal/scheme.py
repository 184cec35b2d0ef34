"""Normal-fitted levels: codes on levels placed at the quantiles of each group's fitted normal, stochastic rounding
between them (this folder: ``format.py``, ``triton.py``, ``reference.py``, ``normal.cpp``): a bell-shaped group errs
less than on a uniform grid at the same width. Widths :data:`~gactx.kernels.schemes.normal.NORMAL_BITS`."""

from __future__ import annotations

import torch

from gactx.kernels.format import FLOAT_DTYPES, expected_nbytes
from gactx.kernels.functional import quantize
from gactx.kernels.schemes import Choice, Measured, Scheme
from gactx.kernels.schemes.normal.format import NORMAL_BITS
from gactx.kernels.variance import estimated_variances

__all__ = ["NormalScheme"]

_CHOICES = tuple(Choice(b, "normal") for b in NORMAL_BITS)  # what measure keys its widths by, made once


class NormalScheme(Scheme):
    name = "normal"

    def measure(self, x, flat, group_size, sketchable) -> Measured:
        return Measured(_CHOICES, estimated_variances(flat, NORMAL_BITS, group_size, "normal"))

    def nbytes(self, shape, dtype, choice, group_size) -> int:
        return expected_nbytes(torch.Size(shape).numel(), dtype, choice.bits, group_size, scheme="normal")

    def encode(self, t, choice, seed, group_size, stochastic, backend, sketchable):
        if t.dtype not in FLOAT_DTYPES:
            return None
        return quantize(t, choice.bits, group_size, stochastic=stochastic, seed=seed, backend=backend, scheme="normal")

    def kernel_specs(self) -> dict:
        from gactx.kernels.schemes.normal.specs import SPECS

        return SPECS
