"""Math on tensors: per-group quantization, bit packing and their inverses. Knows nothing of autograd."""

from gactx.kernels.format import ALLOWED_BITS, CODE_BITS, GROUP_SIZES, SCHEMES, QuantizedTensor, expected_nbytes
from gactx.kernels.functional import BACKENDS, dequantize, quantize
from gactx.kernels.variance import rounding_variance

__all__ = [
    "ALLOWED_BITS",
    "BACKENDS",
    "CODE_BITS",
    "GROUP_SIZES",
    "QuantizedTensor",
    "SCHEMES",
    "dequantize",
    "expected_nbytes",
    "quantize",
    "rounding_variance",
]
