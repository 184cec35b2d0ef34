"""``rounding_variance``: the expected squared error that stochastic rounding adds to a tensor, per scheme.

An element ``x`` between neighbouring levels ``t_j <= x <= t_{j+1}`` is rounded up with probability
``(x - t_j) / (t_{j+1} - t_j)``; its expected squared error is ``(x - t_j)(t_{j+1} - x)``. Summed over the
tensor, that is what the allocator weighs against bytes (``variance / byte``), exactly, not the ``step**2 / 6``
of a model: the levels are the quantizer's own, from the metadata it would store, and its float32
arithmetic. Levels are float32 values before the cast to the input dtype (a 16-bit input's decoded values are
then rounded once more, to nearest). NaN and +-Inf contribute 0.

Torch ops only, on the tensor's device, and no value read back to the host: it may run inside a
saved-tensor hook without a device synchronization. Cost: the uniform scheme runs the torch twins twice each
(codes of ``u = 0`` and the codes one above, decoded); the normal scheme computes both levels in one pass.
"""

from __future__ import annotations

import torch

from gactx.kernels import cpu
from gactx.kernels.format import SCHEME_BITS, SCHEMES, pack_planes, unpack_planes
from gactx.kernels.schemes.normal.reference import _encode_meta, _padded, _segments, normal_levels
from gactx.kernels.schemes.uniform.format import FLT_MAX, MIN_STEP, step_factor
from gactx.kernels.schemes.uniform.reference import quantize_groups, torch_dequantize

__all__ = [
    "SAMPLED_ELEMENTS", "estimated_variances", "group_sample", "normal_variances", "rounding_variance",
    "uniform_variances",
]  # fmt: skip

SAMPLED_ELEMENTS = 1 << 14  # what group_sample keeps of a large tensor: 64 groups of 256


def _uniform_levels(flat: torch.Tensor, bits: int, group_size: int):
    n = flat.numel()
    ones = lambda index: torch.ones(index.shape, device=flat.device)  # noqa: E731  (u = 0: the level below)
    codes, meta = quantize_groups(flat, bits, group_size, ones)
    q = unpack_planes(codes, bits, group_size)
    up = pack_planes(torch.clamp(q + 1, max=(1 << bits) - 1), bits)
    below = torch_dequantize(codes, meta, bits, group_size, n, torch.float32)
    above = torch_dequantize(up, meta, bits, group_size, n, torch.float32)
    return flat.float(), below, above, torch.isfinite(flat)


def rounding_variance(flat: torch.Tensor, bits: int, group_size: int, scheme: str = "uniform") -> torch.Tensor:
    """``sum (x - t_j)(t_{j+1} - x)`` over the elements of ``flat`` (any shape: its elements in order), with
    the levels of ``scheme`` (``"uniform"``: ``schemes/uniform/format.py``; ``"normal"``:
    ``schemes/normal/format.py``) at ``bits`` and ``group_size``: a 0-d float32 tensor on ``flat``'s device,
    computed in float64."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not allowed; allowed values are {SCHEMES}")
    allowed = tuple(b for b in SCHEME_BITS[scheme] if b <= 8)
    if bits not in allowed:
        raise ValueError(f"bits={bits!r} is not allowed with scheme={scheme!r}; allowed values are {allowed}")
    flat = flat.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=flat.device)
    if scheme == "uniform":
        x, below, above, live = _uniform_levels(flat, bits, group_size)
    else:
        x, below, above, live = normal_levels(flat, bits, group_size)
    x = x.double()
    # Non-finite levels (the top code of a group holding NaN or Inf) meet only non-finite elements, or an
    # element sitting on the level below: both count 0.
    error = ((x - below.double()) * (above.double() - x)).clamp(min=0)
    error = torch.where(live & torch.isfinite(error), error, 0.0)
    return error.sum().float()


def group_sample(flat: torch.Tensor, group_size: int, budget: int = SAMPLED_ELEMENTS) -> tuple[torch.Tensor, float]:
    """Evenly spaced whole groups of a 1-D tensor, about ``budget`` elements of them, and the factor that scales their
    summed error to the tensor's (its elements over theirs); a tensor of fewer groups than that whole, factor 1. An
    estimate of the total, for the free estimator's collecting step, which measures every width of every tensor:
    the allocator weighs tensors against each other, and a few per cent of error in one moves no width."""
    stride, scale = _sample_stride(flat.numel(), group_size, budget)
    if stride < 2:
        return flat, 1.0
    groups = flat.numel() // group_size
    return flat[: groups * group_size].view(groups, group_size)[::stride].reshape(-1), scale


def _sample_stride(numel: int, group_size: int, budget: int = SAMPLED_ELEMENTS) -> tuple[int, float]:
    """:func:`group_sample`'s step between the groups it keeps (below 2: the whole tensor) and its factor."""
    groups, keep = numel // group_size, max(1, budget // group_size)
    stride = groups // keep
    if stride < 2:
        return 1, 1.0
    return stride, numel / (-(-groups // stride) * group_size)


def estimated_variances(flat: torch.Tensor, widths: tuple[int, ...], group_size: int, scheme: str) -> torch.Tensor:
    """:func:`uniform_variances` or :func:`normal_variances` (``scheme``) of a :func:`group_sample` of ``flat``,
    scaled to the whole tensor, as one float32 tensor, a sum a width in ``widths``' order: what ``ChoiceMeter``
    measures of each scheme. The C++ kernels read the sampled groups where they lie (no copy, no view), in one call."""
    flat = flat.detach().reshape(-1)
    if flat.numel() and _on_cpu_kernels(flat):
        stride, scale = _sample_stride(flat.numel(), group_size)
        return _closed_sums(flat, widths, group_size, scheme, scale, stride)
    sample, scale = group_sample(flat, group_size)
    return _closed_sums(sample, widths, group_size, scheme, scale)


def uniform_variances(flat: torch.Tensor, widths: tuple[int, ...], group_size: int) -> dict[int, torch.Tensor]:
    """:func:`rounding_variance` of the uniform scheme at each of ``widths`` (1 to 8 bits), from each group's
    range found once, in closed form: an element at ``r = (x - lo) / step`` steps from its group's lowest level
    costs ``step**2 f (1 - f)``, ``f`` the fraction of ``r``. Groups holding NaN or +-Inf use their grid centred
    on zero. Computed in float64 from the step the quantizer stores (its float32 rounding aside), it matches the
    exact levels to about 1e-6 of a step; a tenth of the exact function's cost a width, for the free estimator's
    collecting step (``ChoiceMeter``), which measures every width of every tensor. C++ on a CPU, torch ops
    elsewhere."""
    return _closed_form(flat, widths, group_size, "uniform")


def normal_variances(flat: torch.Tensor, widths: tuple[int, ...], group_size: int) -> dict[int, torch.Tensor]:
    """:func:`rounding_variance` of the normal scheme at each of ``widths``, the metadata fitted once (it does not
    depend on the width) and each element's error in closed form on its segment's uniform grid, as
    :func:`uniform_variances` does: ``step**2 f (1 - f)``. Matches the exact levels to float32 rounding (where two
    segments meet, the exact function takes the next segment's first level; here the segment's own top)."""
    return _closed_form(flat, widths, group_size, "normal")


def _closed_form(flat, widths: tuple[int, ...], group_size: int, scheme: str) -> dict[int, torch.Tensor]:
    """:func:`_closed_sums` of every group, as a 0-d float32 tensor a width."""
    return dict(zip(widths, _closed_sums(flat, widths, group_size, scheme).unbind(), strict=True))


def _closed_sums(
    flat, widths: tuple[int, ...], group_size: int, scheme: str, scale: float = 1.0, stride: int = 1
) -> torch.Tensor:
    """Each width's summed error (float64), times ``scale``, as float32, one a width: the C++ kernels where they take
    the tensor (of every ``stride``-th whole group from ``stride`` 2: :func:`group_sample`'s, read in place), else the
    torch form (of every group)."""
    flat = flat.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(len(widths), dtype=torch.float32, device=flat.device)
    if _on_cpu_kernels(flat):
        kernel = cpu.uniform_variances if scheme == "uniform" else cpu.normal_variances
        return kernel(flat.contiguous(), widths, group_size, stride, scale)
    padded, valid = _padded(flat, group_size)
    form = _uniform_sums if scheme == "uniform" else _normal_sums
    return (torch.stack(form(padded, valid, widths, group_size)) * scale).float()


def _on_cpu_kernels(flat: torch.Tensor) -> bool:
    """Whether the C++ kernels compute the closed forms here (a CPU tensor of a dtype they take, and built)."""
    return cpu.takes(flat)


def _uniform_sums(x: torch.Tensor, valid: torch.Tensor, widths: tuple[int, ...], group_size: int) -> list:
    """The uniform closed form's float64 sum a width, of the padded groups ``x`` (``valid``: real elements)."""
    x = x.double()
    finite = valid & torch.isfinite(x)
    special = (valid & ~finite).any(1)
    inf = float("inf")
    fmin = torch.where(finite, x, inf).amin(1)
    fmax = torch.where(finite, x, -inf).amax(1)
    fmin, fmax = torch.where(fmin < inf, fmin, 0.0), torch.where(fmax > -inf, fmax, 0.0)
    span = torch.where(special, 2.0 * torch.maximum(-fmin, fmax), fmax - fmin)
    x = torch.where(finite, x, 0.0)
    sums = []
    for bits in widths:
        levels = (1 << bits) - 1
        factor = torch.where(special, step_factor(levels - 1), step_factor(levels))
        step = torch.where(span > 0, (span * factor).clamp(MIN_STEP, FLT_MAX), 0.0)
        if levels == 1:
            step = torch.where(special, 0.0, step)  # one level, zero: nothing is rounded
        origin = torch.where(special, -((levels - 1) // 2) * step, fmin)
        r = (x - origin[:, None]) / torch.where(step > 0, step, 1.0)[:, None]
        f = r - r.floor()
        error = (step * step)[:, None] * f * (1 - f)
        sums.append(torch.where(finite & (step > 0)[:, None], error, 0.0).sum())
    return sums


def _normal_sums(x: torch.Tensor, valid: torch.Tensor, widths: tuple[int, ...], group_size: int) -> list:
    """The normal closed form's float64 sum a width, of the padded groups ``x`` (``valid``: real elements)."""
    meta = _encode_meta(x, valid)
    live = valid & torch.isfinite(x)
    sums = []
    for bits in widths:
        xs, origin, step, _, count, scale = _segments(x, meta, bits)
        step, unscale = step.double(), torch.where(scale < 1, 4.0, 1.0).double()[:, None]
        r = ((xs.double() - origin.double()) / torch.where(step > 0, step, 1.0)).clamp(min=0.0)
        r = torch.minimum(r, count.double())
        f = r - r.floor()
        error = (step * unscale) ** 2 * f * (1 - f)
        sums.append(torch.where(live & (step > 0) & torch.isfinite(error), error, 0.0).sum())
    return sums
