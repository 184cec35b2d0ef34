"""The free estimator's reductions (``gactx/controller/adaptation/free_sensitivity.py``), read during an ordinary
training step: each row's rounding variance as a tensor is saved, the mean inverse variance of a normalisation's input,
and each output gradient row's squared norm weighted by the rows' variances as the gradient arrives. One C++ call each
on a CPU (``csrc/free.cpp``), torch ops elsewhere (the oracle); no value is read back to the host."""

from __future__ import annotations

import math

import torch

from gactx.kernels import cpu

__all__ = ["add_weighted_norms", "mean_inverse_variance", "row_variances"]


def row_variances(t: torch.Tensor, group_size: int, rows: int = 1) -> torch.Tensor:
    """Per row of ``t``'s ``rows`` equal rows (of its elements in order), the variance stochastic rounding adds to its
    elements per unit of ``S(b)`` on the uniform grid's model: each element takes its group's ``R**2 / 6``, ``R`` the
    range of its group of ``group_size`` consecutive elements (the last group's its own). ActNN's estimate, read by the
    free estimator in its collecting step: a float32 tensor of ``rows`` on ``t``'s device, no host read. The C++
    kernel on a CPU (one call), the torch form elsewhere, as its oracle."""
    flat = t.detach().reshape(-1)
    if flat.numel() % rows:
        raise ValueError(f"rows={rows!r} does not divide the tensor's {flat.numel()} elements")
    if cpu.takes(flat):
        return cpu.row_variances(flat.contiguous(), group_size, rows)
    return _row_variances(flat, group_size, rows)


def add_weighted_norms(total: torch.Tensor, g: torch.Tensor, weights: torch.Tensor) -> None:
    """``total += sum_r weights[r] * ||g_r||**2`` in place, over ``g``'s ``weights.numel()`` equal rows (of its elements
    in order): the free estimator's product of a module's output gradient with the rounding variance of each row of
    what it saved (:func:`row_variances`). ``total``: one float32 element; ``weights``: float32, 1-D. No host read.
    One C++ call on a CPU (each row's squares summed in float64), torch ops elsewhere."""
    g = g.detach()
    if cpu.takes(g) and total.device.type == "cpu":
        cpu.add_weighted_norms(total, g.contiguous(), weights)
    else:
        total.add_((g.reshape(weights.numel(), -1).float().square().sum(1) * weights).sum())


def _row_variances(flat: torch.Tensor, group_size: int, rows: int) -> torch.Tensor:
    """:func:`row_variances` in torch ops."""
    n = flat.numel()
    pad = -n % group_size
    if n == 0:
        return flat.new_zeros(rows, dtype=torch.float32)
    padded = torch.cat([flat, flat[-1:].expand(pad)]) if pad else flat  # the tail's own range, no host read
    groups = padded.view(-1, group_size)
    lo, hi = groups.amin(1), groups.amax(1)  # not torch.aminmax(dim=1): ten times slower on a CPU
    group = (hi.float() - lo.float()).square() / 6
    if rows == 1:  # each group's elements, the tail's its own count
        counts = torch.full_like(group, group_size)
        counts[-1] = group_size - pad
        return (group * counts).sum().reshape(1)
    row = n // rows
    if not pad and row % group_size == 0:  # whole groups a row: no tensor of an element's share
        return group.view(rows, -1).sum(1) * group_size
    if not pad and group_size % row == 0:  # whole rows a group: each of its rows takes ``row`` elements' shares
        return group.repeat_interleave(group_size // row) * row
    per_element = group[:, None].expand(-1, group_size).reshape(-1)[:n]
    return per_element.view(rows, -1).sum(1)


def mean_inverse_variance(t: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """The mean of ``1 / (var + eps)`` over ``t``'s slices, ``var`` each slice's variance over ``dims`` (biased, from
    its centred values): what a normalisation divides its input's noise by, on average (``dims``: a LayerNorm's last
    dimensions, or a BatchNorm's all but the channels, ``(0, 2, 3, ...)``). One float32 element, no host read."""
    x = t.detach()
    layout = _layout(tuple(x.shape), dims)
    if layout is not None and cpu.takes(x):
        return cpu.inverse_variance(x.contiguous(), *layout, eps)
    x = x.float()
    # The variance as the squared norm of the centred values: torch's var over the last dimension took 2.2 ms of a
    # 16 x 64 x 768 LayerNorm input on a CPU, this 0.12 ms (a BatchNorm input's, over three dimensions, 2.3 times less).
    count = math.prod(x.shape[d] for d in dims)
    var = torch.linalg.vector_norm(x - x.mean(dims, keepdim=True), dim=dims).square() / max(count, 1)
    return (1 / (var + eps)).mean().reshape(1)


def _layout(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(outer, channels, inner)``: ``shape`` seen as those three, reduced over the outer and inner ones, where
    ``dims`` are trailing (``outer`` 1) or all but dimension 1; else ``None``."""
    d = len(shape)
    if not dims or len(set(dims)) != len(dims) or any(not 0 <= i < d for i in dims):
        return None
    if tuple(sorted(dims)) == tuple(range(d - len(dims), d)):
        return 1, math.prod(shape[: d - len(dims)]), math.prod(shape[d - len(dims) :])
    if d >= 2 and tuple(sorted(dims)) == (0, *range(2, d)):
        return shape[0], shape[1], math.prod(shape[2:])
    return None
