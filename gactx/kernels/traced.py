"""The format in torch ops that trace: quantize and dequantize for ``torch.compile`` graphs.

Compressing inside a compiled graph (saved-tensor hooks given as ``torch.fx.GraphModule``s are inlined by
AOTAutograd into the forward and backward graphs) needs the format written in ops that trace and that
Inductor fuses: no ``torch.Generator`` (it does not trace), no host reads, no data-dependent shapes.

- :func:`quantize` is the twin's arithmetic (``quantize.quantize_groups``), so with ``stochastic=False`` its
  bytes are the twin's and the Triton kernel's.
- With ``stochastic=True`` the noise is the C++ kernels' (``cpu.py``): murmur3's finalizer of (seed, element
  index), twice, 23 bits a draw; so a compiled graph and an eager step on a CPU store the same bytes for the
  same seed. The seed may be a tensor (an int64 scalar on the tensor's device): a graph that reads it at run
  time draws new noise every step without recompiling.
- :func:`dequantize` is the twin's.
- :func:`fresh_seed` is a seed that a compiled graph reads at run time: a custom op (``gactx::fresh_seed``)
  that advances a counter on the tensor's device and returns it, with no host synchronization. A seed made
  while tracing (``torch.tensor(5)``) would be a constant of the graph, and the noise would repeat every step.

32-bit multiplications are done on 16-bit halves in int64, so that no product overflows (the low 32 bits of
``h * c`` are ``(h_lo * c + ((h_hi * c) << 16)) mod 2**32``).
"""

from __future__ import annotations

import torch

from gactx.kernels.dequantize import torch_dequantize
from gactx.kernels.quantize import quantize_groups

__all__ = ["quantize", "dequantize", "uniform_bits", "fresh_seed"]

_MASK = 0xFFFFFFFF
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@torch.library.custom_op("gactx::fresh_seed", mutates_args=())
def fresh_seed(like: torch.Tensor) -> torch.Tensor:
    """A new int64 seed on ``like``'s device at every call, eager or inside a compiled graph (the counter
    is advanced on the device: nothing is read back)."""
    counter = _COUNTERS.get(like.device)
    if counter is None:
        counter = _COUNTERS.setdefault(like.device, torch.zeros((), dtype=torch.int64, device=like.device))
    counter.add_(1)
    return _mul32(counter * 0x9E3779B9, 1) | (counter << 32)


@fresh_seed.register_fake
def _(like: torch.Tensor) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=like.device)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for ``h`` an int64 tensor of uint32 values."""
    lo, hi = h & 0xFFFF, h >> 16
    return (lo * c + ((hi * c) << 16)) & _MASK


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_bits(index: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """23 uniform bits (int64) an element of ``index`` (int64 positions), as the C++ kernels draw them."""
    k0, k1 = seed & _MASK, (seed >> 32) & _MASK  # an int or an int64 tensor
    h = _fmix(_mul32(index & _MASK, 0x9E3779B9) ^ k0)
    h = _fmix(h ^ k1 ^ _mul32(index >> 32, 0x85EBCA77))
    return h >> 9


def quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int | torch.Tensor = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, meta)`` of a 1-D float tensor, in the format of ``format.py``."""
    noise = None
    if stochastic:

        def noise(index: torch.Tensor) -> torch.Tensor:
            return (uniform_bits(index, seed) | 0x3F800000).to(torch.int32).view(torch.float32)

    return quantize_groups(flat, bits, group_size, noise)


def dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """Decode ``n`` elements of ``dtype`` from ``(codes, meta)`` (the twin: it traces as it is)."""
    return torch_dequantize(codes, meta, bits, group_size, n, dtype)
