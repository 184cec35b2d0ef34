"""Markdown tables for the benchmarks' result files: one header row, one alignment row, a row per result."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_table"]


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]], left: int = 1) -> list[str]:
    """Lines of a markdown table; the first ``left`` columns align left (names), the rest right (numbers)."""
    align = ["---" if i < left else "--:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines
