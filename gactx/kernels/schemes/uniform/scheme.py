"""The uniform scheme's registry entry (the scheme: ``__init__.py``)."""

from __future__ import annotations

import torch

from gactx.kernels.format import FLOAT_DTYPES, expected_nbytes
from gactx.kernels.functional import quantize
from gactx.kernels.schemes import CODE_WIDTHS, Choice, Measured, Scheme
from gactx.kernels.variance import estimated_variances

__all__ = ["UniformScheme"]

_CHOICES = tuple(Choice(b) for b in CODE_WIDTHS)  # what measure keys its widths by, made once


class UniformScheme(Scheme):
    name = "uniform"

    def measure(self, x, flat, group_size, sketchable) -> Measured:
        return Measured(_CHOICES, estimated_variances(flat, CODE_WIDTHS, group_size, "uniform"))

    def nbytes(self, shape, dtype, choice, group_size) -> int:
        return expected_nbytes(torch.Size(shape).numel(), dtype, choice.bits, group_size)

    def encode(self, t, choice, seed, group_size, stochastic, backend, sketchable):
        if t.dtype not in FLOAT_DTYPES:
            return None
        return quantize(t, choice.bits, group_size, stochastic=stochastic, seed=seed, backend=backend)

    def label(self, choice: Choice) -> str:
        return str(choice.bits)

    def form(self, choice: Choice) -> str:
        return ""

    def kernel_specs(self) -> dict:
        from gactx.kernels.schemes.uniform.specs import SPECS

        return SPECS
