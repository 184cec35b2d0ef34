"""gactx: activation-compressed training for any PyTorch model."""

from gactx.kernels import ALLOWED_BITS, GROUP_SIZES, QuantizedTensor, dequantize, expected_nbytes, quantize

__version__ = "0.1.0"

__all__ = ["ALLOWED_BITS", "GROUP_SIZES", "QuantizedTensor", "dequantize", "expected_nbytes", "quantize", "__version__"]
