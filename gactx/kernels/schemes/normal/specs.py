"""The normal scheme's kernels as ``aot.py`` compiles them: read like the uniform scheme's, with 12 bytes of int32
metadata a group."""

from __future__ import annotations

from gactx.kernels.schemes.normal.format import NORMAL_BITS
from gactx.kernels.schemes.normal.triton import (
    _normal_dequantize_kernel,
    _normal_quantize_kernel,
    normal_dequantize_launch,
    normal_quantize_launch,
)
from gactx.kernels.schemes.uniform.specs import code_specs, decode_specs

__all__ = ["SPECS"]

SPECS = {  # family -> specs, narrowed to some widths
    "normal_quantize": lambda bits=None: code_specs(
        "normal_quantize", _normal_quantize_kernel, normal_quantize_launch, NORMAL_BITS, "*i32", 12, bits
    ),
    "normal_dequantize": lambda bits=None: decode_specs(
        "normal_dequantize", _normal_dequantize_kernel, normal_dequantize_launch, NORMAL_BITS, "*i32", 12, bits
    ),
}
