"""Per-group quantization to 1/2/4/8-bit codes: ``_quantize_kernel``, ``triton_quantize``, ``torch_quantize``.

For a group with finite values in ``[min, max]`` and ``L = 2**bits - 1``::

    step = (max - min) / L * (1 + 2**-20)          # fp32; the margin keeps (x - min) / step <= L
    q    = floor((x - min) / step + u)             # u ~ U[0, 1): E[q * step + min] = x (unbiased)
                                                   # u = 1/2 with stochastic=False (round half up)

The margin costs 2**-19 of variance and guarantees that no code is clamped, so the rounding stays exactly
unbiased. A group whose range underflows float32 gets the smallest subnormal step (exact on that grid).
A group of identical values has step 0 and decodes exactly.

Groups that hold NaN or +-Inf (see ``format.py``): finite elements are quantized on a grid of ``L`` levels
centred on zero with ``step = 2 * max|x| / (L - 1)``, unbiased for ``bits >= 2``; at 1 bit they have one
level, zero. Their non-finite elements get the top code and come back as the group's non-finite value.

Both implementations compute the same float32 operations in the same order (IEEE division, no fused
multiply-add), so with ``stochastic=False`` they produce identical bytes. With ``stochastic=True`` the
noise differs (Philox in Triton, ``torch.Generator`` in torch) and only the statistics agree.
"""

from __future__ import annotations

import torch

from gactx.kernels._triton import jit, tl, triton
from gactx.kernels.half import bf16_bits_to_float

__all__ = ["triton_quantize", "torch_quantize", "launch_config"]

# float32 constants shared by both implementations.
SAFETY = 1.0 + 2.0**-20  # step margin, see the module docstring
FLT_MAX = 3.4028234663852886e38
TINY = 1.401298464324817e-45  # smallest positive subnormal float32
# About 4096 elements a program keeps a group's load, reduction and packing in registers at 4 warps.
ELEMENTS_PER_PROGRAM = 4096
# The interpreter runs programs one after another in Python: fewer, larger programs are much faster.
INTERPRET_ELEMENTS_PER_PROGRAM = 1 << 16


def launch_config(n_groups: int, group_size: int, interpret: bool) -> tuple[int, int]:
    """``(rows, num_warps)``: groups per program (a power of two) and warps for a launch."""
    target = INTERPRET_ELEMENTS_PER_PROGRAM if interpret else ELEMENTS_PER_PROGRAM
    rows = max(1, target // group_size)
    rows = min(rows, triton.next_power_of_2(max(n_groups, 1)))
    num_warps = 8 if rows * group_size >= 8192 else 4
    return rows, num_warps


@jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    meta_ptr,
    n,
    n_bytes,
    n_groups,
    seed,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    IN_BF16: tl.constexpr,
):
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PER_BYTE: tl.constexpr = 8 // BITS
    GROUP_BYTES: tl.constexpr = GROUP // PER_BYTE
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * GROUP + tl.arange(0, GROUP).to(tl.int64)[None, :]
    valid = offs < n
    if IN_BF16:  # x_ptr is the int16 view of a bfloat16 tensor
        x = bf16_bits_to_float(tl.load(x_ptr + offs, mask=valid, other=0))
    else:
        x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)

    finite = valid & (tl.abs(x) < float("inf"))  # NaN compares false
    fmin = tl.min(tl.where(finite, x, float("inf")), axis=1)
    fmax = tl.max(tl.where(finite, x, -float("inf")), axis=1)
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)
    has_nan = tl.max((valid & (x != x)).to(tl.int32), axis=1) > 0
    has_pinf = tl.max((valid & (x == float("inf"))).to(tl.int32), axis=1) > 0
    has_ninf = tl.max((valid & (x == -float("inf"))).to(tl.int32), axis=1) > 0
    special = has_nan | has_pinf | has_ninf
    fmin = tl.where(fmin < float("inf"), fmin, 0.0)  # a group with no finite value
    fmax = tl.where(fmax > -float("inf"), fmax, 0.0)

    # Normal groups: [fmin, fmax] on L levels. Special groups: [-amax, amax] on L - 1 intervals.
    span = tl.where(special, 2.0 * amax, fmax - fmin)
    intervals = tl.where(special, LEVELS - 1, LEVELS).to(tl.float32)
    step = tl.math.div_rn(span, tl.maximum(intervals, 1.0)) * SAFETY
    step = tl.minimum(step, FLT_MAX)
    step = tl.where(span > 0.0, tl.maximum(step, TINY), 0.0)
    step = tl.where(intervals > 0.0, step, 0.0)
    kind = tl.where(has_nan | (has_pinf & has_ninf), float("nan"), tl.where(has_pinf, float("inf"), -float("inf")))
    lo = tl.where(special, kind, fmin)

    safe_step = tl.where(step > 0.0, step, 1.0)[:, None]
    centre = tl.where(special, (LEVELS - 1) // 2, 0).to(tl.float32)[:, None]
    origin = tl.where(special, 0.0, fmin)[:, None]
    t = tl.math.div_rn(x - origin, safe_step) + centre
    if STOCHASTIC:
        zero = tl.zeros_like(offs).to(tl.uint32)
        bits, _, _, _ = tl.philox(seed, offs.to(tl.uint32), (offs >> 32).to(tl.uint32), zero, zero)
        t = t + tl.uint_to_uniform_float(bits)
    else:
        t = t + 0.5
    top = tl.where(special, LEVELS - 1, LEVELS).to(tl.float32)[:, None]
    q = tl.minimum(tl.maximum(tl.floor(t), 0.0), top)
    q = tl.where(finite, q, LEVELS)
    q = tl.where(valid, q, 0).to(tl.int32)

    # Pack PER_BYTE codes into each byte, first element in the lowest bits (see format.py).
    q = tl.reshape(q, (ROWS, GROUP_BYTES, PER_BYTE))
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(q << shifts[None, None, :], axis=2)
    boffs = rows[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES).to(tl.int64)[None, :]
    tl.store(codes_ptr + boffs, packed.to(tl.uint8), mask=boffs < n_bytes)

    in_range = rows < n_groups
    tl.store(meta_ptr + rows * 2, lo, mask=in_range)
    tl.store(meta_ptr + rows * 2 + 1, step, mask=in_range)


def _allocate(flat: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = flat.numel()
    n_groups = -(-n // group_size)
    codes = torch.empty(-(-n * bits // 8), dtype=torch.uint8, device=flat.device)
    meta = torch.empty((n_groups, 2), dtype=torch.float32, device=flat.device)
    return codes, meta


def triton_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, interpret: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous 1-D float tensor; returns ``(codes, meta)`` as described in ``format.py``."""
    assert flat.dim() == 1 and flat.is_contiguous()
    codes, meta = _allocate(flat, bits, group_size)
    n_groups = meta.shape[0]
    if n_groups == 0:
        return codes, meta
    rows, num_warps = launch_config(n_groups, group_size, interpret)
    grid = (triton.cdiv(n_groups, rows),)
    in_bf16 = flat.dtype == torch.bfloat16
    _quantize_kernel[grid](
        flat.view(torch.int16) if in_bf16 else flat, codes, meta, flat.numel(), codes.numel(), n_groups, seed,
        BITS=bits, GROUP=group_size, ROWS=rows, STOCHASTIC=stochastic, IN_BF16=in_bf16, num_warps=num_warps,
    )  # fmt: skip
    return codes, meta


def torch_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference and CPU path of :func:`triton_quantize`: same contract, same arithmetic."""
    codes, meta = _allocate(flat, bits, group_size)
    n, n_groups = flat.numel(), meta.shape[0]
    if n_groups == 0:
        return codes, meta
    levels, per_byte = (1 << bits) - 1, 8 // bits
    x = torch.zeros(n_groups * group_size, dtype=torch.float32, device=flat.device)
    x[:n] = flat
    x = x.view(n_groups, group_size)
    valid = torch.arange(n_groups * group_size, device=flat.device).view(n_groups, group_size) < n

    finite = valid & torch.isfinite(x)
    inf = torch.tensor(float("inf"), device=x.device)
    fmin = torch.where(finite, x, inf).amin(1)
    fmax = torch.where(finite, x, -inf).amax(1)
    amax = torch.where(finite, x.abs(), 0.0).amax(1)
    has_nan, has_pinf, has_ninf = ((valid & m).any(1) for m in (x.isnan(), x == inf, x == -inf))
    special = has_nan | has_pinf | has_ninf
    fmin = torch.where(fmin < inf, fmin, 0.0)
    fmax = torch.where(fmax > -inf, fmax, 0.0)

    span = torch.where(special, 2.0 * amax, fmax - fmin)
    intervals = torch.where(special, levels - 1, levels).float()
    step = span / intervals.clamp(min=1.0) * SAFETY
    step = step.clamp(max=FLT_MAX)
    step = torch.where(span > 0, step.clamp(min=TINY), 0.0)
    step = torch.where(intervals > 0, step, 0.0)
    kind = torch.where(has_nan | (has_pinf & has_ninf), float("nan"), torch.where(has_pinf, inf, -inf))
    lo = torch.where(special, kind, fmin)

    safe_step = torch.where(step > 0, step, 1.0)[:, None]
    centre = torch.where(special, (levels - 1) // 2, 0).float()[:, None]
    origin = torch.where(special, 0.0, fmin)[:, None]
    t = (x - origin) / safe_step + centre
    if stochastic:
        gen = torch.Generator(device=flat.device).manual_seed(seed)
        t = t + torch.rand(t.shape, generator=gen, device=flat.device)
    else:
        t = t + 0.5
    top = torch.where(special, levels - 1, levels).float()[:, None]
    q = torch.minimum(t.floor().clamp(min=0.0), top)
    q = torch.where(finite, q, float(levels))
    q = torch.where(valid, q, 0.0).to(torch.int32)

    shifts = torch.arange(per_byte, device=flat.device, dtype=torch.int32) * bits
    packed = (q.view(n_groups, group_size // per_byte, per_byte) << shifts).sum(2)
    codes.copy_(packed.view(-1)[: codes.numel()])
    meta[:, 0], meta[:, 1] = lo, step
    return codes, meta
