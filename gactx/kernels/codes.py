"""Codes with a table: a tensor stored as one small integer an element, decoded by looking the integer up.

Lossless masks (1 bit: ``where(mask, true_value, false_value)``), signs (2 bits) and FewBit's bin indices
(1 to 8 bits) are all this one format. No per-group metadata: the table (``2**bits`` values of the
tensor's dtype, on its device) is the whole decoder.

Codes are read in memory order (:func:`~gactx.kernels.format.memory_order`, so a channels_last tensor comes
back channels_last) and packed ``8 / bits`` to a byte, element ``k`` of a run of ``8 / bits`` in bits
``k * bits`` and up::

    bits = 2, byte j:   bit  7 6 | 5 4 | 3 2 | 1 0
                           [ e3  | e2  | e1  | e0 ]    e_k = code of element 4j + k

1-bit codes are bool masks and go through :mod:`gactx.kernels.bitmask`. A tensor's bins and its test against
bounds are encoded, and every width decoded, in one call of a kernel: Triton on CUDA
(:mod:`gactx.kernels.tables`), C++ on a CPU (:mod:`gactx.kernels.cpu`), without a temporary. Other codes (the
signs), and every code on the torch backend, are packed and decoded with a few torch element-wise ops (no host
synchronization: nothing is read back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from gactx.kernels import _triton, cpu, native, tables
from gactx.kernels.format import (
    FLOAT_DTYPES,
    contiguous_order,
    memory_order,
    packed_mask,
    restore_order,
    restore_perm,
)
from gactx.kernels.functional import choose_backend, dequantize, quantize

__all__ = ["CodedTensor", "encode_codes", "encode_compare", "encode_bins", "decode_codes", "coded_nbytes"]

CODE_WIDTHS = (1, 2, 4, 8)


class _Layout(NamedTuple):
    dense_shape: torch.Size
    perm: tuple[int, ...] | None


@dataclass(frozen=True, eq=False, init=False)
class CodedTensor:
    """``codes`` (packed uint8, or a 1-bit ``QuantizedTensor`` of a bool mask) and ``table`` (``2**bits``
    values in the original dtype) of a tensor of ``shape``."""

    codes: object
    table: torch.Tensor
    bits: int
    shape: torch.Size
    dtype: torch.dtype
    dense_shape: torch.Size
    perm: tuple[int, ...] | None
    backend: str = "auto"

    def __init__(
        self, codes: object, table: torch.Tensor, bits: int, shape: torch.Size, dtype: torch.dtype,
        dense_shape: torch.Size, perm: tuple[int, ...] | None, backend: str = "auto",
    ) -> None:  # fmt: skip
        # The fields set at once, as QuantizedTensor's are (every pack hook of a FewBit class makes one).
        object.__setattr__(self, "__dict__", {
            "codes": codes, "table": table, "bits": bits, "shape": shape, "dtype": dtype, "dense_shape": dense_shape,
            "perm": perm, "backend": backend,
        })  # fmt: skip

    @property
    def numel(self) -> int:
        return self.dense_shape.numel()

    def decode(self) -> torch.Tensor:
        """The values the codes stand for (:func:`decode_codes`)."""
        return decode_codes(self)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: the packed codes and the table."""
        packed = self.codes.nbytes if self.bits == 1 else self.codes.numel()
        return packed + self.table.numel() * self.table.element_size()


def coded_nbytes(numel: int, bits: int, dtype: torch.dtype) -> int:
    """What :func:`encode_codes` holds for ``numel`` elements at ``bits`` (table included)."""
    return -(-numel * bits // 8) + (1 << bits) * dtype.itemsize


def encode_codes(codes: torch.Tensor, bits: int, table: torch.Tensor, backend: str = "auto") -> CodedTensor:
    """Store ``codes`` (integers in ``[0, 2**bits)``, or a bool mask at 1 bit; any strides) with ``table``.

    ``table`` gives each code's value and the decoded dtype: ``decode_codes`` returns ``table[codes]``.
    """
    if bits not in CODE_WIDTHS:
        raise ValueError(f"bits={bits!r}: codes are {CODE_WIDTHS} bits")
    if table.numel() != 1 << bits:
        raise ValueError(f"a {bits}-bit code needs a table of {1 << bits} values, got {table.numel()}")
    flat, dense_shape, perm = memory_order(codes)
    if bits == 1:
        packed = quantize(flat.to(torch.bool), 1, stochastic=False, seed=0, backend=backend)  # draws no RNG
    else:
        per_byte = 8 // bits
        c = flat.to(torch.uint8)
        pad = -c.numel() % per_byte
        if pad:
            c = torch.cat([c, c.new_zeros(pad)])
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
        packed = (c.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)
    return CodedTensor(packed, table, bits, codes.shape, table.dtype, dense_shape, perm, backend)


def encode_compare(t: torch.Tensor, kind: str, lo: float, hi: float, table: torch.Tensor, backend: str = "auto"):
    """What ``encode_codes(test, 1, table)`` stores for the bool ``test`` of ``t`` against its bounds (the kinds
    of :func:`gactx.kernels.cpu.pack_compare`), made in one pass by the C++ kernel, no bool tensor between;
    or by the Triton kernel (:mod:`gactx.kernels.tables`) on CUDA; ``None`` where neither runs (the torch backend,
    the C++ kernels not built): then the caller tests with torch ops and calls :func:`encode_codes`."""
    chosen = choose_backend(t, backend)
    if t.dtype not in FLOAT_DTYPES or chosen == "torch":
        return None
    flat, dense_shape, perm = contiguous_order(t)
    if chosen == "cpp":
        packed = cpu.pack_compare(flat, kind, lo, hi)
    else:
        packed = tables.triton_encode_compare(flat, kind, lo, hi, _triton.interpreting(flat))
    return CodedTensor(packed_mask(packed, flat.numel()), table, 1, t.shape, table.dtype, dense_shape, perm, backend)


def encode_bins(t: torch.Tensor, edges: torch.Tensor, bits: int, table: torch.Tensor, backend: str = "auto"):
    """The bin of each element of ``t`` among the sorted ``edges`` (``torch.bucketize``: the first edge at or
    above it; NaN past the last), stored as a ``bits``-bit code with ``table`` (see :func:`encode_codes`)."""
    chosen = choose_backend(t, backend)
    if bits > 1 and chosen == "cpp":  # the pack hook's call on a CPU
        return _cpp_encode_bins(t, edges, bits, table, backend)
    flat, dense_shape, perm = memory_order(t)  # in memory order: bucketize copies other layouts
    if chosen == "triton" and t.dtype in FLOAT_DTYPES and bits in CODE_WIDTHS:
        packed = tables.triton_encode_bins(flat.contiguous(), edges, bits, _triton.interpreting(flat))
        if bits == 1:  # a 1-bit code is stored as a bool mask is
            packed = packed_mask(packed, flat.numel())
        return CodedTensor(packed, table, bits, t.shape, table.dtype, dense_shape, perm, backend)
    codes = restore_order(torch.bucketize(flat, edges, out_int32=True), _Layout(dense_shape, perm))
    return encode_codes(codes, bits, table, backend)


def _cpp_encode_bins(t: torch.Tensor, edges: torch.Tensor, bits: int, table: torch.Tensor, backend: str) -> CodedTensor:
    """The C++ kernel's codes of 2 to 8 bits (``t`` itself where contiguous, no view made)."""
    flat, dense_shape, perm = contiguous_order(t)
    packed = cpu.encode_bins(flat, edges, bits)
    return CodedTensor(packed, table, bits, t.shape, table.dtype, dense_shape, perm, backend)


def _cpp_decode(ct: CodedTensor) -> torch.Tensor:
    """The C++ kernel's lookup of the table from the codes (no bool mask between at 1 bit; its own call: every replayed
    save's unpack)."""
    packed = ct.codes.data if ct.bits == 1 else ct.codes  # 1 bit: a QuantizedTensor of the bool mask
    out = cpu.built.decode_table(packed, ct.table, ct.dense_shape, ct.bits)
    return out if ct.perm is None else restore_perm(out, ct.perm)


def bound_encode_bins(like: torch.Tensor, edges: torch.Tensor, bits: int, table: torch.Tensor, backend: str = "auto"):
    """:func:`encode_bins` of tensors like ``like`` (its device and dtype) with these ``edges`` and ``table``, the
    backend chosen once, called as ``fn(x, seed)`` (the seed unused: bins draw no noise): what a save replayed at every
    step calls (on a CPU, the C++ kernel's own call: one Python call a save)."""
    if bits > 1 and choose_backend(like, backend) == "cpp":

        def encode(x: torch.Tensor, seed: int) -> CodedTensor:
            if not x.is_contiguous():
                return _cpp_encode_bins(x, edges, bits, table, backend)
            return CodedTensor(cpu.built.encode_bins(x, edges, bits), table, bits, x.shape, table.dtype, x.shape, None,
                               backend)  # fmt: skip

        return encode
    return lambda x, seed: encode_bins(x, edges, bits, table, backend)


def native_encode_bins(like: torch.Tensor, edges: torch.Tensor, bits: int, table: torch.Tensor, backend: str = "auto"):
    """The C++ kernel's :func:`bound_encode_bins` with the handle a replayed save returns (``csrc/saved.h``): called as
    ``packer(x, seed)`` (the seed unused), it stores a contiguous CPU tensor like ``like`` and returns a handle whose
    ``unpack()`` looks ``table`` up by its codes (``None`` for any other tensor); a CUDA tensor's launches the
    Triton kernels from C++ (``native.bins_packer``). ``None`` where neither serves ``like``, or at 1 bit (a bool
    mask's codes)."""
    if backend in ("auto", "triton") and not native.why_not(like):
        return native.bins_packer(like, edges, bits, table)
    if bits in (2, 4, 8) and choose_backend(like, backend) == "cpp":
        return cpu.built.Packer.bins(edges, bits, table)
    return None


def bound_decode_codes(like: CodedTensor):
    """:func:`decode_codes` of codes stored like ``like`` (its device), the backend chosen once, called as ``fn(ct)``:
    what a save replayed at every step decodes with (on a CPU, the C++ kernel's own call)."""
    packed = like.codes.data if like.bits == 1 else like.codes
    return _cpp_decode if choose_backend(packed, like.backend) == "cpp" else decode_codes


def decode_codes(ct: CodedTensor) -> torch.Tensor:
    """``table[codes]`` in the original shape, dtype, device and strides."""
    n = ct.numel
    packed = ct.codes.data if ct.bits == 1 else ct.codes  # 1 bit: a QuantizedTensor of the bool mask
    chosen = choose_backend(packed, ct.backend)
    if chosen == "cpp":
        return _cpp_decode(ct)
    if chosen == "triton":
        flat = tables.triton_decode_table(packed, ct.table, n, ct.bits, _triton.interpreting(packed))
        return restore_order(flat, ct)
    if ct.bits == 1:
        mask = dequantize(ct.codes, backend=ct.backend)
        flat = torch.where(mask, ct.table[1], ct.table[0])
    else:
        shifts = torch.arange(0, 8, ct.bits, dtype=torch.uint8, device=ct.codes.device)
        codes = (ct.codes[:, None] >> shifts) & ((1 << ct.bits) - 1)
        flat = ct.table[codes.view(-1)[:n].long()]
    return restore_order(flat, ct)
