"""The uniform scheme: each group's values on a grid of ``2**bits`` levels over its min-max range, stochastic
rounding; every allocated tensor may take it, and GACT's variance model ``S(b)`` is its error.

``format.py`` is the arithmetic (its specification, in its docstring; the layout of the bytes is
``gactx/kernels/format.py``'s), ``quantize.py`` and ``dequantize.py`` the GPU kernels, ``reference.py`` the torch
twins they are tested against, ``uniform.cpp`` the CPU kernels (built with ``gactx/kernels/csrc``), ``traced.py``
the scheme in ops that trace (compiled graphs), ``specs.py`` its kernels' ahead-of-time compile specs and
``scheme.py`` the registry's entry."""

from gactx.kernels.schemes.uniform.dequantize import dequantize_launch, triton_dequantize
from gactx.kernels.schemes.uniform.format import FLT_MAX, MIN_STEP, SAFETY, allocate, step_factor
from gactx.kernels.schemes.uniform.quantize import quantize_launch, triton_quantize
from gactx.kernels.schemes.uniform.reference import quantize_groups, torch_dequantize, torch_quantize

__all__ = [
    "FLT_MAX", "MIN_STEP", "SAFETY", "allocate", "dequantize_launch", "quantize_groups", "quantize_launch",
    "step_factor", "torch_dequantize", "torch_quantize", "triton_dequantize", "triton_quantize",
]  # fmt: skip
