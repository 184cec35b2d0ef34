"""Per-sample widths (ActNN): the samples of a batch that span the widest ranges get more bits.

A saved tensor whose first dimension is the batch holds one slab a sample. Samples differ: a long sentence
against padding, a bright image against a dark one, a node of high degree. Their rounding errors differ with them:
at ``b`` bits a sample's is about ``sum over its groups of G * R_g**2 / 6 * S(b)``, ``R_g`` a group's range. Under one
width for the whole tensor the samples with the widest ranges carry most of its error, so ActNN gives them more
bits and the others fewer.

:func:`split_samples` stores the ``k = round(fraction * B)`` samples of the widest range (max - min over the sample)
at ``high`` bits and the other ``B - k`` at ``bits``, each part quantized as a tensor of its own
(``gactx.quantize``: uniform codes, per-group ranges). Which samples is decided on the device: an ``argsort`` of the
ranges, whose ``B`` indices are stored (``int32``, 4 bytes a sample); ``k`` is fixed by the fraction, so no shape
depends on the values and nothing synchronizes. Each part is unbiased, so the whole is.

Memory while packing: the two parts are gathered from the tensor before they are quantized, a transient copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gactx.kernels.format import FLOAT_DTYPES, QuantizedTensor, contiguous_strides
from gactx.kernels.functional import dequantize, quantize
from gactx.kernels.schemes import CODE_WIDTHS, Choice, Scheme

__all__ = [
    "SPLIT_FRACTIONS", "SamplesScheme", "SplitTensor", "sample_ranges", "sample_variances", "split_count",
    "split_errors", "split_nbytes", "split_samples",
]  # fmt: skip

SPLIT_FRACTIONS = (0.25, 0.5)  # samples at the wider width


@dataclass(frozen=True, eq=False)
class SplitTensor:
    """A tensor stored by :func:`split_samples`: ``order[:k]`` are the samples in ``high``, ``order[k:]`` those in
    ``low``."""

    high: QuantizedTensor | None
    low: QuantizedTensor | None
    order: torch.Tensor  # int32 [B], on the device
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    bits: int  # the narrower width

    @property
    def device(self) -> torch.device:
        return self.order.device

    @property
    def nbytes(self) -> int:
        parts = sum(p.nbytes for p in (self.high, self.low) if p is not None)
        return parts + self.order.numel() * self.order.element_size()

    def decode(self) -> torch.Tensor:
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        order = self.order.long()
        k = 0 if self.high is None else self.high.shape[0]
        if self.high is not None:
            out.index_copy_(0, order[:k], dequantize(self.high))
        if self.low is not None:
            out.index_copy_(0, order[k:], dequantize(self.low))
        return out


def split_count(batch: int, fraction: float) -> int:
    """Samples at the wider width: ``fraction`` of ``batch``, rounded, at least one and at most all."""
    return min(batch, max(1, round(fraction * batch)))


def sample_ranges(x: torch.Tensor) -> torch.Tensor:
    """Each sample's range ``max - min`` (float32, ``[B]``), read in place whatever the strides."""
    dims = tuple(range(1, x.dim()))
    return (x.amax(dims).float() - x.amin(dims).float()).nan_to_num(float("inf"))


def split_samples(
    x: torch.Tensor,
    bits: int,
    high: int,
    fraction: float,
    group_size: int = 256,
    *,
    stochastic: bool = True,
    seed: int | None = None,
    backend: str = "auto",
) -> SplitTensor:
    """Store the ``fraction`` of ``x``'s samples (first dimension) with the widest ranges at ``high`` bits and the
    others at ``bits`` (see the module docstring). ``seed`` seeds the two parts' noise (``seed`` and ``seed + 1``)."""
    if x.dim() < 2 or x.shape[0] < 2:
        raise ValueError(
            f"split_samples needs a batch of at least 2 samples in dimension 0, got shape {tuple(x.shape)}"
        )
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction!r} must lie strictly between 0 and 1")
    if not high > bits:
        raise ValueError(f"high={high!r} must be wider than bits={bits!r}")
    x = x.detach()
    batch = x.shape[0]
    k = split_count(batch, fraction)
    order = torch.argsort(sample_ranges(x), descending=True, stable=True)
    seeds = (None, None) if seed is None else (seed, (seed + 1) % (1 << 62))
    kwargs = dict(group_size=group_size, stochastic=stochastic, backend=backend)
    hi = quantize(x.index_select(0, order[:k]), high, seed=seeds[0], **kwargs)
    lo = quantize(x.index_select(0, order[k:]), bits, seed=seeds[1], **kwargs) if k < batch else None
    # Decoded with the strides it had where they are channels_last's (what convolutions save), else contiguous.
    channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    stride = x.stride() if channels_last else contiguous_strides(x.shape)
    return SplitTensor(hi, lo, order.to(torch.int32), x.shape, stride, x.dtype, bits)


def sample_variances(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor | None:
    """Each sample's expected squared error under uniform codes at ``bits`` (``[B]``, float32, device work only), from
    its groups' grids (``uniform/format.py``); ``None`` where a sample is not a whole number of groups (groups would
    straddle samples). Non-finite values count 0."""
    from gactx.kernels.schemes.uniform.format import MIN_STEP, step_factor

    batch = x.shape[0]
    per_sample = x.numel() // max(batch, 1)
    if x.dim() < 2 or batch < 2 or per_sample == 0 or per_sample % group_size:
        return None
    v = x.detach().reshape(batch, per_sample // group_size, group_size).float()
    v = v.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    lo, span = v.amin(2, keepdim=True), v.amax(2, keepdim=True) - v.amin(2, keepdim=True)
    step = torch.where(span > 0, (span * step_factor((1 << bits) - 1)).clamp(min=MIN_STEP), 0.0)
    position = (v - lo) / torch.where(step > 0, step, 1.0)
    frac = position - position.floor()
    return (step.square() * frac * (1 - frac)).sum((1, 2))


def split_nbytes(shape: tuple[int, ...], dtype: torch.dtype, bits: int, high: int, fraction: float, group_size: int):
    """The bytes :func:`split_samples` holds for a tensor of ``shape``."""
    from gactx.kernels.format import expected_nbytes

    batch = shape[0]
    per_sample = 1
    for d in shape[1:]:
        per_sample *= d
    k = split_count(batch, fraction)
    nbytes = expected_nbytes(k * per_sample, dtype, high, group_size) + 4 * batch
    if k < batch:
        nbytes += expected_nbytes((batch - k) * per_sample, dtype, bits, group_size)
    return nbytes


def split_errors(x: torch.Tensor, group_size: int) -> dict[Choice, torch.Tensor]:
    """The stored error of each split, from each sample's error at each width, with the samples that
    :func:`split_samples` would widen (the widest ranges). Empty where the samples are not whole groups."""
    if x.dim() < 2 or x.shape[0] < 2:
        return {}
    per_width = {b: sample_variances(x, b, group_size) for b in CODE_WIDTHS}
    if per_width[1] is None:
        return {}
    order = torch.argsort(sample_ranges(x), descending=True, stable=True)
    out = {}
    for low, high in zip(CODE_WIDTHS, CODE_WIDTHS[1:], strict=False):
        lo, hi = per_width[low][order], per_width[high][order]
        for f in SPLIT_FRACTIONS:
            k = split_count(x.shape[0], f)
            out[Choice(low, "samples", f, high)] = hi[:k].sum() + lo[k:].sum()
    return out


class SamplesScheme(Scheme):
    """Per-sample widths (the module docstring): the widest samples one code width up."""

    name = "samples"

    def measure(self, x, flat, group_size, sketchable) -> dict[Choice, torch.Tensor]:
        return split_errors(x, group_size)

    def nbytes(self, shape, dtype, choice, group_size) -> int:
        return split_nbytes(shape, dtype, choice.bits, choice.high, choice.fraction, group_size)

    def encode(self, t, choice, seed, group_size, stochastic, backend, sketchable):
        if t.dim() < 2 or t.shape[0] < 2 or t.dtype not in FLOAT_DTYPES:
            return None
        return split_samples(
            t, choice.bits, choice.high, choice.fraction, group_size, stochastic=stochastic, seed=seed, backend=backend
        )

    def label(self, choice: Choice) -> str:
        return f"{choice.bits} samples {choice.share} at {choice.high}"

    def form(self, choice: Choice) -> str:
        return f"samples {choice.share} at {choice.high}"

    def effective_bits(self, choice: Choice) -> float:
        return choice.bits + choice.fraction * (choice.high - choice.bits)
