"""The uniform scheme in ops that trace, for ``torch.compile`` graphs (the run-time counters and bit packing they share
with other schemes: ``gactx/kernels/traced.py``).

- :func:`quantize` is the twin's arithmetic (``reference.quantize_groups``), so with ``stochastic=False`` its bytes
  are the twin's and the Triton kernel's. With ``stochastic=True`` its noise is the C++ kernels'
  (``traced.uniform_bits``), so a compiled graph and an eager step on a CPU store the same bytes for the same seed.
- :func:`dequantize` is the twin's.
- :func:`kernel_quantize` and :func:`kernel_dequantize` (``gactx::quantize``, ``gactx::dequantize``): the scheme's
  kernels (Triton on a GPU, C++ on a CPU) as custom ops, opaque to Inductor: a graph calls them as it calls a
  matmul, so nothing of the format is compiled per graph and each runs at its kernel's speed. The noise seed of a
  stochastic quantization is drawn on the host at every call (a counter mixed with the caller's salt): a graph
  draws new noise every step without reading anything back from the device. :func:`kernel_quantize_saved` is
  ``traced.tick`` and the kernel in one op, so that a graph reads the saved value once.
"""

from __future__ import annotations

import itertools

import torch

from gactx.kernels.functional import choose_backend, dequantize_flat, quantize_flat
from gactx.kernels.schemes.uniform.format import allocate
from gactx.kernels.schemes.uniform.reference import quantize_groups, torch_dequantize
from gactx.kernels.traced import SAVED_TAGS, advance, uniform_bits

__all__ = ["dequantize", "kernel_dequantize", "kernel_quantize", "kernel_quantize_saved", "quantize"]


def quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int | torch.Tensor = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, meta)`` of a 1-D float tensor, in the format of ``gactx/kernels/format.py``."""
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


_DRAWS = itertools.count(1)


def _kernel_codes(t, bits, group_size, stochastic, salt, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes of ``t``'s elements in memory order (``functional.quantize_flat``: its arguments are gactx's own, so
    not checked again at every call), with a new seed."""
    seed = ((next(_DRAWS) * 0x9E3779B97F4A7C15) ^ (salt * 0xC2B2AE3D27D4EB4F)) & ((1 << 62) - 1)
    return quantize_flat(t, bits, group_size, stochastic, seed, choose_backend(t, backend))


@torch.library.custom_op("gactx::quantize", mutates_args=())
def kernel_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, salt: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, meta)`` of a contiguous 1-D float tensor by the format's kernel for ``backend``; a new noise
    seed at every call (``salt`` tells callers apart)."""
    return _kernel_codes(flat, bits, group_size, stochastic, salt, backend)


@kernel_quantize.register_fake
def _(flat, bits, group_size, stochastic, salt, backend):
    return allocate(flat, bits, group_size)


@torch.library.custom_op("gactx::dequantize", mutates_args=())
def kernel_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype, backend: str
) -> torch.Tensor:
    """The ``n`` elements of ``dtype`` that :func:`kernel_quantize` encoded, as a 1-D tensor."""
    return dequantize_flat(codes, meta, bits, group_size, (n,), dtype, choose_backend(codes, backend))


@kernel_dequantize.register_fake
def _(codes, meta, bits, group_size, n, dtype, backend):
    return codes.new_empty(n, dtype=dtype)


@torch.library.custom_op("gactx::quantize_saved", mutates_args=(), tags=SAVED_TAGS)
def kernel_quantize_saved(
    t: torch.Tensor, bits: int, group_size: int, stochastic: bool, salt: int, backend: str, token: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tick` and :func:`kernel_quantize` of ``t`` (any shape, flattened) in one op: ``(codes, meta,
    count)``. One op reading the saved value: Inductor copies a view of a value it has not stored yet into a
    buffer of its own for each opaque op that reads it, so two ops held two full-size copies at once."""
    count = advance(t, token)
    codes, meta = _kernel_codes(t, bits, group_size, stochastic, salt, backend)
    return codes, meta, count


@kernel_quantize_saved.register_fake
def _(t, bits, group_size, stochastic, salt, backend, token):
    codes, meta = allocate(t.reshape(-1), bits, group_size)
    return codes, meta, torch.empty((), dtype=torch.int64, device=t.device)
