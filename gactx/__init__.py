"""gactx: activation-compressed training for any PyTorch model.

``gactx.Controller(model, level="L1").install_hook()`` compresses every tensor autograd saves for backward;
``gactx.quantize`` / ``gactx.dequantize`` are the kernels underneath.
"""

from gactx import _versions  # noqa: F401  (first: an unsupported torch is refused before anything uses it)
from gactx.config import Config, get_optimization_level, set_optimization_level
from gactx.controller import (
    Adaptation,
    Choice,
    Controller,
    Decision,
    Key,
    KeyRecord,
    MemoryStats,
    Plan,
    Slot,
    SlowAdaptationWarning,
)
from gactx.kernels import ALLOWED_BITS, GROUP_SIZES, QuantizedTensor, dequantize, expected_nbytes, quantize
from gactx.memory import PeakMemory, peak_memory

__version__ = "0.1.0"

__all__ = [
    "ALLOWED_BITS",
    "GROUP_SIZES",
    "Adaptation",
    "Choice",
    "Config",
    "Controller",
    "Decision",
    "Key",
    "KeyRecord",
    "MemoryStats",
    "Plan",
    "PeakMemory",
    "QuantizedTensor",
    "Slot",
    "SlowAdaptationWarning",
    "__version__",
    "dequantize",
    "expected_nbytes",
    "get_optimization_level",
    "peak_memory",
    "quantize",
    "set_optimization_level",
]
