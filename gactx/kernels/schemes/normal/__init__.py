"""The normal scheme: levels placed by a normal fitted to each group (after SmaQ). ``format.py`` is the format (and
its specification, in its docstring), ``triton.py`` the GPU kernels, ``reference.py`` the torch twins they are tested
against, ``normal.cpp`` the CPU kernels (built with ``gactx/kernels/csrc``), ``scheme.py`` the registry's entry."""

from gactx.kernels.schemes.normal.format import META_WORDS, NORMAL_BITS, SHAPES, factors, normal_nbytes
from gactx.kernels.schemes.normal.reference import normal_levels, torch_normal_dequantize, torch_normal_quantize
from gactx.kernels.schemes.normal.triton import (
    normal_dequantize_launch,
    normal_quantize_launch,
    triton_normal_dequantize,
    triton_normal_quantize,
)

__all__ = [
    "META_WORDS", "NORMAL_BITS", "SHAPES", "factors", "normal_dequantize_launch", "normal_levels", "normal_nbytes",
    "normal_quantize_launch", "torch_normal_dequantize", "torch_normal_quantize", "triton_normal_dequantize",
    "triton_normal_quantize",
]  # fmt: skip
