"""The closure's recorded backward graph below its roots, walked once: what ``cuts.py`` and ``rows.py`` read of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Walked", "walk"]


@dataclass(frozen=True)
class Walked:
    """The function nodes below some roots. Accumulating nodes (a leaf's ``AccumulateGrad``) are no path on: they are
    left out of ``successors`` and ``parents`` and kept in ``accumulated``."""

    successors: dict  # function node -> the function nodes it hands a gradient to, each once
    parents: dict  # function node -> the set of nodes that hand it one
    order: list  # every function node, children first (a depth-first post-order)
    accumulated: dict  # accumulating node -> the nodes that hand it a gradient, one entry an edge


def walk(roots: Sequence) -> Walked:
    """:class:`Walked` of the graph below ``roots`` (the grad_fn nodes of the closure's backward calls; ``None``
    skipped)."""
    successors: dict = {}
    parents: dict = {}
    order: list = []
    accumulated: dict = {}
    stack = [(r, False) for r in roots if r is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in successors:
            continue
        after = []
        for a, _ in node.next_functions:
            if a is None:
                continue
            if hasattr(a, "variable"):
                accumulated.setdefault(a, []).append(node)
            else:
                after.append(a)
        successors[node] = list(dict.fromkeys(after))
        parents.setdefault(node, set())
        stack.append((node, True))
        for a in successors[node]:
            parents.setdefault(a, set()).add(node)
            if a not in successors:
                stack.append((a, False))
    return Walked(successors, parents, order, accumulated)
