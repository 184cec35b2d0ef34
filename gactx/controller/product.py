"""Products derived from their stored factors: a save that is the product of two tensors whose values the same pass
stored already costs no bytes of its own.

A gated MLP (SwiGLU, GeGLU) computes ``h = act(gate) * up``: ``mul`` saves both factors for its own backward, and
the next linear layer saves ``h`` again as its input. ``h`` is often the noisiest save of a decoder: its few outlier
channels widen every group's range (a Llama-style decoder's ``down_proj`` input has a kurtosis near 100, and at 4 bits
a relative error variance of 0.15 against 0.02 to 0.03 for its factors). Decoded as the product of its two decoded
factors, whose rounding noises are independent, it stays unbiased (``E[a' b'] = a b``), carries about a tenth of that
error, and stores nothing::

    a = silu(gate)   # stored by mul as its input: remembered on a's autograd node
    h = a * up       # MulBackward0, whose inputs' nodes name a's and up's stored values
    down_proj(h)     # saves h: found to be that product, stored as Product(a's handle, up's handle)

What is recognised: a contiguous save whose ``grad_fn``, through reshapes only (``view``, ``reshape``), is a
``MulBackward0`` both of whose inputs were stored in this pass in a form that decodes to their values (uniform codes,
kept as is). Nothing is assumed across passes: every pass checks its own graph, so a changed graph stores the save
as it would have been stored. The stored factors' handles are remembered on their own autograd nodes
(``node.metadata``, weakly), which die with the graph.
"""

from __future__ import annotations

import math
import weakref

import torch

__all__ = ["PRODUCT", "Product", "derivable", "factors", "remember", "stores_values"]

PRODUCT = "product"  # the stored form a record names
_CLASSES = ("linear", "linear (op unknown)")  # saves stored as a product: those quantized as linear inputs would be
_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"})
_MARK = "gactx.stored_values"  # node.metadata entry: output number -> (pass, handle, dtype, shape, key)


def stores_values(decision) -> bool:
    """Whether what a save is stored as under ``decision`` decodes to its values (codes on a grid, kept as is): a
    factor a product may be decoded from. Not a mask, a FewBit code, a scheme's form."""
    rule = decision.rule
    return rule is None or rule.kind in ("quantize", "keep") and decision.choice is None


def derivable(decision) -> bool:
    """Whether a save decided so may be stored as a product instead: uniform codes of a linear input, nothing kept."""
    return decision.rule.cls in _CLASSES and not decision.reason and decision.choice is None


def remember(t: torch.Tensor, handle, serial: int, key) -> None:
    """Note on ``t``'s autograd node that pass ``serial`` stored ``t``'s values as ``handle`` (under ``key``): weakly,
    so that the node, which outlives its own backward, holds no stored bytes once autograd lets go of them."""
    node = t.grad_fn
    if node is not None:
        node.metadata.setdefault(_MARK, {})[t.output_nr] = (serial, weakref.ref(handle), t.dtype, t.shape, key)


def factors(t: torch.Tensor, serial: int) -> tuple[Product, tuple] | None:
    """``t`` as a :class:`Product` of two saves that pass ``serial`` stored, and their keys; ``None`` where it is not
    one (see the module docstring)."""
    node = t.grad_fn
    if node is None or not t.is_contiguous():
        return None
    while type(node).__name__ in _RESHAPES:
        node = node.next_functions[0][0]
        if node is None:
            return None
    if type(node).__name__ != "MulBackward0":
        return None
    found = []
    for edge, number in node.next_functions:
        entry = None if edge is None else edge.metadata.get(_MARK, {}).get(number)
        if entry is None or entry[0] != serial:
            return None
        found.append(entry)
    (_, a, a_dtype, a_shape, a_key), (_, b, b_dtype, b_shape, b_key) = found
    a, b = a(), b()
    if a is None or b is None:
        return None
    if torch.promote_types(a_dtype, b_dtype) != t.dtype or math.prod(torch.broadcast_shapes(a_shape, b_shape)) != (
        t.numel()
    ):
        return None
    return Product(a, b, t.shape), (a_key, b_key)


class Product:
    """A stored form: the product of two saves' handles, reshaped to the saved shape; no bytes of its own."""

    __slots__ = ("a", "b", "shape")
    nbytes = 0

    def __init__(self, a, b, shape: torch.Size) -> None:
        self.a, self.b, self.shape = a, b, shape

    def decode(self) -> torch.Tensor:
        a, b = self.a, self.b  # handles, or tensors kept as they are (store.unpack, inlined)
        a = a if isinstance(a, torch.Tensor) else a.unpack()
        b = b if isinstance(b, torch.Tensor) else b.unpack()
        return (a * b).reshape(self.shape)
