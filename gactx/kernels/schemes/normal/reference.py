"""The normal scheme's torch twins (the format: ``format.py``): the oracle the Triton and C++ kernels are tested
against, byte for byte in deterministic mode; ``normal_levels``, the two levels each element falls between."""

from __future__ import annotations

import torch

from gactx.kernels.format import pack_planes, unpack_planes
from gactx.kernels.schemes.normal.format import (
    DEV_SHIFT,
    FRACTION,
    INV_FRACTION,
    NORMAL_BITS,
    SHAPES,
    allocate,
    factors,
)
from gactx.kernels.schemes.uniform.format import FLT_MAX, MIN_STEP

__all__ = ["normal_levels", "torch_normal_dequantize", "torch_normal_quantize"]


def _torch_knots(lo: torch.Tensor, hi: torch.Tensor, c16: torch.Tensor, d16: torch.Tensor, special, bits: int):
    """:func:`_knots` in torch, on ``[n_groups]`` tensors: the same float32 operations in the same order."""
    f = factors(bits)
    levels = (1 << bits) - 1
    tail = SHAPES[bits][1]
    base = torch.where(special, -hi, lo)
    scale = torch.where(hi - base <= FLT_MAX, 1.0, 0.25)
    a0 = base * scale
    top = hi * scale
    unit = (top - a0) * INV_FRACTION
    centre = a0 + c16.float() * unit
    spread = d16.float() * unit
    b1 = centre - spread * f["k"]
    b2 = centre + spread * f["k"]
    inner = (b2 - b1) * f["share"]
    lower = ((b1 - a0) > inner) & ~special
    upper = ((top - b2) > inner) & ~special
    zero = torch.zeros((), dtype=torch.int32, device=lo.device)
    n0 = torch.where(lower, tail, zero)
    n2 = torch.where(upper, tail, zero)
    n1 = torch.where(special, levels - 1, levels - n0 - n2).to(torch.int32)
    step0 = torch.where(lower, ((b1 - a0) * f["tail"]).clamp(min=MIN_STEP), 0.0)
    a1 = a0 + n0.float() * step0
    f_inner = torch.where(lower, f["inner_both"], f["inner_no_lower"])
    f_last = torch.where(special, f["last_special"], torch.where(lower, f["last_with_lower"], f["last_alone"]))
    w1 = torch.where(upper, b2, top) - a1
    step1 = torch.where(w1 > 0, (w1 * torch.where(upper, f_inner, f_last)).clamp(min=MIN_STEP), 0.0)
    a2 = a1 + n1.float() * step1
    w2 = top - a2
    step2 = torch.where(upper & (w2 > 0), (w2 * f["last_tail"]).clamp(min=MIN_STEP), 0.0)
    return scale, (a0, a1, a2), (step0, step1, step2), (n0, n0 + n1), (n0, n1, n2)


def _unpack_meta(meta: torch.Tensor):
    """``(lo, hi, C, D, special, kind)`` of int32 metadata ``[n_groups, 3]``."""
    lo, hi = meta[:, 0].contiguous().view(torch.float32), meta[:, 1].contiguous().view(torch.float32)
    special = ~torch.isfinite(lo)
    c16, d16 = meta[:, 2] & 0xFFFF, (meta[:, 2] >> 16) & 0xFFFF
    return torch.where(special, 0.0, lo), hi, c16, d16, special, lo


def _encode_meta(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Int32 metadata ``[n_groups, 3]`` of the padded groups ``x`` (``valid`` marks real elements)."""
    inf = float("inf")
    finite = valid & torch.isfinite(x)
    fmin = torch.where(finite, x, inf).amin(1)
    fmax = torch.where(finite, x, -inf).amax(1)
    has_nan, has_pinf, has_ninf = ((valid & m).any(1) for m in (x.isnan(), x == inf, x == -inf))
    special = has_nan | has_pinf | has_ninf
    fmin = torch.where(fmin < inf, fmin, 0.0) + 0.0  # -0 as +0, as the kernel (any reduction order)
    fmax = torch.where(fmax > -inf, fmax, 0.0) + 0.0
    lo = torch.where(special, 0.0, fmin)
    hi = torch.where(special, torch.maximum(-fmin, fmax) + 0.0, fmax)

    base = torch.where(special, -hi, lo)
    scale = torch.where(hi - base <= FLT_MAX, 1.0, 0.25)
    a0 = base * scale
    span = hi * scale - a0
    r = torch.where(span > 0, (FRACTION / torch.where(span > 0, span, 1.0)).clamp(max=FLT_MAX), 0.0)
    v = ((x * scale[:, None] - a0[:, None]) * r[:, None]).clamp(max=FRACTION)
    u = torch.where(finite, v + 0.5, 0.0).to(torch.int32)
    count = valid.sum(1, dtype=torch.int32).clamp(min=1)
    c16 = torch.div(u.sum(1, dtype=torch.int32) + count // 2, count, rounding_mode="floor").clamp(max=65535)
    e = ((u - c16[:, None]).abs() + 32) >> DEV_SHIFT
    squares = torch.where(finite, e * e, 0).sum(1, dtype=torch.int32)
    var = squares.float() / count.float()
    # float64's square root rounded to float32 is IEEE's float32 square root (the kernels' sqrt_rn); torch's own
    # float32 sqrt on a CPU may be a unit in the last place off.
    d16 = (var.double().sqrt().float() * 64.0 + 0.5).to(torch.int32).clamp(max=65535)
    c16 = torch.where(special, 0, c16)
    d16 = torch.where(special, 0, d16)

    kind = torch.where(has_nan | (has_pinf & has_ninf), 0x7FC00000, torch.where(has_pinf, 0x7F800000, -0x800000))
    word0 = torch.where(special, kind.to(torch.int32), lo.view(torch.int32))
    word2 = (c16.long() | (d16.long() << 16)).to(torch.int32)
    return torch.stack([word0, hi.view(torch.int32), word2], dim=1)


def _segments(x: torch.Tensor, meta: torch.Tensor, bits: int):
    """Per element (``[n_groups, group_size]``): scaled value, segment origin, step, first code, intervals, and
    the group's scale, from the metadata."""
    lo, hi, c16, d16, special, _ = _unpack_meta(meta)
    scale, (a0, a1, a2), steps, (j1, j2), counts = _torch_knots(lo, hi, c16, d16, special, bits)
    xs = x * scale[:, None]
    up, mid = xs >= a2[:, None], xs >= a1[:, None]

    def pick(k2, k1, k0):
        return torch.where(up, k2[:, None], torch.where(mid, k1[:, None], k0[:, None]))

    zero = torch.zeros_like(j1)
    return xs, pick(a2, a1, a0), pick(*steps[::-1]), pick(j2, j1, zero), pick(*counts[::-1]), scale


def _codes(x, meta, bits, one_plus_u):
    """Codes (int32, ``[n_groups, group_size]``) of the padded groups ``x``: ``one_plus_u`` the noise."""
    xs, origin, step, first, count, _ = _segments(x, meta, bits)
    inv = torch.where(step > 0, 1.0 / torch.where(step > 0, step, 1.0), 0.0)
    s = torch.minimum((xs - origin) * inv + one_plus_u, (count + 1).float())
    fin = torch.isfinite(x)
    s = torch.where(fin, s, 1.0)
    return torch.where(fin, first + s.to(torch.int32) - 1, (1 << bits) - 1)


def _levels(q: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 levels of codes ``q`` (``[n_groups, group_size]``), before any saturation, non-finite codes as the
    group's non-finite value: what :func:`torch_normal_dequantize` writes, unsaturated."""
    lo, hi, c16, d16, special, kind = _unpack_meta(meta)
    scale, (a0, a1, a2), (s0, s1, s2), (j1, j2), _ = _torch_knots(lo, hi, c16, d16, special, bits)
    up, mid = q >= j2[:, None], q >= j1[:, None]

    def pick(k2, k1, k0):
        return torch.where(up, k2[:, None], torch.where(mid, k1[:, None], k0[:, None]))

    origin, step = pick(a2, a1, a0), pick(s2, s1, s0)
    start = pick(j2, j1, torch.zeros_like(j1))
    value = ((q - start).float() * step + origin) * torch.where(scale < 1, 4.0, 1.0)[:, None]
    return value, special[:, None] & (q == (1 << bits) - 1), kind[:, None]


def _padded(flat: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = flat.numel()
    n_groups = -(-n // group_size)
    x = torch.nn.functional.pad(flat.float(), (0, n_groups * group_size - n)).view(n_groups, group_size)
    index = torch.arange(n_groups * group_size, device=flat.device).view(n_groups, group_size)
    return x, index < n


def torch_normal_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of :func:`triton_normal_quantize` and of the C++ kernels (the CPU path where those cannot be
    built): same contract, same arithmetic; the noise from ``torch.rand`` of a ``torch.Generator`` seeded with
    ``seed``."""
    assert bits in NORMAL_BITS
    if flat.numel() == 0:
        return allocate(0, bits, group_size, flat.device)
    x, valid = _padded(flat, group_size)
    meta = _encode_meta(x, valid)
    if stochastic:
        gen = torch.Generator(device=flat.device).manual_seed(seed)
        one_plus_u = 1.0 + torch.rand(x.shape, generator=gen, device=flat.device)
    else:
        one_plus_u = 1.5
    q = torch.where(valid, _codes(x, meta, bits, one_plus_u), 0)
    return pack_planes(q, bits), meta


def torch_normal_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """The reference of :func:`triton_normal_dequantize` and of the C++ kernels (the CPU path where those cannot be
    built)."""
    if meta.shape[0] == 0:
        return torch.empty(n, dtype=dtype, device=codes.device)
    value, non_finite, kind = _levels(unpack_planes(codes, bits, group_size), meta, bits)
    out_max = torch.finfo(dtype).max
    value = torch.where(non_finite, kind, value.clamp(-out_max, out_max))
    return value.view(-1)[:n].to(dtype)


def normal_levels(flat: torch.Tensor, bits: int, group_size: int):
    """``(x, below, above, live)``, each ``[n_groups, group_size]``: the padded groups in float32, the two levels
    between which stochastic rounding puts each element (decoded as float32, saturated at FLT_MAX) from the
    metadata the quantizer stores, and which elements are real and finite. For ``variance.py``."""
    x, valid = _padded(flat, group_size)
    meta = _encode_meta(x, valid)
    q = _codes(x, meta, bits, 1.0)  # u = 0: the level below
    top = (1 << bits) - 1
    below, _, _ = _levels(q, meta, bits)
    above, _, _ = _levels(torch.clamp(q + 1, max=top), meta, bits)
    return x, below.clamp(-FLT_MAX, FLT_MAX), above.clamp(-FLT_MAX, FLT_MAX), valid & torch.isfinite(x)
