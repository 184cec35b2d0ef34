"""FewBit's few-bit backward for smooth activations: bins of the input whose derivative levels are optimal.

The backward of ``y = f(x)`` needs ``f'(x)`` only. FewBit (Novikov et al., 2023) stores instead of ``x`` a
``b``-bit code: the index of the bin of ``x`` among ``2**b`` intervals, and multiplies the gradient by that
bin's level. Bins and levels minimise the squared derivative error under a weight ``w``::

    min over bins I_k and levels l_k of   sum_k  integral over I_k of (f'(x) - l_k)^2 w(x) dx

For fixed bins the best level is the ``w``-weighted mean of ``f'`` over the bin; the bins are found by
dynamic programming over a fine grid (exact on the grid). ``w`` is the standard normal density: what a
normalised pre-activation looks like; the outer bins reach to -inf and +inf.

gactx cannot change the op's backward (no module is replaced), so a code decodes to a *point* ``p_k`` of
its bin where the op's own derivative equals the level, ``f'(p_k) = l_k`` (it exists: the level is a mean
of the continuous ``f'`` over the bin). The op's unchanged backward then computes exactly FewBit's
``l_k * grad``. For ops that save their output (sigmoid, tanh) the bins and points are mapped through ``f``.

Tables are computed here, once per (function, parameters, bits), from the op itself on a float64 grid:
nothing is downloaded.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["FUNCTIONS", "FewBitTable", "fewbit_table", "derivative_error"]

# The op as autograd runs it, by name; ``params`` are its scalar arguments as the rule table passes them.
FUNCTIONS = {
    "gelu": lambda x, approximate="none": F.gelu(x, approximate=approximate),
    "silu": lambda x: F.silu(x),
    "mish": lambda x: F.mish(x),
    "elu": lambda x, alpha=1.0, scale=1.0, input_scale=1.0: torch.ops.aten.elu(x, alpha, scale, input_scale),
    "celu": lambda x, alpha=1.0: F.celu(x, alpha),
    "softplus": lambda x, beta=1.0, threshold=20.0: F.softplus(x, beta, threshold),
    "hardswish": lambda x: F.hardswish(x),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
# Ops whose backward reads their output, not their input: codes and points live in the output's space.
SAVES_RESULT = {"sigmoid", "tanh"}

GRID = 6001  # grid points on [-LIMIT, LIMIT]: 0.004 apart, fine next to the width of a 16-level bin
LIMIT = 12.0
SCALES = (0.5, 1.0, 2.0, 4.0)
DP_POINTS = 801  # candidate bin edges for the dynamic programme (every fifth grid point)


@dataclass(frozen=True)
class FewBitTable:
    """``2**bits`` bins of the saved tensor: ``edges`` (``2**bits - 1`` inner edges, ascending), the code of
    ``v`` is the number of edges ``< v``; ``points[k]`` is what code ``k`` decodes to; ``levels[k]`` the
    derivative the op's backward computes there."""

    name: str
    bits: int
    edges: tuple[float, ...]
    points: tuple[float, ...]
    levels: tuple[float, ...]


def weight(x: np.ndarray) -> np.ndarray:
    """The weight of the squared error: an equal mixture of centred normal densities of scales SCALES, so that
    a table serves inputs of any of these widths (a single N(0, 1) leaves inputs beyond +-3 in one bin)."""
    w = sum(np.exp(-0.5 * (x / s) ** 2) / s for s in SCALES)
    return w / w.sum()


def _derivative(name: str, params: tuple, x: np.ndarray) -> np.ndarray:
    """``f'(x)`` by central differences in float64 (relative error about 1e-10). No autograd: tables are made
    inside saved-tensor hooks and below autograd's dispatch, where a graph cannot be recorded."""
    f, h = FUNCTIONS[name], 1e-6
    with torch.no_grad():
        hi = f(torch.tensor(x + h, dtype=torch.float64), **dict(params))
        lo = f(torch.tensor(x - h, dtype=torch.float64), **dict(params))
    return ((hi - lo) / (2 * h)).numpy()


def _segments(d: np.ndarray, w: np.ndarray, k: int) -> list[int]:
    """Indices of ``k - 1`` cut points (into DP_POINTS candidates) minimising the weighted squared error of a
    piecewise-constant fit to ``d``."""
    idx = np.linspace(0, d.size, DP_POINTS, dtype=np.int64)  # candidate cuts (segment ends) on the grid
    cw, cwd, cwd2 = (np.concatenate([[0.0], np.cumsum(a)]) for a in (w, w * d, w * d * d))
    sw, swd, swd2 = cw[idx], cwd[idx], cwd2[idx]
    # cost[i, j]: error of one segment from cut i to cut j (j > i)
    ww = sw[None, :] - sw[:, None]
    wd = swd[None, :] - swd[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = (swd2[None, :] - swd2[:, None]) - np.where(ww > 0, wd * wd / ww, 0.0)
    cost = np.where(np.triu(np.ones_like(cost, dtype=bool), 1), np.maximum(cost, 0.0), np.inf)
    best = cost[0].copy()  # best[j]: one segment from the start to cut j
    parents = []
    for _ in range(k - 1):
        total = best[:, None] + cost
        parent = np.argmin(total, axis=0)
        best = total[parent, np.arange(total.shape[1])]
        parents.append(parent)
    cuts, j = [], DP_POINTS - 1
    for parent in reversed(parents):
        j = int(parent[j])
        cuts.append(j)
    return [int(idx[c]) for c in reversed(cuts)]


@functools.lru_cache(maxsize=64)
def fewbit_table(name: str, params: tuple = (), bits: int = 2) -> FewBitTable:
    """The optimal ``2**bits``-bin table of ``FUNCTIONS[name]`` with scalar arguments ``params`` (a tuple of
    ``(name, value)`` pairs), for 1 to 8 bits (gactx stores 1, 2, 4 and 8; 3 serves the benchmark). Above 4
    bits, bins of equal weight instead of the (slow, pointless at that width) programme."""
    if name not in FUNCTIONS:
        raise ValueError(f"no FewBit table for {name!r}; known functions are {sorted(FUNCTIONS)}")
    if isinstance(bits, bool) or bits not in range(1, 9):
        raise ValueError(f"bits={bits!r}: FewBit tables have 1 to 8 bits")
    x = np.linspace(-LIMIT, LIMIT, GRID)
    w = weight(x)
    d = _derivative(name, params, x)
    k = 1 << bits
    if bits > 4:
        cuts = list(np.searchsorted(np.cumsum(w), np.arange(1, k) / k))
    else:
        cuts = _segments(d, w, k)
    bounds = [0, *cuts, GRID]
    edges, points, levels = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b <= a:  # an empty bin (possible only where the weight vanishes): repeat the neighbour
            b = a + 1
        level = float(np.sum(w[a:b] * d[a:b]) / max(np.sum(w[a:b]), 1e-300))
        i = a + int(np.argmin(np.abs(d[a:b] - level)))
        points.append(float(x[i]))
        levels.append(float(d[i]))
    edges = [float(0.5 * (x[c - 1] + x[c])) for c in cuts]
    if name in SAVES_RESULT:
        f = FUNCTIONS[name]
        with torch.no_grad():
            edges = f(torch.tensor(edges, dtype=torch.float64)).tolist()
            points = f(torch.tensor(points, dtype=torch.float64)).tolist()
    return FewBitTable(name, bits, tuple(edges), tuple(points), tuple(levels))


def derivative_error(name: str, params: tuple, bits: int, sigma: float = 1.0) -> float:
    """Relative RMS error of the table's derivative levels against ``f'`` for ``x ~ N(0, sigma^2)``."""
    table = fewbit_table(name, params, bits)
    x = np.linspace(-LIMIT * sigma, LIMIT * sigma, GRID)
    w = np.exp(-0.5 * (x / sigma) ** 2)
    d = _derivative(name, params, x)
    with torch.no_grad():
        saved = x if name not in SAVES_RESULT else FUNCTIONS[name](torch.tensor(x)).numpy()
    code = np.searchsorted(np.asarray(table.edges), saved, side="left")
    approx = np.asarray(table.levels)[code]
    return math.sqrt(float(np.sum(w * (d - approx) ** 2) / np.sum(w * d * d)))
