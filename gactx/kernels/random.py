"""Philox4x32 (Salmon et al., SC'11) for kernels: ``philox``, the same numbers as ``tl.philox``, cheaper.

Each round multiplies two 32-bit words by constants and keeps both halves of the 64-bit products.
``tl.philox`` asks for the halves separately (``umulhi`` and a low multiply: two instructions a product on
sm_90); here one widening multiply gives both (one ``IMAD.WIDE.U32``)::

    (c0, c1, c2, c3) -> (hi(B * c2) ^ c1 ^ k0,  lo(B * c2),  hi(A * c0) ^ c3 ^ k1,  lo(A * c0))
    (k0, k1)         -> (k0 + 0x9E3779B9,  k1 + 0xBB67AE85)

Four 32-bit outputs a call: a kernel that rounds four elements with one call pays a quarter of its cost an
element. ``tests/kernels/test_random.py`` checks the outputs against ``tl.philox``.

Rounds: Philox4x32-7 is the fewest rounds that pass TestU01's BigCrush (Salmon et al., table 2); 10 is
their default, with a safety margin for uses that need one. Stochastic rounding needs uniform,
independent noise, which 7 rounds give; each round costs about 4 instructions a call, so 7 instead of 10
saves about 3 instructions an element of the 2- and 4-bit quantize kernels, a tenth of their budget at
H100 bandwidth (see ``gactx.kernels.aot``).
"""

from __future__ import annotations

from gactx.kernels._triton import jit, tl

__all__ = ["philox", "ROUNDS"]

ROUNDS = 7


@jit
def philox(seed, c0, c1, c2, c3, N_ROUNDS: tl.constexpr):
    """Philox4x32 of the uint32 counter ``(c0, c1, c2, c3)`` under the 64-bit ``seed`` (a scalar)."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(N_ROUNDS):
        a = c0.to(tl.uint64) * 0xD2511F53
        b = c2.to(tl.uint64) * 0xCD9E8D57
        c0, c1, c2, c3 = (
            (b >> 32).to(tl.uint32) ^ c1 ^ k0,
            b.to(tl.uint32),
            (a >> 32).to(tl.uint32) ^ c3 ^ k1,
            a.to(tl.uint32),
        )
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3
