"""Math on tensors: per-group quantization, bit packing and their inverses. Knows nothing of autograd."""

from gactx.kernels.format import ALLOWED_BITS, CODE_BITS, GROUP_SIZES, QuantizedTensor, expected_nbytes
from gactx.kernels.functional import BACKENDS, dequantize, quantize

__all__ = [
    "ALLOWED_BITS",
    "BACKENDS",
    "CODE_BITS",
    "GROUP_SIZES",
    "QuantizedTensor",
    "dequantize",
    "expected_nbytes",
    "quantize",
]
