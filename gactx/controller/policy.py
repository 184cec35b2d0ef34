"""What to do with one saved tensor: keep it as it is, pack a bool mask, or compress it.

The rules that need no op, in order (see docs/levels.md#what-each-saved-tensor-gets); the op rules follow them
(``rules.py``):

1. Parameters, buffers, views of them, and autocast copies of weights are kept: they stay alive anyway,
   so a compressed copy would add memory, not save it.
2. Not floating point (integer indices, complex), float64, sparse or other layouts, and tensors with
   fewer than ``min_numel`` elements are kept as they are; bool masks are packed to 1 bit, losslessly.
"""

from __future__ import annotations

import weakref

import torch

from gactx.kernels.format import FLOAT_DTYPES

__all__ = [
    "KEEP_PARAMETER", "ModelStorages", "is_weight", "is_weight_copy", "keep_reason", "storage_owner", "storage_ptr",
    "value_reason",
]  # fmt: skip

KEEP_PARAMETER = "parameter"


def storage_ptr(t: torch.Tensor) -> int | None:
    """Address of ``t``'s storage, or ``None`` for tensors without one (nested, functional wrappers)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor that keeps ``t``'s storage alive: its base for a view, else itself.

    A weak reference to it tells whether a storage address still names the same storage. Views are often
    temporaries (Q, K and V projections each reshape the same input), so the view itself is not enough.
    """
    return t if t._base is None else t._base


# Nodes of views, through which a weight copy reaches the op that saves it (linear saves ``w.t()``).
_VIEW_NODES = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
               "ReshapeAliasBackward0", "ExpandBackward0", "SliceBackward0", "AliasBackward0"}  # fmt: skip


_COPY_OR_VIEW_NODES = _VIEW_NODES | {"ToCopyBackward0"}


def is_weight_copy(t: torch.Tensor) -> bool:
    """An autocast (or ``.to``) copy of a leaf that requires grad, or a view of one: the copy's grad_fn
    feeds an AccumulateGrad."""
    fn = t.grad_fn
    for _ in range(4):  # a few views deep
        if fn is None or type(fn).__name__ not in _VIEW_NODES:
            break
        fn = fn.next_functions[0][0] if fn.next_functions else None
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)


def keep_reason(t: torch.Tensor, ptr: int | None, min_numel: int, model_ptrs: frozenset[int]) -> str | None:
    """Why ``t`` (its storage at ``ptr``) is kept as it is, or ``None`` when it should be packed (bool)
    or compressed (float)."""
    if ptr is None or t.layout != torch.strided or t.is_meta:
        return "unsupported layout"
    if is_weight(t, ptr, model_ptrs):
        return KEEP_PARAMETER
    return value_reason(t, min_numel)


def is_weight(t: torch.Tensor, ptr: int, model_ptrs: frozenset[int]) -> bool:
    """Whether ``t`` (its storage at ``ptr``) is kept as a weight (:data:`KEEP_PARAMETER`) where its layout is not
    kept (:func:`keep_reason`'s first test): a parameter, a view of one, or a cast copy of one."""
    # An nn.Parameter (or a view of one, as linear saves weight.t()) is a weight even when its storage is
    # new to us: FSDP2 swaps in all-gathered parameters during forward, and frees and re-gathers their
    # storage around backward.
    if ptr in model_ptrs:
        return True
    fn = t.grad_fn
    if fn is not None:  # made by an op: a weight only through views and copies (most saves end here)
        through = _THROUGH.get(type(fn))
        if through is None:
            through = _THROUGH[type(fn)] = type(fn).__name__ in _COPY_OR_VIEW_NODES
        if not through:
            return False
    owner = t if t._base is None else t._base  # storage_owner(t) and _is_parameter(owner), inlined: every save
    if getattr(owner, "_is_param", False) if type(owner) is torch.Tensor else isinstance(owner, torch.nn.Parameter):
        return True
    return fn is not None and is_weight_copy(t)


# Node class -> whether its name is a view's or a copy's (_COPY_OR_VIEW_NODES): looked up by class, not by name, as
# every save's node is.
_THROUGH: dict[type, bool] = {}


_PACKED = frozenset((*FLOAT_DTYPES, torch.bool))  # what value_reason lets through, whatever its size


def value_reason(t: torch.Tensor, min_numel: int) -> str | None:
    """Why ``t`` is kept for what it holds: not floating point (nor bool), float64, or fewer than ``min_numel``
    elements; else ``None``. (Eager saves and compiled graphs' alike.)"""
    dtype = t.dtype
    if dtype not in _PACKED:
        return f"dtype {str(dtype).removeprefix('torch.')}"
    if t.numel() < min_numel:
        return "small"
    return None


def _is_parameter(t: torch.Tensor) -> bool:
    """``isinstance(t, nn.Parameter)``, which is also true of a tensor flagged ``_is_param``; a plain tensor is
    tested for the flag alone (the metaclass's check is Python, and this runs for every save)."""
    if type(t) is torch.Tensor:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, torch.nn.Parameter)


class ModelStorages:
    """The storages of a model's parameters and buffers, read when asked (once a pass: a parameter's storage may be
    swapped, ``model.to()`` replaces buffers). The tables that hold them, each module's ``_parameters`` and
    ``_buffers``, are found by one walk of the modules, walked again only after a module was added to one of the
    model's (the walk is four fifths of the time). A module added to a container that is no module of the model is not
    counted: transformers' decoders build ``self.layers[:n]``, a new ``ModuleList`` of every layer, in each forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        _watch_modules()
        self.model = model
        self._tables: list[dict] = []
        self.modules: set[int] = set()  # the ids of the model's modules at the last walk
        self._walked = -1  # the count of added modules the tables were found at
        _WATCHED.add(self)

    def __call__(self) -> frozenset[int]:
        if self._walked != _ADDED[0]:
            (self._tables, self.modules), self._walked = _tables(self.model), _ADDED[0]
        return _storages(self._tables)


_ADDED = [0]  # modules added to a module of a watched model (a global registration hook counts them)
_WATCHED: weakref.WeakSet[ModelStorages] = weakref.WeakSet()


def _watch_modules() -> None:
    if not _ADDED[0]:
        _ADDED[0] = 1
        torch.nn.modules.module.register_module_module_registration_hook(_added)


def _added(module: torch.nn.Module, name: str, submodule) -> None:
    if any(id(module) in watched.modules for watched in _WATCHED):
        _ADDED[0] += 1


def _tables(model: torch.nn.Module) -> tuple[list[dict], set[int]]:
    """Each module's ``_parameters`` and ``_buffers`` (one walk of the modules' own tables: ``model.modules()`` names
    each module on the way, a third of the walk's time), and the modules' ids."""
    tables, seen, stack = [], set(), [model]
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        tables += (module._parameters, module._buffers)
        stack.extend(module._modules.values())
    return tables, seen


def _storages(tables: list[dict]) -> frozenset[int]:
    try:  # storage_ptr(t), inlined: once a pass, for every parameter and buffer
        ptrs = [t.untyped_storage().data_ptr() for table in tables if table for t in table.values() if t is not None]
        return frozenset(ptrs)
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without a storage among them
        ptrs = {storage_ptr(t) for table in tables for t in table.values() if t is not None}
        ptrs.discard(None)
        return frozenset(ptrs)
