"""Ops that trace, for ``torch.compile`` graphs: the run-time counters and bit packing that every scheme's traced
form uses (the uniform scheme's codes: ``schemes/uniform/traced.py``).

Compressing inside a compiled graph (saved-tensor hooks given as ``torch.fx.GraphModule``s are inlined by
AOTAutograd into the forward and backward graphs) needs the format written in ops that trace and that
Inductor fuses: no ``torch.Generator`` (it does not trace), no host reads, no data-dependent shapes.

- :func:`uniform_bits` is the C++ kernels' noise (``cpu.py``): murmur3's finalizer of (seed, element index),
  twice, from an offset (:data:`HASH_OFFSET`), 23 bits a draw. The seed may be a tensor (an int64 scalar on the
  tensor's device): a graph that reads it at run time draws new noise every step without recompiling.
- :func:`fresh_seed` is a seed that a compiled graph reads at run time: a custom op (``gactx::fresh_seed``)
  that advances a counter on the tensor's device and returns it, with no host synchronization. A seed made
  while tracing (``torch.tensor(5)``) would be a constant of the graph, and the noise would repeat every step.
- :func:`tick` is the same counter with a token: each time a compiled graph runs the op, the listener
  registered for the token (:func:`new_token`) is told, on the host, in the graph's order, and shown the
  tensor (its shape, where the graph's shapes are dynamic) and the count it returns (a graph that saves the
  count holds it until its backward has run). That is how a
  controller knows which of a compiled graph's saves ran in a pass, and how often. :func:`advance` is the
  same inside another op (a scheme's saved-value op ticks and encodes in one op).
- :func:`pack_bool` and :func:`unpack_bool`: a bool tensor as 1 bit an element (8 to a byte, LSB first).
  :func:`kernel_pack_bool` and :func:`kernel_unpack_bool` (``gactx::pack_bool``, ``gactx::unpack_bool``) are
  the bit packing's kernels (Triton on a GPU, C++ on a CPU) as custom ops, opaque to Inductor;
  :func:`kernel_pack_bool_saved` is :func:`tick` and the packing in one op, so that a graph reads the saved
  value once.

32-bit multiplications are done on 16-bit halves in int64, so that no product overflows (the low 32 bits of
``h * c`` are ``(h_lo * c + ((h_hi * c) << 16)) mod 2**32``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

from gactx.kernels.format import packed_mask
from gactx.kernels.functional import dequantize as _dequantize
from gactx.kernels.functional import quantize as _quantize

__all__ = [
    "HASH_OFFSET",
    "SAVED_TAGS",
    "advance",
    "fmix32",
    "fresh_seed",
    "kernel_pack_bool",
    "kernel_pack_bool_saved",
    "kernel_unpack_bool",
    "mul32",
    "new_token",
    "pack_bool",
    "tick",
    "uniform_bits",
    "unpack_bool",
]

_MASK = 0xFFFFFFFF
HASH_OFFSET = 0x5BD1E995
"""XORed into the hash's first input (``kHashOffset`` in ``csrc/common.h``): murmur3's finalizer maps 0 to 0, and
without it element 0 (or row 0) of seed 0 would draw zero noise on every call. The hash of a seed is a bijection of
the 32-bit index, so each seed still has one index in 2**32 whose hash is 0 (and 512 whose 23 bits are): at a
pseudo-random place, not at the origin."""
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
SAVED_TAGS = _TAGS + ((torch.Tag.flexible_layout,) if hasattr(torch.Tag, "flexible_layout") else ())
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


def advance(like: torch.Tensor, token: int) -> torch.Tensor:
    """:func:`tick`'s work, inside another custom op: a new count, and the token's listener told."""
    count = _counter(like.device).add_(1).clone()
    listener = _LISTENERS.get(token)
    if listener is not None:
        listener(token, like, count)
    return count


@torch.library.custom_op("gactx::tick", mutates_args=(), tags=_TAGS)
def tick(like: torch.Tensor, token: int) -> torch.Tensor:
    """A new int64 count on ``like``'s device (as :func:`fresh_seed`'s counter, nothing read back); tells the
    token's listener that it ran."""
    return advance(like, token)


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
    h = fmix32(mul32(index & _MASK, 0x9E3779B9) ^ k0 ^ HASH_OFFSET)
    h = fmix32(h ^ k1 ^ mul32(index >> 32, 0x85EBCA77))
    return h >> 9


def _kernel_bits(flat: torch.Tensor, backend: str) -> torch.Tensor:
    return _quantize(flat, 1, backend=backend).data


def _bits_like(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(-(-t.numel() // 8), dtype=torch.uint8)


@torch.library.custom_op("gactx::pack_bool_saved", mutates_args=(), tags=SAVED_TAGS)
def kernel_pack_bool_saved(t: torch.Tensor, backend: str, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tick` and :func:`kernel_pack_bool` of a bool ``t`` (any shape, flattened) in one op:
    ``(packed, count)``."""
    count = advance(t, token)
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
    return _dequantize(packed_mask(packed, n), backend=backend)


@kernel_unpack_bool.register_fake
def _(packed, n, backend):
    return packed.new_empty(n, dtype=torch.bool)
