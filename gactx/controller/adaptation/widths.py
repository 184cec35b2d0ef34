"""The variance model of a width: ``S(b)``, the gradient variance per unit of sensitivity that storing a tensor at
``b`` bits adds (``allocator.py``'s docstring), and the widths worth choosing for a dtype."""

from __future__ import annotations

import torch

from gactx.kernels.format import as_is_width

__all__ = ["WIDTHS", "variance_factor", "widths_for"]

WIDTHS = (1, 2, 4, 8, 16, 32)


def variance_factor(bits: int, dtype: torch.dtype = torch.float32) -> float:
    """``S(b)``: the gradient variance per unit of sensitivity that ``bits`` adds (``allocator.py``'s docstring)."""
    if as_is_width(bits, dtype):
        return 0.0
    if bits == 16:
        return variance_factor(8) / 16
    return 1.0 / ((1 << bits) - 1) ** 2


def widths_for(dtype: torch.dtype) -> tuple[int, ...]:
    """Widths worth choosing for ``dtype``: for fp16/bf16, 16 is already "as is", so 32 adds nothing."""
    return WIDTHS if dtype == torch.float32 else WIDTHS[:-1]
