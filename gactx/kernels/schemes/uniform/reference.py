"""The torch twins of the uniform scheme's kernels: the reference the Triton and C++ kernels are tested against,
and the arithmetic compiled graphs trace (``traced.py``). The arithmetic is ``format.py``'s."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gactx.kernels.schemes.uniform.format import FLT_MAX, MIN_STEP, allocate, step_factor

__all__ = ["quantize_groups", "torch_dequantize", "torch_quantize"]


def quantize_groups(
    flat: torch.Tensor, bits: int, group_size: int, noise: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's arithmetic, in torch ops that trace (no tensor made from host values): ``(codes, meta)`` of
    a 1-D float tensor. ``noise(index)`` gives ``1 + u`` at each position of the padded groups (an int64
    ``index`` of their shape); ``None`` rounds half up. :func:`torch_quantize` draws ``u`` from a
    ``torch.Generator``, ``traced.py`` from a hash of the index."""
    n = flat.numel()
    n_groups = -(-n // group_size)
    if n_groups == 0:
        return allocate(flat, bits, group_size)
    levels, per_byte = (1 << bits) - 1, 8 // bits
    padded = n_groups * group_size
    x = torch.nn.functional.pad(flat.float(), (0, padded - n)).view(n_groups, group_size)
    index = torch.arange(padded, device=flat.device, dtype=torch.int64).view(n_groups, group_size)
    valid = index < n

    finite = valid & torch.isfinite(x)
    inf = float("inf")
    fmin = torch.where(finite, x, inf).amin(1)
    fmax = torch.where(finite, x, -inf).amax(1)
    has_nan, has_pinf, has_ninf = ((valid & m).any(1) for m in (x.isnan(), x == inf, x == -inf))
    special = has_nan | has_pinf | has_ninf
    fmin = torch.where(fmin < inf, fmin, 0.0)
    fmax = torch.where(fmax > -inf, fmax, 0.0)

    span = torch.where(special, 2.0 * torch.maximum(-fmin, fmax), fmax - fmin)
    scale = torch.where(special | (span <= FLT_MAX), 1.0, 0.25)  # 0.25: the span overflowed (module docstring)
    factor = torch.where(special, step_factor(levels - 1), step_factor(levels)).to(torch.float32)
    step = torch.where(scale < 1, fmax * factor - fmin * factor, span * factor)
    step = step.clamp(max=FLT_MAX)
    step = torch.where(span > 0, step.clamp(min=MIN_STEP), 0.0)
    if levels == 1:
        step = torch.where(special, 0.0, step)
    inv = torch.where(step > 0, 1.0 / torch.where(step > 0, step * scale, 1.0), 0.0)
    kind = torch.where(has_nan | (has_pinf & has_ninf), float("nan"), torch.where(has_pinf, inf, -inf))
    origin = torch.where(special, 0.0, fmin) * scale
    shift = torch.where(special, (levels - 1) // 2, 0).float()
    lo = torch.where(special, kind, fmin)

    one_plus_u = 1.5 if noise is None else noise(index)
    s = ((x * scale[:, None] - origin[:, None]) * inv[:, None] + (shift[:, None] + one_plus_u)).abs()
    s = torch.where(valid, torch.fmin(s, torch.full((), levels + 1.0, device=x.device)), 1.0)
    q = s.to(torch.int32) - 1

    shifts = torch.arange(per_byte, device=flat.device, dtype=torch.int32)[:, None] * bits
    packed = (q.view(n_groups, per_byte, group_size // per_byte) << shifts).sum(1)  # planes, see format.py
    return packed.to(torch.uint8).view(-1), torch.stack([lo, step], dim=1)


def torch_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference and CPU path of :func:`triton_quantize`: same contract, same arithmetic."""
    noise = None
    if stochastic:
        gen = torch.Generator(device=flat.device).manual_seed(seed)
        noise = lambda index: 1.0 + torch.rand(index.shape, generator=gen, device=flat.device)  # noqa: E731
    return quantize_groups(flat, bits, group_size, noise)


def torch_dequantize(
    codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """The reference and CPU path of :func:`triton_dequantize`: same contract, same arithmetic."""
    n_groups = meta.shape[0]
    if n_groups == 0:
        return torch.empty(n, dtype=dtype, device=codes.device)
    levels, per_byte = (1 << bits) - 1, 8 // bits
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32)[:, None] * bits
    planes = codes.view(n_groups, 1, group_size // per_byte).to(torch.int32) >> shifts  # see format.py
    q = (planes & levels).view(n_groups, group_size)

    lo, step = meta[:, 0:1], meta[:, 1:2]
    special = ~torch.isfinite(lo)
    base = torch.where(special, 0.0, lo)
    wide = (base < -1) & (levels * step > FLT_MAX)  # see the module docstring
    half, twice = torch.where(wide, 0.5, 1.0), torch.where(wide, 2.0, 1.0)
    step, base = step * half, base * half
    centre = torch.where(special, (levels - 1) // 2, 0).to(torch.int32)  # q's type: no int64 arithmetic
    out_max = torch.finfo(dtype).max  # the output's largest finite value: finite values saturate there
    top = torch.where(special, lo, ((levels * step + base) * twice).clamp(-out_max, out_max))
    value = (((q - centre).float() * step + base) * twice).clamp(-out_max, out_max)
    value = torch.where(q == levels, top, value)
    return value.view(-1)[:n].to(dtype)
