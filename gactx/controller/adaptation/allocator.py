"""Bits per tensor under a memory budget: minimise the predicted gradient variance.

Model (ActNN, GACT): compressing tensor ``l`` at ``b`` bits adds gradient variance ``C_l * S(b)``, the
variances of different tensors add up, and::

    S(b) = 1 / (2**b - 1)**2        for b in 1, 2, 4, 8 (uniform grid over the group's range)
    S(16) = S(8) / 16               bfloat16 keeps 8 significant bits of each element, not of the range:
                                    its error is at least 4x smaller than 8-bit codes' (16x in variance)
    S(32) = 0                       stored as is (and 16 for fp16/bf16 inputs, which are stored as is)

The input of a normalisation is read twice over by backward (``rules.curved``): its variance is ``C_l (a S(b) +
q S(b)**2)``, the shape ``(a, q)`` measured at two widths (``curves.fit_curve``; ``(1, 0)`` for the others).

Where the values of a tensor were measured (``choices.py``), its item lists explicit options instead: every way it may
be stored (a width of uniform codes, of normal-fitted levels, a sketch of its rows) with the bytes it holds and the
variance it adds per unit of sensitivity, from that tensor's own rounding and sampling errors.

The problem, ``min sum C_l S(b_l)  s.t.  sum bytes(l, b_l) <= budget``, is a multiple-choice knapsack.
Greedy narrowing by variance per byte is optimal only where the budget falls on a breakpoint; instead
:func:`allocate` walks the items keeping the Pareto frontier of (bytes, variance) over partial choices,
which is exact. A partial choice that no completion can make better than a whole allocation found first (a
Lagrangian bound, :func:`_bound`, against the Lagrangian picks with the bytes they leave spent greedily) is dropped,
which keeps the frontier small: on the LoRA decoder's 94 tensors (small, the default schemes, a later adaptation's
options) 0.06 s, 0.44 s against the picks alone, and 1.8 s unbounded. Should the frontier still grow past
``max_frontier`` points it is thinned to the best point in each of ``max_frontier`` equal byte intervals, so the result
stays within one interval's worth of bytes of the optimum's trade-off.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gactx.controller.adaptation.choices import Choice
from gactx.controller.adaptation.widths import WIDTHS, variance_factor, widths_for
from gactx.kernels.codes import coded_nbytes
from gactx.kernels.format import as_is_width, expected_nbytes

__all__ = ["WIDTHS", "Item", "Allocation", "variance_factor", "widths_for", "allocate", "cost_of"]


@dataclass(frozen=True)
class Item:
    key: Hashable
    numel: int
    dtype: torch.dtype
    sensitivity: float
    as_is_bytes: int | None = None  # what keeping it as is costs, if more than its elements (a view)
    widths: tuple[int, ...] | None = None  # the widths its class allows (None: all)
    coded: bool = False  # widths up to 8 are FewBit codes: no per-group metadata, a table
    # Measured options, (choice, bytes, variance per unit of sensitivity) each: they replace ``widths`` (choices.py).
    options: tuple[tuple[Choice, int, float], ...] | None = None
    response: tuple[float, float] = (1.0, 0.0)  # (a, q): the variance at S(b) = x is sensitivity * (a x + q x**2)


def _bytes(item: Item, bits: int, group_size: int) -> int:
    if item.coded and bits <= 8:
        return coded_nbytes(item.numel, bits, item.dtype)
    nbytes = expected_nbytes(item.numel, item.dtype, bits, group_size)
    return max(nbytes, item.as_is_bytes or 0) if as_is_width(bits, item.dtype) else nbytes


@dataclass(frozen=True)
class Allocation:
    bits: dict  # key -> width
    nbytes: int
    variance: float
    feasible: bool  # False: even the narrowest widths exceed the budget (they were chosen anyway)
    choices: dict | None = None  # key -> Choice (its width, scheme and fraction of rows)
    # The variance the allocation made before would have under this estimate (cost_of), where it still offers every
    # item's choice within the budget; else None. Near ``variance``: the allocation had not moved (schedule.py).
    kept_variance: float | None = None


def allocate(items: Sequence[Item], budget: int, group_size: int = 256, max_frontier: int = 20_000) -> Allocation:
    """The widths (from :data:`WIDTHS`) that minimise ``sum C S(b)`` with ``sum bytes <= budget``.

    Ties in variance go to fewer bytes. If no choice fits, every item gets its narrowest width and the
    allocation is marked infeasible.
    """
    options = [_options(item, group_size) for item in items]
    floor = sum(int(o[1].min()) for o in options)
    if floor > budget:
        chosen = {item.key: o[0][int(np.argmin(o[1]))] for item, o in zip(items, options, strict=True)}
        variance = sum(float(o[2][int(np.argmin(o[1]))]) for o in options)
        return Allocation({k: c.bits for k, c in chosen.items()}, floor, variance, False, chosen)

    # Bytes the items after i need at least: a partial choice that cannot leave that much is dropped.
    rest = np.concatenate([np.cumsum([o[1].min() for o in options][::-1])[::-1], [0]]).astype(np.int64)
    bound = _bound(options, budget)
    front_bytes, front_var = np.zeros(1, dtype=np.int64), np.zeros(1)
    trail = []  # per item: (parent index into the previous frontier, option index) of each frontier point
    for i, (_, nbytes, var) in enumerate(options):
        cand_bytes = (front_bytes[:, None] + nbytes[None, :]).ravel()
        cand_var = (front_var[:, None] + var[None, :]).ravel()
        parent = np.repeat(np.arange(front_bytes.size), nbytes.size)
        choice = np.tile(np.arange(nbytes.size), front_bytes.size)
        ok = cand_bytes + rest[i + 1] <= budget
        if bound is not None:  # no completion of it can beat a whole allocation known already
            upper, lam, suffix = bound
            ok &= cand_var + suffix[i + 1] - lam * (budget - cand_bytes) <= upper
        cand_bytes, cand_var, parent, choice = cand_bytes[ok], cand_var[ok], parent[ok], choice[ok]
        order = np.lexsort((cand_var, cand_bytes))  # by bytes, then variance
        cand_bytes, cand_var, parent, choice = cand_bytes[order], cand_var[order], parent[order], choice[order]
        # Pareto: keep a point only if its variance is below every point with fewer or equal bytes.
        best_before = np.concatenate([[np.inf], np.minimum.accumulate(cand_var)[:-1]])
        keep = cand_var < best_before
        if keep.sum() > max_frontier:
            keep &= _thin(cand_bytes, cand_var, keep, max_frontier, budget)
        front_bytes, front_var = cand_bytes[keep], cand_var[keep]
        trail.append((parent[keep], choice[keep]))

    point = int(np.argmin(front_var))  # the frontier is sorted by bytes: argmin takes the fewest bytes on ties
    total_bytes, total_var = int(front_bytes[point]), float(front_var[point])
    chosen = {}
    for item, (choices, _, _), (parents, picked) in zip(items[::-1], options[::-1], trail[::-1], strict=True):
        chosen[item.key] = choices[int(picked[point])]
        point = int(parents[point])
    chosen = dict(reversed(chosen.items()))
    return Allocation({k: c.bits for k, c in chosen.items()}, total_bytes, total_var, True, chosen)


def cost_of(items: Sequence[Item], chosen: dict, group_size: int = 256) -> tuple[int, float] | None:
    """The bytes and variance of storing each item as ``chosen`` says (key -> Choice), priced as :func:`allocate`
    prices its options; ``None`` where an item has no choice in ``chosen`` or its choice is not among its options."""
    nbytes, variance = 0, 0.0
    for item in items:
        choice = chosen.get(item.key)
        choices, item_bytes, item_var = _options(item, group_size)
        if choice not in choices:
            return None
        i = choices.index(choice)
        nbytes, variance = nbytes + int(item_bytes[i]), variance + float(item_var[i])
    return nbytes, variance


def _options(item: Item, group_size: int) -> tuple[tuple[Choice, ...], np.ndarray, np.ndarray]:
    """The item's choices, with their bytes and variances (``sensitivity * factor``)."""
    c = max(item.sensitivity, 0.0)
    if item.options is not None:
        choices = tuple(o[0] for o in item.options)
        nbytes = np.array([o[1] for o in item.options], dtype=np.int64)
        return choices, nbytes, np.array([c * o[2] for o in item.options])
    widths = tuple(w for w in widths_for(item.dtype) if item.widths is None or w in item.widths)
    nbytes = np.array([_bytes(item, b, group_size) for b in widths], dtype=np.int64)
    a, q = item.response
    var = np.array([c * (a * x + q * x * x) for x in (variance_factor(b, item.dtype) for b in widths)])
    return tuple(Choice(b) for b in widths), nbytes, var


def _bound(options: list, budget: int) -> tuple[float, float, np.ndarray] | None:
    """``(U, lam, R)`` for pruning partial choices exactly: ``U`` the variance of a whole allocation within the budget
    (each item's option of least ``variance + lam * bytes``, ``lam`` the least of a bisection that fits, the bytes
    left then spent greedily: :func:`_filled`), and ``R[i]``
    the sum of that least over the items from ``i`` on. Any completion of a partial choice of ``b`` bytes and variance
    ``v`` then has a variance of at least ``v + R[i] - lam * (budget - b)`` (weak duality), so a partial choice whose
    bound exceeds ``U`` cannot lead to the optimum. ``None`` where there is nothing to bound."""
    if not options:
        return None
    width = max(o[1].size for o in options)
    nbytes = np.full((len(options), width), np.iinfo(np.int64).max // 4, dtype=np.int64)
    var = np.full((len(options), width), np.inf)
    for i, (_, b, v) in enumerate(options):
        nbytes[i, : b.size], var[i, : v.size] = b, v
    rows = np.arange(len(options))

    def pick(lam: float) -> np.ndarray:
        return np.argmin(var + lam * nbytes, axis=1)

    # At lam above the largest variance every item takes its fewest bytes (options differ by a byte at least).
    lo, hi = 0.0, float(var[np.isfinite(var)].max(initial=0.0)) + 1.0
    if int(nbytes[rows, pick(hi)].sum()) > budget:
        return None
    for _ in range(64):  # the least lam whose picks fit, to a relative 2**-64 of the range
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if int(nbytes[rows, pick(mid)].sum()) <= budget else (mid, hi)
    chosen = pick(hi)
    # The bytes those picks leave, filled (the tighter ``U``, the fewer partial choices survive: on the LoRA decoder's
    # 94 items of up to 24 options, 0.56M candidates where the picks alone left 4.3M, 48 ms against 440 ms)
    upper = min(_filled(nbytes, var, chosen, budget, by_ratio) for by_ratio in (True, False))
    least = (var + hi * nbytes)[rows, pick(hi)]
    suffix = np.concatenate([np.cumsum(least[::-1])[::-1], [0.0]])
    # Rounding in the bound's sums, whose terms (lam * bytes) may be far larger than the variances: never prune the
    # optimum (a slack of upper's size alone pruned every point where the variances were 1e-27 and lam * bytes 1e-19).
    slack = 1e-9 * max(upper, float(suffix[0]) + hi * budget, 1e-300)
    return upper + slack, hi, suffix


def _filled(nbytes: np.ndarray, var: np.ndarray, chosen: np.ndarray, budget: int, by_ratio: bool) -> float:
    """The variance of the allocation ``chosen`` (an option index an item; within ``budget``) with the bytes it leaves
    spent greedily: one item at a time to the option that lowers the variance most per byte added (``by_ratio``) or
    most, while one fits. A whole allocation within the budget, so an upper bound on the optimum."""
    rows = np.arange(len(chosen))
    chosen = chosen.copy()
    left = budget - int(nbytes[rows, chosen].sum())
    while True:
        added = nbytes - nbytes[rows, chosen][:, None]
        lowered = var[rows, chosen][:, None] - var
        fits = (added <= left) & (lowered > 0)
        if not fits.any():
            return float(var[rows, chosen].sum())
        score = lowered / np.maximum(added, 1) if by_ratio else lowered
        i, j = np.unravel_index(np.argmax(np.where(fits, score, -np.inf)), score.shape)
        left -= int(added[i, j])
        chosen[i] = j


def _thin(nbytes: np.ndarray, var: np.ndarray, keep: np.ndarray, max_frontier: int, budget: int) -> np.ndarray:
    """Keep, in each of ``max_frontier`` equal byte intervals, the Pareto point of least variance."""
    bucket = (nbytes * max_frontier) // max(budget, 1)
    idx = np.flatnonzero(keep)
    order = idx[np.lexsort((var[idx], bucket[idx]))]
    first = np.concatenate([[True], bucket[order][1:] != bucket[order][:-1]])
    out = np.zeros_like(keep)
    out[order[first]] = True
    return out
