"""The compressed format: what a :class:`QuantizedTensor` holds and how many bytes that is.

A tensor is read in memory order (a channels_last or transposed tensor is not copied first; see
:func:`memory_order`) and cut into groups of ``group_size`` consecutive elements; the last group may be
short. Each group keeps two float32 numbers, ``(lo, step)``, and one ``b``-bit code per element, packed
into uint8 in planes: a group of ``G`` elements is ``P = 8 / b`` planes of ``G / P`` consecutive elements,
and byte ``k`` of the group holds element ``k`` of each plane, plane 0 in the lowest bits::

    bits = 2, G = 32: four planes of 8 elements      bits = 4, G = 32: two planes of 16 elements
    byte k, bit:  7  6 |  5  4 |  3  2 | 1  0         byte k, bit:  7  6  5  4 | 3  2  1  0
               [ e24+k | e16+k | e8+k  | ek  ]                   [   e16+k    |    ek     ]

    payload: numel rounded up to whole groups, times bits / 8 bytes, groups back to back (a group of 256
             at 2 bits is 64 bytes; the codes past the end of a short last group are 0)
    meta:    float32 [n_groups, 2] = (lo, step), 8 bytes a group: 0.25 bit/element at group_size 256

Planes, not neighbours, share a byte so that a GPU thread holding a run of consecutive elements of each
plane packs and unpacks whole bytes in its own registers (``schemes/uniform/quantize.py``).

A code ``q`` decodes to ``q * step + lo``. float32 metadata is exact for any input dtype and range, so
quantizing against the stored values keeps stochastic rounding unbiased (see ``schemes/uniform/format.py``). At
the edges of the range: a group whose span ``max - min`` overflows float32 (values of both signs more than
FLT_MAX apart) keeps the same ``(lo, step)`` meaning, computed without overflow, and is decoded on halves where
``q * step`` would overflow (both in ``schemes/uniform/format.py``); at 1 bit its step is clamped to FLT_MAX, and
its elements more than that above ``lo`` take the top code. Decoded finite values saturate at the largest finite
value of the output dtype, so a finite input comes back finite and within one step.

A group holding NaN or +-Inf is marked by a non-finite ``lo``: its top code ``2**bits - 1`` stands for
that value (NaN when the group mixes NaN or both infinities), and its finite elements use the other
codes on a grid centred on zero, ``(q - (2**bits - 2) / 2) * step``. Non-finite values therefore come
back non-finite, at their places; see ``schemes/uniform/format.py`` for what that costs the finite ones.

A second scheme, ``"normal"`` (``normal.py``), packs its codes in the same planes and keeps 12 bytes a group,
int32 ``[n_groups, 3]``: the float32 bits of ``lo`` and ``hi`` and two 16-bit fractions of the range (the
group's mean and standard deviation), from which both sides compute the same levels. It takes 2, 4 and 8 bits.

Widths 16 and 32 and bool masks need no metadata: 16 keeps fp16/bf16 tensors as they are and stores
float32 as bfloat16 (same exponent range; the finite float32 values above bfloat16's largest finite value,
about 3.3895e38, saturate to it, see ``half.py``); 32 keeps the tensor itself; a bool mask is packed at 1 bit
per element, losslessly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "ALLOWED_BITS",
    "CODE_BITS",
    "SCHEMES",
    "SCHEME_BITS",
    "GROUP_SIZES",
    "FLOAT_DTYPES",
    "QuantizedTensor",
    "packed_mask",
    "as_is_width",
    "expected_nbytes",
    "memory_order",
    "contiguous_order",
    "contiguous_strides",
    "restore_order",
    "restore_perm",
    "check_args",
    "check_scheme",
    "pack_planes",
    "unpack_planes",
]

CODE_BITS = (1, 2, 4, 8)
ALLOWED_BITS = (*CODE_BITS, 16, 32)
# Powers of two: Triton blocks must be, and a group of at least 32 fills whole bytes at 1 bit.
GROUP_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
META_BYTES_PER_GROUP = 8  # (lo, step) as float32
SCHEMES = ("uniform", "normal")
# Widths each scheme takes. "normal" refuses 1 bit: its two levels would be the group's min and max, the
# uniform grid, with 4 more bytes of metadata; and 16 and 32 store values, not codes.
SCHEME_BITS = {"uniform": ALLOWED_BITS, "normal": (2, 4, 8)}
SCHEME_META_BYTES = {"uniform": META_BYTES_PER_GROUP, "normal": 12}  # normal: lo, hi float32 + 2 x 16 bits


@dataclass(frozen=True, eq=False, init=False)
class QuantizedTensor:
    """A compressed tensor. Build it with :func:`gactx.quantize`; read it back with :func:`gactx.dequantize`.

    ``data`` is the packed payload (uint8 codes or bits), the bf16 copy (16 bits from float32), or the
    tensor itself (32 bits, and 16 bits from fp16/bf16). ``meta`` is the per-group ``(lo, step)`` table,
    ``None`` where there is none. ``dense_shape`` and ``perm`` say how memory order maps back to ``shape``.
    ``scheme`` says where the levels are: ``"uniform"`` (``(lo, step)``) or ``"normal"`` (``normal.py``).
    """

    data: torch.Tensor
    meta: torch.Tensor | None
    bits: int
    group_size: int
    shape: torch.Size
    dtype: torch.dtype
    dense_shape: torch.Size
    perm: tuple[int, ...] | None
    scheme: str = "uniform"

    def __init__(
        self, data: torch.Tensor, meta: torch.Tensor | None, bits: int, group_size: int, shape: torch.Size,
        dtype: torch.dtype, dense_shape: torch.Size, perm: tuple[int, ...] | None, scheme: str = "uniform",
    ) -> None:  # fmt: skip
        # The fields set at once (every pack hook makes one): a frozen dataclass's own __init__ sets them one by one.
        object.__setattr__(self, "__dict__", {
            "data": data, "meta": meta, "bits": bits, "group_size": group_size, "shape": shape, "dtype": dtype,
            "dense_shape": dense_shape, "perm": perm, "scheme": scheme,
        })  # fmt: skip

    @property
    def numel(self) -> int:
        return self.dense_shape.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Every byte this object holds on its device: payload plus metadata."""
        meta = 0 if self.meta is None else self.meta.numel() * self.meta.element_size()
        return self.data.numel() * self.data.element_size() + meta

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
            f"group_size={self.group_size}, nbytes={self.nbytes}, device={self.device}"
            + (")" if self.scheme == "uniform" else f", scheme={self.scheme!r})")
        )


def packed_mask(packed: torch.Tensor, n: int) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of ``n`` bools packed one bit each (``bitmask.py``'s layout) in ``packed``."""
    size = torch.Size([n])
    return QuantizedTensor(packed, None, 1, 256, size, torch.bool, size, None)


def as_is_width(bits: int | None, dtype: torch.dtype) -> bool:
    """Whether ``bits`` stores a tensor of ``dtype`` as it is: 32 bits, or 16 bits of a 16-bit tensor (16 bits of a
    float32 tensor are bfloat16 with stochastic rounding)."""
    return bits == 32 or (bits == 16 and dtype != torch.float32)


def expected_nbytes(numel: int, dtype: torch.dtype, bits: int, group_size: int = 256, scheme: str = "uniform") -> int:
    """The bytes :func:`gactx.quantize` will hold for a tensor of ``numel`` elements (the format's formula)."""
    if dtype == torch.bool:
        return -(-numel // 8)
    if bits == 32:
        return numel * dtype.itemsize
    if bits == 16:
        return numel * 2
    n_groups = -(-numel // group_size)
    return n_groups * group_size * bits // 8 + SCHEME_META_BYTES[scheme] * n_groups


def check_scheme(scheme: str, bits: int, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` for a scheme that is not one of :data:`SCHEMES`, or a width it does not take (bool
    masks are packed losslessly whatever the scheme)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not allowed; allowed values are {SCHEMES}")
    if dtype != torch.bool and bits not in SCHEME_BITS[scheme]:
        raise ValueError(
            f"bits={bits!r} is not allowed with scheme={scheme!r}; allowed values are {SCHEME_BITS[scheme]}"
        )


def pack_planes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``q`` (integers, ``[n_groups, group_size]``) packed in the planes pictured above: uint8, flat."""
    n_groups, group_size = q.shape
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=q.device, dtype=torch.int32)[:, None] * bits
    packed = (q.to(torch.int32).view(n_groups, per_byte, group_size // per_byte) << shifts).sum(1)
    return packed.to(torch.uint8).view(-1)


def unpack_planes(codes: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_planes`: int32 codes ``[n_groups, group_size]``."""
    per_byte = 8 // bits
    n_groups = codes.numel() * per_byte // group_size
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32)[:, None] * bits
    planes = codes.view(n_groups, 1, group_size // per_byte).to(torch.int32) >> shifts
    return (planes & ((1 << bits) - 1)).view(n_groups, group_size)


def _why_not(subclass: torch.Tensor) -> str:
    """Why a tensor subclass is refused: a wrapper's data lives in the tensors it wraps; any other subclass would
    come back as a plain tensor, its class and attributes lost."""
    if is_traceable_wrapper_subclass(subclass):
        return "its data lives in the tensors it wraps, which a QuantizedTensor would not hold (quantize those)"
    return (
        "a QuantizedTensor decodes to a plain torch.Tensor, and its class and attributes would be lost "
        "(quantize x.as_subclass(torch.Tensor) to drop them knowingly)"
    )


def check_args(x: torch.Tensor, bits: int, group_size: int) -> None:
    """Raise ``TypeError``/``ValueError`` naming the bad argument and what is allowed."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in ALLOWED_BITS:
        raise ValueError(f"bits={bits!r} is not allowed; allowed values are {ALLOWED_BITS}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r} is not allowed; allowed values are {GROUP_SIZES}")
    if x.layout != torch.strided or x.is_nested:
        got = "a nested tensor" if x.is_nested else f"layout {x.layout}"
        raise ValueError(f"quantize takes dense (strided) tensors, got {got}")
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(f"quantize takes plain tensors, not the subclass {type(x).__name__}: {_why_not(x)}")
    if x.device.type == "meta":
        raise ValueError("quantize needs a tensor's values: a meta tensor has none")
    if x.dtype not in (*FLOAT_DTYPES, torch.bool):
        allowed = ", ".join(str(d) for d in (*FLOAT_DTYPES, torch.bool))
        raise ValueError(f"dtype {x.dtype} is not supported; allowed dtypes are {allowed}")


def memory_order(x: torch.Tensor) -> tuple[torch.Tensor, torch.Size, tuple[int, ...] | None]:
    """A 1-D view of ``x`` in memory order when ``x`` is dense in some dimension order, else a copy.

    Returns ``(flat, dense_shape, perm)``: ``flat.view(dense_shape)`` equals ``x.permute(perm)``, so a
    channels_last or transposed tensor is compressed without a copy and comes back with its strides.
    """
    if x.is_contiguous():
        return x.reshape(-1), x.shape, None
    # Outermost dimension first; a stable sort keeps ties (size-1 dims) in their original order.
    perm = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
    permuted = x.permute(perm)
    if permuted.is_contiguous():
        return permuted.reshape(-1), permuted.shape, perm
    return x.reshape(-1), x.shape, None  # overlapping or gapped view: one contiguous copy


def contiguous_order(x: torch.Tensor) -> tuple[torch.Tensor, torch.Size, tuple[int, ...] | None]:
    """:func:`memory_order` for a kernel that reads a contiguous tensor's elements in order, whatever its shape:
    ``x`` itself when it is contiguous (no view is made, no autograd history), else the memory-order view of its
    values, made contiguous."""
    if x.is_contiguous():
        return x, x.shape, None
    flat, dense_shape, perm = memory_order(x.detach())
    return flat.contiguous(), dense_shape, perm


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (size-0 and size-1 dimensions count as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def restore_order(flat: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Inverse of :func:`memory_order`: shape ``q.shape`` with the strides the original had."""
    return restore_perm(flat.view(q.dense_shape), q.perm)


def restore_perm(dense: torch.Tensor, perm: tuple[int, ...] | None) -> torch.Tensor:
    """:func:`restore_order` of a tensor already of the dense shape."""
    if perm is None:
        return dense
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return dense.permute(inverse)
