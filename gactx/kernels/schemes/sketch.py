"""A row sketch: a random fraction of a tensor's rows, scaled so that the sketch is unbiased (the idea of FewBit's
``RandomizedLinear``, as row sampling; see docs/adaptive.md#storage-choices).

For ``y = x W^T`` backward reads ``x`` only in ``grad_W = g^T x``, which is linear in ``x`` (``grad_x = g W``
never reads it). An estimate with ``E[x_hat] = x`` therefore keeps ``grad_W`` unbiased and ``grad_x`` exact.
The sketch: read ``x`` in memory order (:func:`~gactx.kernels.format.memory_order`) as ``N`` rows of ``D``
elements (``D`` the innermost dimension), keep ``k = ceil(fraction * N)`` of them chosen uniformly at random
without replacement, and decode them scaled by ``N / k``; the other rows decode to zero::

    x, N = 6 rows, fraction 1/2: k = 3      stored                 decoded
    row 0  [ x0 ]                           kept: [ x1 ]           [  0   ]
    row 1  [ x1 ]   keys (seed, row) -->          [ x3 ]           [ 2 x1 ]
    row 2  [ x2 ]   the k smallest:               [ x4 ]           [  0   ]
    row 3  [ x3 ]   rows 1, 3, 4          seed: one host int       [ 2 x3 ]
    row 4  [ x4 ]                                                  [ 2 x4 ]
    row 5  [ x5 ]                                                  [  0   ]

Which rows: each row gets a 63-bit key, a counter hash of ``(seed, row)`` (murmur3's finalizer, as
``traced.uniform_bits``) with the row's index in its low bits, and the ``k`` rows of the smallest keys are kept,
in increasing order. The keys are distinct, so the choice is a function of the seed alone, the same on any
device, made with elementwise ops and one ``topk`` (no ``torch.Generator``, no host read, no data-dependent
shape). It is regenerated at decode: the choice costs no device bytes, only the seed on the host. The index
bits break ties of the hash bits towards lower rows; with ``N`` rows that moves a row's probability of being kept
by at most ``N / 2**(63 - ceil(log2 N))`` (``2**-23`` at a million rows).

Kept rows are stored at ``bits`` with :func:`gactx.quantize` (1, 2, 4, 8: codes in groups of ``group_size``
running across the kept rows; 16: bfloat16 of float32; 32: as they are). Bytes: those of ``k * D`` elements at
``bits`` (:func:`sketch_nbytes`): ``fraction * bits`` bits an element plus the groups' metadata, so 1/8 of the
rows at 2 bits holds 0.25 bit an element (0.28 with metadata), below the 1.25 of the narrowest quantization.

Error of the sampling alone (:func:`sketch_variance`): row ``i`` decodes to ``c_i x_i`` with ``c_i = N / k`` with
probability ``k / N``, else 0, so ``E[(c_i - 1)^2] = N / k - 1`` and, rows erring apart,
``E ||x_hat - x||^2 = (N - k) / k * ||x||^2``. Rounding of the kept rows adds its own variance times
``(N / k)^2`` on the ``k`` kept rows (``N / k`` times a full tensor's rounding variance, for rows alike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from gactx.kernels import cpu
from gactx.kernels.format import (
    ALLOWED_BITS,
    FLOAT_DTYPES,
    QuantizedTensor,
    contiguous_strides,
    expected_nbytes,
    memory_order,
    restore_perm,
)
from gactx.kernels.functional import SEED_LIMIT, dequantize, quantize
from gactx.kernels.schemes import CODE_WIDTHS, Choice, Scheme
from gactx.kernels.traced import HASH_OFFSET, fmix32, mul32

__all__ = [
    "SKETCH_FRACTIONS", "SketchScheme", "SketchedTensor", "kept_rows", "row_length", "sketch_nbytes", "sketch_rows",
    "sketch_variance",
]  # fmt: skip

# Fractions of rows a sketch keeps: 1/2 to 1/8, so that a sketch of 1-bit rows holds 1/8 bit an element.
SKETCH_FRACTIONS = (0.5, 0.25, 0.125)

_MASK = 0xFFFFFFFF
# Fractions are read as the nearest fraction of denominator at most 2**16: 0.1 is 1/10, so 10 rows keep 1
# (the float 0.1 is a little above 1/10, and ceil(0.1 * 10) in binary would keep 2).
_DENOMINATOR = 1 << 16


@dataclass(frozen=True, eq=False)
class SketchedTensor:
    """``kept`` (the kept rows, ``(k, D)`` in the original dtype, or a ``QuantizedTensor`` of them) of a tensor of
    ``shape`` read as ``n_rows`` rows of ``row_len`` elements in memory order (``dense_shape`` and ``perm`` as in
    ``QuantizedTensor``); ``seed`` chooses the rows (:func:`kept_rows`). Build it with :func:`sketch_rows`."""

    kept: torch.Tensor | QuantizedTensor
    seed: int
    n_rows: int
    row_len: int
    fraction: float
    bits: int
    shape: torch.Size
    dtype: torch.dtype
    dense_shape: torch.Size
    perm: tuple[int, ...] | None
    backend: str = "auto"
    complement: bool = False  # the rows the seed does not choose (see sketch_rows)

    @property
    def n_kept(self) -> int:
        return _n_kept(self.n_rows, self.fraction, self.complement)

    @property
    def numel(self) -> int:
        return self.dense_shape.numel()

    @property
    def device(self) -> torch.device:
        return self.kept.device

    @property
    def nbytes(self) -> int:
        """Every byte this object holds on its device: the kept rows (and their metadata). The choice of rows is
        the seed, a host int."""
        if isinstance(self.kept, QuantizedTensor):
            return self.kept.nbytes
        return self.kept.numel() * self.kept.element_size()

    def stride(self) -> tuple[int, ...]:
        """The strides :meth:`decode` gives (those of the sketched tensor, when it was dense)."""
        dense = contiguous_strides(self.dense_shape)
        if self.perm is None:
            return dense
        out = [0] * len(dense)
        for i, dim in enumerate(self.perm):
            out[dim] = dense[i]
        return tuple(out)

    def rows(self) -> torch.Tensor:
        """The kept rows' indices (int64, increasing), regenerated from the seed on the device."""
        return kept_rows(self.n_rows, _n_kept(self.n_rows, self.fraction), self.seed, self.device, self.complement)

    def decode(self) -> torch.Tensor:
        """The unbiased estimate: kept rows times ``N / k`` at their places, zeros elsewhere, in the original shape,
        dtype, device and strides. The product is taken in float32 and rounded once to the dtype."""
        n, d = self.n_rows, self.row_len
        out = torch.zeros(n, d, dtype=self.dtype, device=self.device)
        if n:
            rows = self.kept if isinstance(self.kept, torch.Tensor) else dequantize(self.kept, backend=self.backend)
            scaled = torch.mul(rows.view(-1, d), n / self.n_kept)  # opmath: fp16/bf16 are multiplied in float32
            out.index_copy_(0, self.rows(), scaled.to(self.dtype))
        return restore_perm(out.view(self.dense_shape), self.perm)

    def __repr__(self) -> str:
        return (
            f"SketchedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, rows={self.n_kept}/{self.n_rows}, "
            f"bits={self.bits}, nbytes={self.nbytes}, device={self.device})"
        )


def _check_fraction(fraction) -> Fraction:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float | Fraction) or not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} is not allowed; allowed values are numbers in (0, 1]")
    return Fraction(fraction).limit_denominator(_DENOMINATOR)


def _n_kept(n_rows: int, fraction, complement: bool = False) -> int:
    """``ceil(fraction * n_rows)``, at least one row of a tensor that has any; of the complement, the other rows (all
    of them where those are none)."""
    k = min(n_rows, max(1, math.ceil(_check_fraction(fraction) * n_rows))) if n_rows else 0
    return (n_rows - k or n_rows) if complement else k


def row_length(x: torch.Tensor) -> int:
    """``D``, the length of the rows a sketch of ``x`` reads: its innermost dimension in memory order (1 for a
    0-d tensor). What :func:`sketch_nbytes` takes as ``row_len``."""
    if x.dim() == 0:
        return 1
    if x.is_contiguous():
        return x.shape[-1]
    # memory_order's choice without its copy: the dimension of the smallest stride, when x is dense in some order
    perm = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return x.shape[perm[-1]] if x.permute(perm).is_contiguous() else x.shape[-1]


def kept_rows(
    n_rows: int, n_kept: int, seed: int, device: torch.device | str, complement: bool = False
) -> torch.Tensor:
    """The ``n_kept`` rows of ``n_rows`` that ``seed`` chooses, uniformly without replacement: int64 indices in
    increasing order on ``device`` (see the module docstring). No host read, no data-dependent shape. With
    ``complement``, the other ``n_rows - n_kept`` rows (every row where those are none). One C++ call on a CPU (the
    torch form below is twenty-odd small ops), the same rows."""
    if _on_cpu(device) and 0 <= n_kept <= n_rows and 0 <= seed < 1 << 63:
        return cpu.kept_rows(n_rows, n_kept, seed, complement)
    return _kept_rows(n_rows, n_kept, seed, device, complement)


def _on_cpu(device: torch.device | str) -> bool:
    return (device == "cpu" if isinstance(device, str) else device.type == "cpu") and cpu.available()


def _kept_rows(n_rows: int, n_kept: int, seed: int, device: torch.device | str, complement: bool) -> torch.Tensor:
    """:func:`kept_rows` in torch ops (every device; the C++ kernel's oracle)."""
    row = torch.arange(n_rows, dtype=torch.int64, device=device)
    k0, k1 = seed & _MASK, (seed >> 32) & _MASK
    h = fmix32(mul32(row & _MASK, 0x9E3779B9) ^ k0 ^ HASH_OFFSET)
    hi = fmix32(h ^ k1 ^ mul32(row >> 32, 0x85EBCA77))
    lo = fmix32(hi ^ 0x2545F491)
    index_bits = max(1, (n_rows - 1).bit_length())
    key = (hi << 31) | (lo >> 1)  # 63 random bits, non-negative
    key = ((key >> index_bits) << index_bits) | row  # distinct keys: ties of the random bits go to lower rows
    if complement and n_kept < n_rows:
        chosen = torch.topk(key, n_rows - n_kept, largest=True, sorted=False).indices
    elif complement:
        chosen = row
    else:
        chosen = torch.topk(key, n_kept, largest=False, sorted=False).indices
    return chosen.sort().values


def _quantize_seed(seed: int) -> int:
    """The rounding noise's seed, apart from the rows' (SplitMix64 of the seed, in [0, 2**62))."""
    z = (seed + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) % SEED_LIMIT


def sketch_rows(
    x: torch.Tensor,
    fraction: float,
    bits: int,
    seed: int,
    group_size: int = 256,
    stochastic: bool = True,
    backend: str = "auto",
    complement: bool = False,
) -> SketchedTensor:
    """Keep ``ceil(fraction * N)`` of ``x``'s ``N`` rows, chosen by ``seed``, stored at ``bits``; ``decode()`` gives
    an unbiased estimate of ``x`` (see the module docstring).

    Args:
        x: a float32, float16 or bfloat16 tensor of any shape, strides and device; its values are stored, not its
            autograd history.
        fraction: the fraction of rows kept, a number in (0, 1] (read as the nearest fraction of denominator at
            most 2**16); 1 keeps every row (the sketch is then ``x`` at ``bits``).
        bits: the kept rows' width, as :func:`gactx.quantize` takes it: 1, 2, 4, 8, 16 or 32.
        seed: an int in [0, 2**62): chooses the rows and, apart, the rounding noise of the kept rows.
        group_size, stochastic, backend: for the kept rows' quantization, as :func:`gactx.quantize`.
        complement: keep the rows the same ``seed`` does not choose, scaled by ``N / (N - k)``: a sketch and its
            complement average to the tensor, so half their distance is the sketch's error, with no chance that
            two draws happen to keep the same rows (what GACT's estimator measures, ``choices.py``).
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype
        raise ValueError(f"sketch_rows takes a float32, float16 or bfloat16 tensor, got {got}")
    _check_fraction(fraction)
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in ALLOWED_BITS:
        raise ValueError(f"bits={bits!r} is not allowed; allowed values are {ALLOWED_BITS}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**62)")
    x = x.detach()
    flat, dense_shape, perm = memory_order(x)
    d = max(dense_shape[-1], 1) if len(dense_shape) else 1
    n = flat.numel() // d
    rows = flat.view(n, d).index_select(0, kept_rows(n, _n_kept(n, fraction), seed, x.device, complement))
    kept = quantize(rows, bits, group_size, stochastic=stochastic, seed=_quantize_seed(seed), backend=backend)
    if kept.meta is None and kept.data.dtype == x.dtype:
        kept = kept.data  # at or above the tensor's own width: the rows themselves
    return SketchedTensor(
        kept, seed, n, d, float(fraction), bits, x.shape, x.dtype, dense_shape, perm, backend, complement
    )


def sketch_variance(x: torch.Tensor, fraction: float, square: torch.Tensor | None = None) -> torch.Tensor:
    """``E ||x_hat - x||^2`` of the row sampling alone (no rounding): ``(N - k) / k * ||x||^2``, a 0-d float32
    tensor on ``x``'s device (``square``: ``||x||^2`` where the caller has it, as a 0-d float32 tensor). Torch ops only,
    nothing read back to the host (a saved-tensor hook may call it)."""
    _check_fraction(fraction)
    d = row_length(x)
    n = x.numel() // d if d else 0
    k = _n_kept(n, fraction)
    if k == 0 or k == n:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if square is None:
        square = torch.linalg.vector_norm(x.detach(), dtype=torch.float32).square()
    return square * ((n - k) / k)


def sketch_nbytes(
    numel: int, row_len: int, dtype: torch.dtype, fraction: float, bits: int, group_size: int = 256
) -> int:
    """The bytes :func:`sketch_rows` will hold for a tensor of ``numel`` elements in rows of ``row_len``
    (:func:`row_length`) at ``fraction`` and ``bits``: those of the kept ``k * row_len`` elements at ``bits``."""
    row_len = max(row_len, 1)
    k = _n_kept(numel // row_len, fraction)
    return expected_nbytes(k * row_len, dtype, bits, group_size)


class SketchScheme(Scheme):
    """Row sketches of a linear layer's input (the module docstring), measured by their sampling error alone; the
    kept rows' rounding is added for each code width from the uniform scheme's measurement."""

    name = "sketch"
    derived = True

    def measure(self, x, flat, group_size, sketchable) -> dict[Choice, torch.Tensor]:
        if x.dim() < 2 or not sketchable():
            return {}
        square = torch.linalg.vector_norm(x.detach(), dtype=torch.float32).square()  # once for every fraction
        return {Choice(32, "sketch", f): sketch_variance(x, f, square) for f in SKETCH_FRACTIONS}

    def options(self, choice, error, measured, scale) -> dict[Choice, float]:
        f = choice.fraction  # kept rows at b: their rounding error, scaled by 1/f for a fraction f of rows
        return {choice: scale * error} | {
            Choice(b, "sketch", f): scale * error + measured[Choice(b)] / f for b in CODE_WIDTHS
        }

    def nbytes(self, shape, dtype, choice, group_size) -> int:
        numel, row_len = torch.Size(shape).numel(), shape[-1] if shape else 1
        return sketch_nbytes(numel, row_len, dtype, choice.fraction, choice.bits, group_size)

    def encode(self, t, choice, seed, group_size, stochastic, backend, sketchable):
        if t.dim() < 2 or t.dtype not in FLOAT_DTYPES or not sketchable:
            return None
        return sketch_rows(
            t, choice.fraction, choice.bits, seed, group_size, stochastic, backend, complement=choice.complement
        )

    def label(self, choice: Choice) -> str:
        return f"{choice.bits} sketch {choice.share}"

    def form(self, choice: Choice) -> str:
        return f"sketch {choice.share}"

    def fallback_bits(self, choice: Choice) -> int:
        """The widest code width within the choice's effective bits, at least 1."""
        if choice.fraction >= 1:
            return choice.bits
        return max((w for w in CODE_WIDTHS if w <= choice.effective_bits), default=1)
