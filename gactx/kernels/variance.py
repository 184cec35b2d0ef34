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

from gactx.kernels.format import SCHEME_BITS, SCHEMES, pack_planes, unpack_planes
from gactx.kernels.schemes.normal.reference import normal_levels
from gactx.kernels.schemes.uniform.reference import quantize_groups, torch_dequantize

__all__ = ["rounding_variance"]


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
