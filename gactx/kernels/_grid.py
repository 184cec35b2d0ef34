"""How launches cover ``n`` elements: whole programs unmasked, then masked programs for the rest."""

from __future__ import annotations

__all__ = ["launches", "launch_metas"]


def launches(n: int, block: int, tail_block: int | None = None) -> list[tuple[int, int, bool]]:
    """``(programs, first program, masked)`` of each launch covering ``n`` elements: programs of ``block``
    elements, then the rest in masked programs of ``tail_block`` (a divisor of ``block``; default ``block``).
    A program's index counts in its own launch's programs: ``first`` is where the rest begins, in those.

    A mask on every element stops 128-bit loads unless ``n`` is a multiple of 16 (the compiler cannot prove
    the mask constant over a vector), and one kernel holding a masked and an unmasked body needs the
    registers of both in every program. So whole programs run unmasked in one launch and the remainder, if
    any, in a second launch, masked; its programs may be smaller, to need fewer registers (a mask an element
    is live through the whole program).
    """
    tail_block = tail_block or block
    assert block % tail_block == 0, (block, tail_block)
    full, rest = divmod(n, block)
    out = [(full, 0, False)] if full else []
    if rest:
        out.append((-(-rest // tail_block), full * (block // tail_block), True))
    return out


def launch_metas(
    n: int, block: int, meta: dict, tail_block: int | None = None, tail_meta: dict | None = None
) -> list[tuple[int, int, dict]]:
    """:func:`launches` with each launch's meta-parameters: ``meta``, ``MASKED``, and for the masked launch
    ``tail_meta`` on top."""
    return [
        (programs, first, {**meta, **((tail_meta or {}) if masked else {}), "MASKED": masked})
        for programs, first, masked in launches(n, block, tail_block)
    ]
