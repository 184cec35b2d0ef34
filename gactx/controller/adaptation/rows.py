"""An embedding table's gradient in a pass from the probed nodes (``replayed.py``), as the rows the batch reaches.

Such a pass needs each parameter's gradient for its squared norm alone (``groups.squares``). The weight of an
embedding (``nn.Embedding``, ``F.embedding``: an ``EmbeddingBackward0`` node) gets a dense gradient as large as its
table, of which only the rows of the batch's indices hold anything: filling and reading the whole table costs a pass
far more than the rows it reaches, and a full fine-tune's table is hundreds of MiB a pass. So
where a table's weight gets its gradient from one embedding node alone and has no hook, the pass asks for the
gradient that node is given (its forward output's) and sums it into the rows the indices reach (:class:`Rows`): the
same squared norm, up to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge

from gactx.controller.adaptation.backward_graph import walk

__all__ = ["Rows", "tables"]


class Rows:
    """One embedding node's weight gradient as the rows its indices reach, from the gradient the node is given."""

    def __init__(self, node) -> None:
        self.edge = GradientEdge(node, 0)  # the gradient of the node's forward output, asked for instead of the weight
        indices = node._saved_indices.reshape(-1)
        self.rows, self.inverse, counts = torch.unique(indices, return_inverse=True, return_counts=True)
        self.dtype = node.next_functions[0][0].variable.dtype
        keep = torch.ones_like(self.rows, dtype=self.dtype)
        if node._saved_padding_idx >= 0:  # the padding row gets no gradient
            keep = keep.masked_fill(self.rows == node._saved_padding_idx, 0)
        if node._saved_scale_grad_by_freq:  # each row's gradient over how often the batch reads it
            keep = keep / counts.to(self.dtype)
        self.scale = None if bool((keep == 1).all()) else keep.unsqueeze(1)

    def of(self, given: torch.Tensor | None) -> torch.Tensor | None:
        """The weight's gradient in the rows the indices reach, from ``given`` (the node's); ``None`` where none."""
        if given is None:
            return None
        given = given.reshape(-1, given.shape[-1]).to(self.dtype)
        out = given.new_zeros(self.rows.numel(), given.shape[-1]).index_add_(0, self.inverse, given)
        return out if self.scale is None else out.mul_(self.scale)


def tables(roots: Sequence, params: Sequence[torch.Tensor]) -> dict[int, Rows]:
    """``position in params -> Rows`` for each of ``params`` that is a dense embedding's weight and gets its gradient
    from that one node in the graph below ``roots`` (the grad_fn nodes of the closure's backward calls), with no hook on
    it: not a weight tied to another layer, a sparse gradient, or one that a hook could change."""
    position = {id(p): i for i, p in enumerate(params)}
    producers = {a: nodes for a, nodes in walk(roots).accumulated.items() if id(a.variable) in position}
    out = {}
    for accumulate, nodes in producers.items():
        p, (node, *others) = accumulate.variable, nodes
        if others or node.name() != "EmbeddingBackward0" or node._saved_sparse or p._backward_hooks:
            continue
        if getattr(p, "_post_accumulate_grad_hooks", None):
            continue
        out[position[id(p)]] = Rows(node)
    return out
