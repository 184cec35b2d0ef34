"""How one launch covers ``n`` elements: whole programs unmasked, then masked programs for the rest."""

from __future__ import annotations

__all__ = ["plan"]


def plan(n: int, block: int, rest_block: int | None = None) -> tuple[int, int, bool]:
    """``(programs, full, rest)`` of the one launch covering ``n`` elements: ``full`` programs of ``block`` elements,
    then, where ``rest`` is true, the remaining elements in masked programs of ``rest_block`` (a divisor of ``block``;
    default ``block``).

    A mask on every element stops 128-bit loads unless ``n`` is a multiple of 16 (the compiler cannot prove the mask
    constant over a vector). So a kernel compiles its program twice, unmasked and masked, and each program takes one
    of the two by its index (``program_id < full``): one launch a call, where one launch of whole programs and one of
    the masked rest cost twice the host time and twice the launch latency. A kernel whose tensor has no rest is
    compiled with the unmasked program alone (``REST`` false). The masked programs may be smaller, to need fewer
    registers (a mask an element is live through the whole program); a masked program's index counts in programs of
    its own size.
    """
    rest_block = rest_block or block
    assert block % rest_block == 0, (block, rest_block)
    full, rest = divmod(n, block)
    return full + -(-rest // rest_block), full, rest > 0
