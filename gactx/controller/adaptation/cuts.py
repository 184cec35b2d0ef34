"""Where in the closure's backward a probed tensor's noise must pass: the cut below the nodes that read it.

A tensor saved inside a residual block (a BatchNorm input of a ResNet bottleneck) perturbs the gradient its node
hands on, and everything below is linear in that: the noise reaches the block's own weights, then passes through
one node, the one that made the block's input, where the block's branches merge, and from there reaches every weight
below. That node *post-dominates* the tensor's nodes: every path from them down to the graph's leaves passes through
it. So a pass that probes the tensor splits exactly into what lands above the cut (the *near* weights, from a
backward that stops at the cut) and what the gradient the cut is given, ``delta``, puts below it (the *far* weights),
two disjoint sets of parameters (:class:`Cut`).

Tensors of one kind whose nodes share a cut (a bottleneck's three or four BatchNorm inputs) then need the backward
below the cut, the dear part, for one of them only: the far part of the others is that one's, scaled by how much
larger their ``delta`` is (``passes.Passes``: measured, on ResNet-50 small, the ratio of far part to ``||delta||^2``
of a block's members within 0.63x to 1x of each other).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch.autograd.graph import GradientEdge

from gactx.controller.adaptation.backward_graph import walk

__all__ = ["Cut", "cuts"]

_EXIT = object()  # below every leaf: what a node whose paths end at no single node post-dominates


@dataclass(frozen=True)
class Cut:
    """A cut below one slot's nodes: the edge every path from them down passes (``edge``: the cut node, and its input
    the paths reach), the positions in the estimate's parameters of the weights above it that the slot's noise
    reaches (``near``) and of those below (``far``), and the kind of node that reads the slot (``kind``)."""

    edge: GradientEdge
    near: tuple[int, ...]
    far: tuple[int, ...]
    kind: tuple[str, ...]


def cuts(roots: Sequence, nodes: dict[Hashable, list], params: Sequence) -> dict[Hashable, Cut]:
    """``slot -> Cut`` for each slot of ``nodes`` (slot -> the nodes that read its saves) below whose nodes the graph
    of ``roots`` (the closure's backward calls' first nodes) has a cut: the first node that post-dominates them (the
    paths into a weight's own stubs left out, :func:`_trunk`) and is given a gradient by more than one node (a merge:
    where a residual's branches meet), reached at one input, with no parameter both above and below it (a weight used
    on both sides: then a path to it passes the cut and one does not). ``params``: the estimate's, in its layout."""
    graph = walk(roots)
    parents = graph.parents
    ipdom, depth = _post_dominators(_trunk(graph.successors, parents, graph.order), graph.order)
    position = {id(p): i for i, p in enumerate(params)}
    far_of: dict = {}  # cut node -> the positions of the parameters below it
    out = {}
    for slot, readers in nodes.items():
        if not readers or any(n not in ipdom for n in readers):
            continue
        cut = readers[0]
        for n in readers[1:]:
            cut = _meet(cut, n, ipdom, depth)
        if cut in readers:  # one reader below another: the cut lies below both
            cut = ipdom[cut]
        while cut is not _EXIT and len(parents[cut]) < 2:
            cut = ipdom[cut]
        if cut is _EXIT:
            continue
        inputs = {n for p in parents[cut] for after, n in p.next_functions if after is cut}
        if len(inputs) != 1:  # reached at several inputs: no one gradient to hand on
            continue
        near = _leaves(readers, cut, position)
        if cut not in far_of:
            far_of[cut] = _leaves([cut], None, position)
        far = far_of[cut]
        if near is None or far is None or set(near) & set(far):
            continue
        kind = tuple(sorted({type(n).__name__ for n in readers}))
        out[slot] = Cut(GradientEdge(cut, inputs.pop()), near, far, kind)
    return out


def _trunk(successors: dict, parents: dict, order: list) -> dict:
    """``successors`` without the *stubs*: a node given a gradient by one node alone below which lie stubs alone (a
    weight's transpose, view or cast before its gradient accumulates). What is below a stub reaches a parameter
    through its one parent only, so paths into stubs need not pass a cut: the cut's weights above it take them."""
    stub: dict = {}
    for node in order:  # children first
        stub[node] = len(parents[node]) == 1 and all(stub[a] for a in successors[node])
    return {node: [a for a in after if not stub[a]] for node, after in successors.items()}


def _post_dominators(successors: dict, order: list) -> tuple[dict, dict]:
    """Each node's immediate post-dominator (the nearest node every path from it down passes; ``_EXIT`` where none)
    and its depth in their tree, from ``order`` (children first: each node's successors are done before it)."""
    ipdom: dict = {}
    depth: dict = {_EXIT: 0}
    for node in order:
        if node in ipdom:
            continue
        after = successors[node]  # each done before it (``order``)
        if not after:
            ipdom[node] = _EXIT
        else:
            meet = after[0]
            for a in after[1:]:
                meet = _meet(meet, a, ipdom, depth)
            ipdom[node] = meet
        depth[node] = depth[ipdom[node]] + 1
    return ipdom, depth


def _meet(a, b, ipdom: dict, depth: dict):
    """The nearest node that post-dominates both ``a`` and ``b`` (each counted its own)."""
    while a is not b:
        if depth[a] >= depth[b]:
            a = ipdom[a]
        else:
            b = ipdom[b]
    return a


def _leaves(starts: list, stop, position: dict) -> tuple[int, ...] | None:
    """The positions of the parameters whose gradients the nodes below ``starts`` (themselves included) accumulate,
    ``stop`` and what lies only below it left out; ``None`` where one of them is not an estimate's parameter."""
    found, seen, stack = set(), set(), list(starts)
    while stack:
        node = stack.pop()
        if node is stop or node in seen:
            continue
        seen.add(node)
        for after, _ in node.next_functions:
            if after is None:
                continue
            variable = getattr(after, "variable", None)
            if variable is not None:
                if id(variable) not in position:
                    return None
                found.add(position[id(variable)])
            elif after is not stop:
                stack.append(after)
    return tuple(sorted(found))
