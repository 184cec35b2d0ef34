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
- :func:`tick` is the same counter with a token: each time a compiled graph runs the op, the listener
  registered for the token (:func:`new_token`) is told, on the host, in the graph's order, and shown the
  tensor (its shape, where the graph's shapes are dynamic) and the count it returns (a graph that saves the
  count holds it until its backward has run). That is how a
  controller knows which of a compiled graph's saves ran in a pass, and how often.
- :func:`pack_bool` and :func:`unpack_bool`: a bool tensor as 1 bit an element (8 to a byte, LSB first).
- :func:`kernel_quantize` and :func:`kernel_dequantize` (``gactx::quantize``, ``gactx::dequantize``): the
  format's kernels (Triton on a GPU, C++ on a CPU) as custom ops, opaque to Inductor: a graph calls them as
  it calls a matmul, so nothing of the format is compiled per graph and each runs at its kernel's speed.
  The noise seed of a stochastic quantization is drawn on the host at every call (a counter mixed with the
  caller's salt): a graph draws new noise every step without reading anything back from the device.
  :func:`kernel_pack_bool` and :func:`kernel_unpack_bool` (``gactx::pack_bool``, ``gactx::unpack_bool``) are
  the bit packing's kernels the same way. :func:`kernel_quantize_saved` and :func:`kernel_pack_bool_saved`
  are :func:`tick` and the kernel in one op, so that a graph reads the saved value once.

32-bit multiplications are done on 16-bit halves in int64, so that no product overflows (the low 32 bits of
``h * c`` are ``(h_lo * c + ((h_hi * c) << 16)) mod 2**32``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

from gactx.kernels.dequantize import torch_dequantize
from gactx.kernels.format import QuantizedTensor
from gactx.kernels.functional import dequantize as _dequantize
from gactx.kernels.functional import quantize as _quantize
from gactx.kernels.quantize import _allocate, quantize_groups

__all__ = [
    "quantize",
    "dequantize",
    "uniform_bits",
    "mul32",
    "fmix32",
    "fresh_seed",
    "tick",
    "new_token",
    "pack_bool",
    "unpack_bool",
    "kernel_quantize",
    "kernel_dequantize",
    "kernel_pack_bool",
    "kernel_unpack_bool",
    "kernel_quantize_saved",
    "kernel_pack_bool_saved",
]

_MASK = 0xFFFFFFFF
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The int64 counter on ``device`` that :func:`fresh_seed` and :func:`tick` advance (made once)."""
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS.setdefault(device, torch.zeros((), dtype=torch.int64, device=device))
    return counter


@torch.library.custom_op("gactx::fresh_seed", mutates_args=())
def fresh_seed(like: torch.Tensor) -> torch.Tensor:
    """A new int64 seed on ``like``'s device at every call, eager or inside a compiled graph (the counter
    is advanced on the device: nothing is read back)."""
    counter = _counter(like.device)
    counter.add_(1)
    return mul32(counter * 0x9E3779B9, 1) | (counter << 32)


@fresh_seed.register_fake
def _(like: torch.Tensor) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=like.device)


# A graph captured by CUDA graphs would replay the counter's launch without calling the listener, and draw
# the same noise every step: the op is marked so that Inductor leaves it out of captured regions.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
# The ops that read a saved value take it in any layout: Inductor may then hand them the buffer that holds it
# rather than a copy with the strides the value had when traced.
_SAVED_TAGS = _TAGS + ((torch.Tag.flexible_layout,) if hasattr(torch.Tag, "flexible_layout") else ())
_LISTENERS: dict[int, Callable[[int, torch.Tensor, torch.Tensor], None]] = {}
_TOKENS = itertools.count(1)


def new_token(listener: Callable[[int, torch.Tensor, torch.Tensor], None]) -> int:
    """A token for :func:`tick`: ``listener(token, x, count)`` is called whenever a graph runs
    ``count = tick(x, token)``. A bound method is held weakly (its object may go; the token then does
    nothing)."""
    token = next(_TOKENS)
    if hasattr(listener, "__self__"):
        ref = weakref.WeakMethod(listener)

        def listener(token: int, like: torch.Tensor, count: torch.Tensor, ref=ref) -> None:
            method = ref()
            if method is not None:
                method(token, like, count)

    _LISTENERS[token] = listener
    return token


def _tick(like: torch.Tensor, token: int) -> torch.Tensor:
    count = _counter(like.device).add_(1).clone()
    listener = _LISTENERS.get(token)
    if listener is not None:
        listener(token, like, count)
    return count


@torch.library.custom_op("gactx::tick", mutates_args=(), tags=_TAGS)
def tick(like: torch.Tensor, token: int) -> torch.Tensor:
    """A new int64 count on ``like``'s device (as :func:`fresh_seed`'s counter, nothing read back); tells the
    token's listener that it ran."""
    return _tick(like, token)


@tick.register_fake
def _(like: torch.Tensor, token: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=like.device)


def pack_bool(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor's elements, 8 to a uint8 byte (element ``8 i + j`` in bit ``j`` of byte ``i``)."""
    flat = t.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8)).view(-1, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=t.device)
    return (flat << shifts).sum(1, dtype=torch.uint8)


def unpack_bool(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` elements :func:`pack_bool` packed, as a 1-D bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:n].bool()


def mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for ``h`` an int64 tensor of uint32 values."""
    lo, hi = h & 0xFFFF, h >> 16
    return (lo * c + ((hi * c) << 16)) & _MASK


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer of an int64 tensor of uint32 values (the C++ kernels' ``fmix``)."""
    h = h ^ (h >> 16)
    h = mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_bits(index: torch.Tensor, seed: int | torch.Tensor) -> torch.Tensor:
    """23 uniform bits (int64) an element of ``index`` (int64 positions), as the C++ kernels draw them."""
    k0, k1 = seed & _MASK, (seed >> 32) & _MASK  # an int or an int64 tensor
    h = fmix32(mul32(index & _MASK, 0x9E3779B9) ^ k0)
    h = fmix32(h ^ k1 ^ mul32(index >> 32, 0x85EBCA77))
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


_DRAWS = itertools.count(1)


def _kernel_codes(flat, bits, group_size, stochastic, salt, backend) -> tuple[torch.Tensor, torch.Tensor]:
    seed = ((next(_DRAWS) * 0x9E3779B97F4A7C15) ^ (salt * 0xC2B2AE3D27D4EB4F)) & ((1 << 62) - 1)
    q = _quantize(flat, bits, group_size, stochastic=stochastic, seed=seed, backend=backend)
    return q.data, q.meta


def _kernel_bits(flat: torch.Tensor, backend: str) -> torch.Tensor:
    return _quantize(flat, 1, backend=backend).data


def _bits_like(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(-(-t.numel() // 8), dtype=torch.uint8)


@torch.library.custom_op("gactx::quantize", mutates_args=())
def kernel_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, salt: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, meta)`` of a contiguous 1-D float tensor by the format's kernel for ``backend``; a new noise
    seed at every call (``salt`` tells callers apart)."""
    return _kernel_codes(flat, bits, group_size, stochastic, salt, backend)


@kernel_quantize.register_fake
def _(flat, bits, group_size, stochastic, salt, backend):
    return _allocate(flat, bits, group_size)


@torch.library.custom_op("gactx::dequantize", mutates_args=())
def kernel_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype, backend: str
) -> torch.Tensor:
    """The ``n`` elements of ``dtype`` that :func:`kernel_quantize` encoded, as a 1-D tensor."""
    size = torch.Size([n])
    q = QuantizedTensor(codes, meta, bits, group_size, size, dtype, size, None)
    return _dequantize(q, backend=backend)


@kernel_dequantize.register_fake
def _(codes, meta, bits, group_size, n, dtype, backend):
    return codes.new_empty(n, dtype=dtype)


@torch.library.custom_op("gactx::quantize_saved", mutates_args=(), tags=_SAVED_TAGS)
def kernel_quantize_saved(
    t: torch.Tensor, bits: int, group_size: int, stochastic: bool, salt: int, backend: str, token: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tick` and :func:`kernel_quantize` of ``t`` (any shape, flattened) in one op: ``(codes, meta,
    count)``. One op reading the saved value: Inductor copies a view of a value it has not stored yet into a
    buffer of its own for each opaque op that reads it, so two ops held two full-size copies at once."""
    count = _tick(t, token)
    codes, meta = _kernel_codes(t.reshape(-1), bits, group_size, stochastic, salt, backend)
    return codes, meta, count


@kernel_quantize_saved.register_fake
def _(t, bits, group_size, stochastic, salt, backend, token):
    codes, meta = _allocate(t.reshape(-1), bits, group_size)
    return codes, meta, torch.empty((), dtype=torch.int64, device=t.device)


@torch.library.custom_op("gactx::pack_bool_saved", mutates_args=(), tags=_SAVED_TAGS)
def kernel_pack_bool_saved(t: torch.Tensor, backend: str, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tick` and :func:`kernel_pack_bool` of a bool ``t`` (any shape, flattened) in one op:
    ``(packed, count)``."""
    count = _tick(t, token)
    return _kernel_bits(t.reshape(-1), backend), count


@kernel_pack_bool_saved.register_fake
def _(t, backend, token):
    return _bits_like(t), torch.empty((), dtype=torch.int64, device=t.device)


@torch.library.custom_op("gactx::pack_bool", mutates_args=())
def kernel_pack_bool(flat: torch.Tensor, backend: str) -> torch.Tensor:
    """A contiguous 1-D bool tensor packed 8 to a byte by the format's kernel for ``backend``. Opaque to
    Inductor, so the mask is made once: traced (:func:`pack_bool`), a mask no other output holds (a dropout's)
    is recomputed, random draws included, in each kernel that reads it."""
    return _kernel_bits(flat, backend)


@kernel_pack_bool.register_fake
def _(flat, backend):
    return _bits_like(flat)


@torch.library.custom_op("gactx::unpack_bool", mutates_args=())
def kernel_unpack_bool(packed: torch.Tensor, n: int, backend: str) -> torch.Tensor:
    """The ``n`` bools :func:`kernel_pack_bool` packed, as a 1-D tensor."""
    size = torch.Size([n])
    return _dequantize(QuantizedTensor(packed, None, 1, 256, size, torch.bool, size, None), backend=backend)


@kernel_unpack_bool.register_fake
def _(packed, n, backend):
    return packed.new_empty(n, dtype=torch.bool)
