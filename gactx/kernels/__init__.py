"""Math on tensors: per-group quantization, bit packing and their inverses. Knows nothing of autograd."""

from gactx.kernels._triton import HAS_TRITON
from gactx.kernels._triton import INTERPRET as TRITON_INTERPRET
from gactx.kernels.format import ALLOWED_BITS, CODE_BITS, GROUP_SIZES, SCHEMES, QuantizedTensor, expected_nbytes
from gactx.kernels.functional import BACKENDS, dequantize, quantize
from gactx.kernels.variance import rounding_variance

TRITON_VERSION: str | None = None  # the installed Triton's version, None where it is not installed
if HAS_TRITON:
    from gactx.kernels._triton import triton as _triton_module

    TRITON_VERSION = _triton_module.__version__

__all__ = [
    "ALLOWED_BITS",
    "BACKENDS",
    "CODE_BITS",
    "GROUP_SIZES",
    "HAS_TRITON",
    "QuantizedTensor",
    "SCHEMES",
    "TRITON_INTERPRET",
    "TRITON_VERSION",
    "dequantize",
    "expected_nbytes",
    "quantize",
    "rounding_variance",
]
