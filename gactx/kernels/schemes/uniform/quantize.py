"""The uniform scheme's Triton quantize: ``_quantize_kernel`` and ``triton_quantize`` (the arithmetic: ``format.py``;
the twin: ``reference.py``).

The kernel, one program of ``ROWS`` groups, is built to stay under the memory-bound instruction budget of a
GPU (``aot.py`` compiles it for sm_80 and sm_90 and counts):

- One launch a call: whole programs run unmasked, the rest of a tensor, if any, in masked programs of the same
  launch (``_grid.py``): a mask on every element stops 128-bit loads unless ``n`` is a multiple of 16.
- A group is read as four slices (eight at 1 bit: at least one a plane of ``format.py``), so that one Philox call
  (four 32-bit outputs) serves four elements and a byte's codes sit in one thread.
- Four reductions, fused across the slices before they cross threads: min and max of ``x + x * 0`` (NaN
  where ``x`` is not finite, and NaN is skipped), and the largest bit pattern as signed and as unsigned
  int32, which tell NaN, +Inf and -Inf apart: finite patterns sort below +Inf's as signed and below -Inf's as
  unsigned, and each NaN above the infinity of its sign.
- One reciprocal a group instead of a division an element; non-finite elements reach the top code through
  ``min(|s|, L + 1)`` (NaN is skipped), not through a select.
"""

from __future__ import annotations

import torch

from gactx.kernels._grid import plan
from gactx.kernels._triton import VERSION, constexpr, jit, launch, tl
from gactx.kernels.half import bf16_bits_to_float
from gactx.kernels.random import ROUNDS, philox
from gactx.kernels.schemes.uniform.format import FLT_MAX, MIN_STEP, SAFETY, allocate

__all__ = ["advance_seed", "program_rows", "quantize_into", "quantize_launch", "triton_quantize"]

# The same, and bit patterns of the infinities as int32, for kernels.
_SAFETY, _FLT_MAX, _MIN_STEP = constexpr(SAFETY), constexpr(FLT_MAX), constexpr(MIN_STEP)
_INF = constexpr(float("inf"))
_ROUNDS = constexpr(ROUNDS)
_POS_INF_BITS = constexpr(0x7F800000)  # +Inf's pattern, as int32
_NEG_INF_UBITS = constexpr(0xFF800000)  # -Inf's pattern, as uint32
# Elements a program on a GPU: 4096 at 4 warps is 32 a thread, 8 consecutive ones in each of four slices
# (128-bit loads of float32 and of bfloat16 alike). 8192 would amortize a program's fixed work (reductions
# across threads, a division, the metadata) over twice the elements, 25 instead of 28 instructions an element,
# but needs up to 230 registers a thread, 2 programs an SM, and spills on sm_80 with 16-bit inputs.
ELEMENTS_PER_PROGRAM = 4096
# At 1 bit a group is read in eight slices: 16-bit elements need 8192 a program for 8 consecutive ones a slice.
ELEMENTS_PER_PROGRAM_1BIT_16 = 8192
# The rest of a tensor runs masked (``_grid.py``) in programs of 2048: a mask an element is live throughout.
MASKED_ELEMENTS_PER_PROGRAM = 2048
NUM_WARPS = 4
# Left to itself, ptxas holds some variants to 72-80 registers and spills (8-64 bytes a thread; Triton 3.9: 8 bits,
# groups of 32, float32, 40 bytes at 80); a limit of 128 lets it use what it needs, and still leaves room for 4
# programs an SM; 168 for 1 bit of 16-bit inputs (3 programs an SM). Triton 3.8's ptxas spills with those limits
# (1 bit of float16: 168 to 176 bytes on sm_90; 4 bits, groups of 4096, with a rest: 8) and nowhere without the first
# (``gactx.kernels.aot``); its 1-bit kernels of 16-bit inputs take up to 208 registers (2 programs an SM), and spill
# on sm_80 with none.
MAX_REGISTERS, MAX_REGISTERS_1BIT_16 = (None, 208) if VERSION[:2] == (3, 8) else (128, 168)
# The interpreter runs programs one after another in Python: fewer, larger programs are much faster.
INTERPRET_ELEMENTS_PER_PROGRAM = 1 << 16


def program_rows(group_size: int, bits: int, itemsize: int, interpret: bool, masked: bool = False) -> int:
    """Groups a program of quantize (and dequantize, of ``itemsize``-byte output) handles."""
    if interpret:
        elements = INTERPRET_ELEMENTS_PER_PROGRAM
    elif masked:
        elements = MASKED_ELEMENTS_PER_PROGRAM
    else:
        elements = ELEMENTS_PER_PROGRAM_1BIT_16 if bits == 1 and itemsize == 2 else ELEMENTS_PER_PROGRAM
    return max(1, elements // group_size)


def quantize_launch(
    n: int, dtype: torch.dtype, bits: int, group_size: int, stochastic: bool, interpret: bool = False
) -> tuple[int, int, dict]:
    """``(programs, full, meta-parameters)`` of the launch of ``_quantize_kernel`` for ``n`` elements of ``dtype``
    (``_grid.plan``): the one place that chooses them, for :func:`triton_quantize` and for ``aot.py``."""
    rows = program_rows(group_size, bits, dtype.itemsize, interpret)
    rest_rows = program_rows(group_size, bits, dtype.itemsize, interpret, masked=True)
    programs, full, rest = plan(n, rows * group_size, rest_rows * group_size)
    # A group is read in SLICES slices: four, for one Philox call, and at least one a plane of format.py.
    meta = dict(
        BITS=bits, GROUP=group_size, ROWS=rows, REST_ROWS=rest_rows, SLICES=max(4, 8 // bits), STOCHASTIC=stochastic,
        IN_BF16=dtype == torch.bfloat16, REST=rest, SEED_IN_MEMORY=False, num_warps=NUM_WARPS, enable_fp_fusion=False,
        maxnreg=MAX_REGISTERS_1BIT_16 if bits == 1 and dtype.itemsize == 2 else MAX_REGISTERS,
    )  # fmt: skip
    return programs, full, meta


@jit
def _load_fp32(ptr, offs, n, IN_BF16: tl.constexpr, MASKED: tl.constexpr):
    """Load a block as float32; ``ptr`` is the int16 view of a bfloat16 tensor when ``IN_BF16``."""
    if MASKED:
        raw = tl.load(ptr + offs, mask=offs < n, other=0)
    else:
        raw = tl.load(ptr + offs)
    if IN_BF16:
        return bf16_bits_to_float(raw)
    return raw.to(tl.float32)


@jit
def _shift_plus_uniform(r, mantissa, exponent):
    """``centre + 1 + u`` from the random bits ``r``, one instruction an element: ``centre + 1`` is 1 or
    ``2**(bits - 1)``, a power of two, so ``u`` fills the low bits of the mantissa of a float in
    ``[centre + 1, centre + 2)``: 23 random bits at centre 0, 24 - bits in a group holding NaN or +-Inf."""
    return ((r & mantissa) | exponent).to(tl.float32, bitcast=True)


@jit
def _nan_if_not_finite(x, offs, n, MASKED: tl.constexpr):
    """``x`` where finite, NaN elsewhere (``inf * 0`` is NaN) and past ``n``: min and max skip NaN."""
    z = x + x * 0.0
    if MASKED:
        z = tl.where(offs < n, z, float("nan"))
    return z


@jit
def _code_plus_one(x, offs, n, scale, origin, inv, shift, LEVELS: tl.constexpr, MASKED: tl.constexpr):
    """``q + 1`` as int32: ``trunc((x * scale - origin) * inv + shift)``, ``shift = centre + 1 + u`` (``origin``
    and ``inv`` already scaled). Non-finite elements get the top code: ``|s|`` is inf or NaN there and
    ``minimum`` skips NaN. Past ``n``, code 0."""
    s = tl.minimum(tl.abs((x * scale - origin) * inv + shift), LEVELS + 1.0)
    if MASKED:
        s = tl.where(offs < n, s, 1.0)
    return s.to(tl.int32)


@jit(do_not_specialize=["n", "seed", "full"])  # one compiled kernel whatever n and seed are (but int32 or int64)
def _quantize_kernel(
    x_ptr, codes_ptr, meta_ptr, n, seed, full,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, REST_ROWS: tl.constexpr, SLICES: tl.constexpr,
    STOCHASTIC: tl.constexpr, IN_BF16: tl.constexpr, REST: tl.constexpr, SEED_IN_MEMORY: tl.constexpr = False,
):  # fmt: skip
    """``full`` programs of ``ROWS`` groups, unmasked, then (``REST``) masked ones of ``REST_ROWS`` (``_grid.py``).
    ``SEED_IN_MEMORY``: ``seed`` is the address of the int64 seed (:func:`_advance_seed_kernel`'s), read on the
    device: what a graph captured by CUDA graphs launches, so that each replay draws new noise."""
    if SEED_IN_MEMORY:
        seed = tl.load(seed)
    if REST:
        if tl.program_id(0) < full:
            _quantize_program(x_ptr, codes_ptr, meta_ptr, n, seed, 0, BITS, GROUP, ROWS, SLICES, STOCHASTIC, IN_BF16,
                              False)  # fmt: skip
        else:
            # A masked program's index counts in programs of its own size: the full ones before it are ROWS // REST_ROWS
            # of those each.
            _quantize_program(x_ptr, codes_ptr, meta_ptr, n, seed, full * (ROWS // REST_ROWS) - full, BITS, GROUP,
                              REST_ROWS, SLICES, STOCHASTIC, IN_BF16, True)  # fmt: skip
    else:
        _quantize_program(x_ptr, codes_ptr, meta_ptr, n, seed, 0, BITS, GROUP, ROWS, SLICES, STOCHASTIC, IN_BF16, False)


@jit
def _advance_seed_kernel(seed_ptr):
    """The int64 seed at ``seed_ptr`` replaced by the next of a 64-bit linear congruential sequence, masked to 62 bits:
    launched before each quantize that reads its seed on the device (``SEED_IN_MEMORY``)."""
    value = tl.load(seed_ptr)
    tl.store(seed_ptr, (value * 6364136223846793005 + 1442695040888963407) & 0x3FFFFFFFFFFFFFFF)


@jit
def _quantize_program(
    x_ptr, codes_ptr, meta_ptr, n, seed, first,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, SLICES: tl.constexpr, STOCHASTIC: tl.constexpr,
    IN_BF16: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One program: ``ROWS`` groups, the ``program_id + first``-th such run of the tensor."""
    pid = tl.program_id(0).to(tl.int64) + first
    LEVELS: tl.constexpr = (1 << BITS) - 1
    CENTRE: tl.constexpr = (LEVELS - 1) // 2
    PLANES: tl.constexpr = 8 // BITS  # codes a byte
    WIDTH: tl.constexpr = GROUP // SLICES
    SETS: tl.constexpr = SLICES // PLANES  # slices whose bytes are stored, each with the codes of PLANES slices
    ONES: tl.constexpr = 255 // LEVELS  # a 1 in each code's lowest bit (0b01010101 at 2 bits): the +1s
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * GROUP + tl.arange(0, WIDTH).to(tl.int64)[None, :]  # the first slice
    xs = ()
    for i in tl.static_range(SLICES):
        xs = xs + (_load_fp32(x_ptr, offs + i * WIDTH, n, IN_BF16, MASKED),)

    # Four reductions, fused across the slices before they cross threads: min and max of the finite values
    # (NaN skipped), and the largest bit pattern as signed and as unsigned int32. Finite patterns are below
    # +Inf's (0x7F800000) as signed and below -Inf's (0xFF800000) as unsigned; NaNs are above the infinity
    # of their sign in both orders.
    low = _nan_if_not_finite(xs[0], offs, n, MASKED)
    high = low
    sbits = xs[0].to(tl.int32, bitcast=True)
    ubits = xs[0].to(tl.uint32, bitcast=True)
    for i in tl.static_range(1, SLICES):
        z = _nan_if_not_finite(xs[i], offs + i * WIDTH, n, MASKED)
        low = tl.minimum(low, z)
        high = tl.maximum(high, z)
        sbits = tl.maximum(sbits, xs[i].to(tl.int32, bitcast=True))
        ubits = tl.maximum(ubits, xs[i].to(tl.uint32, bitcast=True))
    fmin = tl.min(low, axis=1)
    fmax = tl.max(high, axis=1)
    smax = tl.max(sbits, axis=1)
    umax = tl.max(ubits, axis=1)

    pos = smax >= _POS_INF_BITS  # +Inf or +NaN
    neg = umax >= _NEG_INF_UBITS  # -Inf or -NaN
    special = pos | neg
    nan = (smax > _POS_INF_BITS) | (umax > _NEG_INF_UBITS) | (pos & neg)
    kind = tl.where(nan, float("nan"), tl.where(pos, _INF, -_INF))
    fmin = tl.where(fmin == fmin, fmin, 0.0)  # NaN: a group with no finite value
    fmax = tl.where(fmax == fmax, fmax, 0.0)

    # Normal groups: [fmin, fmax] on L levels. Special groups: [-amax, amax] on L - 1 intervals (none at 1 bit).
    # step_factor() for kernels: a constexpr float is rounded to float32 where it meets a tensor.
    span = tl.where(special, 2.0 * tl.maximum(-fmin, fmax), fmax - fmin)
    # A finite group whose span overflowed (fmin < 0 < fmax, see the module docstring): step = fmax * f - fmin * f,
    # and its elements encoded at a quarter of their value (scale 0.25). Scale 1 everywhere else.
    scale = tl.where(special | (span <= _FLT_MAX), 1.0, 0.25)
    if LEVELS == 1:
        factor = _SAFETY / LEVELS
        step = tl.minimum(tl.where(scale < 1.0, fmax * factor - fmin * factor, span * factor), _FLT_MAX)
        step = tl.where(special, 0.0, tl.where(span > 0.0, tl.maximum(step, _MIN_STEP), 0.0))
    else:
        factor = tl.where(special, _SAFETY / (LEVELS - 1), _SAFETY / LEVELS)
        step = tl.minimum(tl.where(scale < 1.0, fmax * factor - fmin * factor, span * factor), _FLT_MAX)
        step = tl.where(span > 0.0, tl.maximum(step, _MIN_STEP), 0.0)
    inv = tl.where(step > 0.0, tl.math.div_rn(1.0, tl.where(step > 0.0, step * scale, 1.0)), 0.0)
    lo = tl.where(special, kind, fmin)
    # (lo, step) pairs, joined: one 8-byte store a group.
    pairs = tl.join(lo, step)
    pair_ptr = meta_ptr + rows[:, None] * 2 + tl.arange(0, 2)[None, :]
    if MASKED:
        tl.store(pair_ptr, pairs, mask=rows[:, None] < (n + GROUP - 1) // GROUP)
    else:
        tl.store(pair_ptr, pairs)

    origin = (tl.where(special, 0.0, fmin) * scale)[:, None]
    scale = scale[:, None]
    inv = inv[:, None]
    if STOCHASTIC:
        # A Philox call a position of four slices, one output a slice. The counter is (element in the program,
        # program, call, bits of the element of slice 0): unique. The data word costs nothing and puts the
        # calls in the layout of the loads (a counter made of indices alone is computed in another layout,
        # and its outputs are moved through shared memory).
        local = (offs - pid * (ROWS * GROUP)).to(tl.uint32)
        block = local * 0 + pid.to(tl.uint32)
        data = xs[0].to(tl.uint32, bitcast=True)
        mantissa = tl.where(special, 0x7FFFFF >> (BITS - 1), 0x7FFFFF).to(tl.uint32)[:, None]
        exponent = tl.where(special, (127 + BITS - 1) << 23, 127 << 23).to(tl.uint32)[:, None]
        shifts = ()
        for call in tl.static_range(SLICES // 4):
            rs = philox(seed, local, block, local * 0 + call, data, _ROUNDS)
            for j in tl.static_range(4):
                shifts = shifts + (_shift_plus_uniform(rs[j], mantissa, exponent),)
    else:
        half = tl.where(special, CENTRE + 1.5, 1.5)[:, None]
        shifts = ()
        for _ in tl.static_range(SLICES):
            shifts = shifts + (half,)
    q1s = ()
    for i in tl.static_range(SLICES):
        q1s = q1s + (_code_plus_one(xs[i], offs + i * WIDTH, n, scale, origin, inv, shifts[i], LEVELS, MASKED),)

    # Planes (format.py): byte k of slice i (i < SETS) holds the codes at k of slices i, i + SETS, ...
    boffs = rows[:, None] * (GROUP * BITS // 8) + tl.arange(0, WIDTH).to(tl.int64)[None, :]
    for i in tl.static_range(SETS):
        packed = q1s[i]
        for p in tl.static_range(1, PLANES):
            packed += q1s[i + p * SETS] << (p * BITS)
        packed = (packed - ONES).to(tl.uint8)
        if MASKED:
            tl.store(codes_ptr + boffs + i * WIDTH, packed, mask=rows[:, None] < (n + GROUP - 1) // GROUP)
        else:
            tl.store(codes_ptr + boffs + i * WIDTH, packed)


def advance_seed(seed: torch.Tensor) -> None:
    """:func:`_advance_seed_kernel` on ``seed`` (one int64 element), in place: the torch twin is
    ``(seed * 6364136223846793005 + 1442695040888963407) & (2**62 - 1)`` in wrapping int64."""
    launch(_advance_seed_kernel, 1, seed)


def triton_quantize(
    flat: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, interpret: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous 1-D float tensor; returns ``(codes, meta)`` as described in ``format.py``."""
    assert flat.dim() == 1 and flat.is_contiguous()
    codes, meta = allocate(flat, bits, group_size)
    n = flat.numel()
    if n == 0:
        return codes, meta
    quantize_into(flat, codes, meta, seed, quantize_launch(n, flat.dtype, bits, group_size, stochastic, interpret))
    return codes, meta


def quantize_into(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, seed: int, planned: tuple) -> None:
    """The one launch of ``_quantize_kernel`` on the elements of ``x`` (contiguous, of any shape: the kernel reads its
    memory in order, as :func:`quantize_launch` ``planned`` it for their number and dtype) into ``codes`` and
    ``meta`` (``allocate``'s)."""
    programs, full, options = planned
    launch(_quantize_kernel, programs, x.view(torch.int16) if x.dtype == torch.bfloat16 else x, codes, meta,
           x.numel(), seed, full, **options)  # fmt: skip
