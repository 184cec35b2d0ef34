"""Which aten op saved a tensor, learned while the model's forward runs.

Autograd's generated code saves an op's inputs just before it dispatches the op below autograd, and its
results just after. A ``TorchDispatchMode`` sees every op below autograd, so:

- a save of a tensor that the op just dispatched returned, under one of the result names its node saves
  (``ReluBackward0`` has ``_raw_saved_result``), is that op's result save;
- any other save waits, uncompressed, in a pending handle until the next op is dispatched; it belongs to
  that op, under the name of the argument it is passed as (``"?"`` when it is not among the arguments:
  a custom ``autograd.Function``'s save, a clone made for an in-place op).

An input save that is one of a matrix product's two operands (``addmm``'s ``mat1``), or a convolution's input, is
marked ``Site.weight_operand`` when the other is a weight: an ``nn.Parameter``, a view of one (linear passes
``weight.t()``), or an autocast copy of one (``rules.sketchable``: the inputs of linear layers; ``rules.weight_only``:
those and the inputs of convolutions). An operand of an element-wise product with fewer elements than the product, whose
other operand has them all, is marked ``Site.broadcast`` (``rules.FACTOR``).

Two kinds of tensor are known by where they come from (``rules.PROVENANCE``): a float dropout mask
(``bernoulli_`` then ``div_`` on the same tensor) and probabilities computed by hand (an ``exp`` result
divided by a tensor, as torch_geometric's softmax over a node's edges computes GAT's coefficients), with the
views of either.

The watcher costs a Python call per aten op (host time; ``python -m benchmarks.oprules`` measures it). The
controller runs it only in a forward pass after one that met a save it had not seen (see controller.py).
Nothing here reads a tensor's values: no host synchronization.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gactx.controller.policy import _is_parameter, is_weight_copy, storage_owner
from gactx.controller.rules import Site, weight_partner

__all__ = ["OpWatcher"]

_SCALARS = (int, float, bool, str, type(None))


def _result_names(func) -> list[str]:
    returns = func._schema.returns
    if len(returns) == 1:
        return [returns[0].name or "result"]
    return [r.name or f"result{i}" for i, r in enumerate(returns)]


def _params(func, args: tuple, kwargs: dict) -> tuple:
    """The op's scalar arguments, by name (numbers, strings, booleans, ``None`` and tuples of them)."""
    out = []
    for arg, value in zip(func._schema.arguments, args, strict=False):
        if isinstance(value, _SCALARS) or (
            isinstance(value, list | tuple) and all(isinstance(v, _SCALARS) for v in value)
        ):
            out.append((arg.name, tuple(value) if isinstance(value, list) else value))
    for name, value in kwargs.items():
        if isinstance(value, _SCALARS):
            out.append((name, value))
    return tuple(out)


def _role(func, args: tuple, kwargs: dict, t: torch.Tensor) -> str:
    for arg, value in zip(func._schema.arguments, args, strict=False):
        if value is t or (isinstance(value, list | tuple) and any(v is t for v in value)):
            return arg.name
    for name, value in kwargs.items():
        if value is t:
            return name
    return "?"


def _argument(func, args: tuple, kwargs: dict, name: str):
    """The value of the op's argument ``name`` (``None`` if not passed)."""
    for arg, value in zip(func._schema.arguments, args, strict=False):
        if arg.name == name:
            return value
    return kwargs.get(name)


def _is_weight(t) -> bool:
    """A parameter, a view of one, or an autocast copy of one (or a view of that): what ``policy.keep_reason``
    keeps as a parameter."""
    if not isinstance(t, torch.Tensor):
        return False
    return _is_parameter(storage_owner(t)) or (t.grad_fn is not None and is_weight_copy(t))


def _weight_operand(func, args: tuple, kwargs: dict, name: str, role: str) -> bool:
    """Whether the save passed as ``role`` of the product or convolution ``name`` has a weight as its other operand."""
    partner = weight_partner(name, role)
    return partner is not None and _is_weight(_argument(func, args, kwargs, partner))


def _broadcast(func, args: tuple, kwargs: dict, name: str, role: str, t: torch.Tensor) -> bool:
    """Whether the save passed as ``role`` of the element-wise product ``name`` has fewer elements than the product
    and the other operand has them all (``rules.FACTOR``: the other's gradient is the product's, not a sum of it)."""
    if name != "mul" or role not in ("self", "other"):
        return False
    other = _argument(func, args, kwargs, "other" if role == "self" else "self")
    if not isinstance(other, torch.Tensor) or t.numel() >= other.numel():
        return False
    return other.numel() == torch.broadcast_shapes(t.shape, other.shape).numel()


def _among(owner: torch.Tensor, refs: list[weakref.ref]) -> bool:
    """``owner`` (a tensor's storage owner: itself, or the tensor it is a view of) is one of ``refs``."""
    return any(ref() is owner for ref in refs)


class OpWatcher(TorchDispatchMode):
    """Names the op and role of each save (see the module docstring). ``on_input(handle, site, origin)``
    (origin: a key of ``rules.PROVENANCE`` or ``None``) is called for each pending handle at the next op's
    dispatch (where no mode is active, so the compression it runs is not watched), or at the end of the
    forward."""

    def __init__(self, on_input: Callable[[object, Site, str | None], None]) -> None:
        super().__init__()
        self.on_input = on_input
        self.pending: list = []  # (handle, its site if a result save) waiting, each with its tensor in .stored
        self.ops = 0  # aten ops seen
        self._quiet = False
        self._last = None  # (func, weak references to its tensor results, its scalar arguments)
        self._claimed: set[str] = set()
        self._saved_names: dict[tuple, frozenset] = {}
        self._bernoulli: weakref.ref | None = None
        self._made: dict[str, list[weakref.ref]] = {"exp": [], "dropout": [], "probabilities": []}  # this pass

    @contextmanager
    def quiet(self):
        """Ops run inside (the controller's own compression) pass through unseen."""
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._quiet:
            return func(*args, **kwargs)
        self.ops += 1
        if self.pending:
            self._resolve(func, args, kwargs)
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "bernoulli_":
            self._bernoulli = weakref.ref(args[0])
        elif name == "div_" and self._bernoulli is not None and self._bernoulli() is args[0]:
            self._made["dropout"].append(weakref.ref(args[0]))
            self._bernoulli = None
        elif name in ("exp", "exp_"):
            self._made["exp"].append(weakref.ref(storage_owner(out)))
        elif name == "div" and self._made["exp"] and isinstance(args[1], torch.Tensor):
            if _among(storage_owner(args[0]), self._made["exp"]):
                self._made["probabilities"].append(weakref.ref(out))
        results = out if isinstance(out, tuple | list) else (out,)
        refs = tuple(weakref.ref(r) if isinstance(r, torch.Tensor) else None for r in results)
        self._last = (func, refs, args, kwargs)
        self._claimed = set()
        return out

    def _resolve(self, func, args: tuple, kwargs: dict) -> None:
        pending, self.pending = self.pending, []
        params = None
        for handle, site in pending:
            if site is not None:  # a result save of the op before
                self.on_input(handle, site, None)
                continue
            t = handle.stored
            if params is None:
                params = _params(func, args, kwargs)
            name, role = func.overloadpacket.__name__, _role(func, args, kwargs, t)
            weight = _weight_operand(func, args, kwargs, name, role)
            broadcast = _broadcast(func, args, kwargs, name, role, t)
            site = Site(name, func._overloadname, role, params, weight_operand=weight, broadcast=broadcast)
            self.on_input(handle, site, self._origin(t))

    def _origin(self, t: torch.Tensor) -> str | None:
        made = self._made
        if not (made["dropout"] or made["exp"]):  # nothing made by provenance in this pass (probabilities need an exp)
            return None
        owner = storage_owner(t)
        if _among(owner, made["dropout"]):
            return "dropout"
        if _among(owner, made["probabilities"]) or _among(owner, made["exp"]):
            return "probabilities"  # an exp result saved as another op's input too: one copy at one width
        return None

    def result_site(self, t: torch.Tensor) -> Site | None:
        """The site of ``t`` if this save is a result save of the op just dispatched, else ``None``."""
        if self._last is None:
            return None
        func, refs, args, kwargs = self._last
        index = next((i for i, ref in enumerate(refs) if ref is not None and ref() is t), None)
        if index is None:
            return None
        node = t.grad_fn
        if node is None:  # a non-differentiable result (a buffer): its node is that of another result
            node = next((r().grad_fn for r in refs if r is not None and r() is not None and r().grad_fn), None)
        if node is None:
            return None
        names = _result_names(func)
        key = (func, type(node))
        saved = self._saved_names.get(key)
        if saved is None:
            saved = self._saved_names[key] = frozenset(n for n in names if hasattr(node, "_raw_saved_" + n))
        name = names[index] if index < len(names) else "?"
        if name not in saved or name in self._claimed:
            return None
        self._claimed.add(name)
        return Site(func.overloadpacket.__name__, func._overloadname, name, _params(func, args, kwargs), True)

    def flush(self) -> None:
        """End of the forward pass: handles still waiting have no op (they are resolved as unknown)."""
        pending, self.pending = self.pending, []
        for handle, site in pending:
            self.on_input(handle, site or Site("?"), None)
        self._last, self._claimed, self._bernoulli = None, set(), None
        for refs in self._made.values():
            refs.clear()
