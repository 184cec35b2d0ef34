"""Which saved tensor is which: a key that names "the same tensor" from one step to the next.

A key is the innermost module running when the tensor was saved (its qualified name), which call of that
module it was in this forward (a shared block applied twice), the index of the save within that call,
and the tensor's shape. A changed graph (another branch, a new sequence length) produces new keys; keys
never depend on a global save counter, so recomputation and dynamic graphs cannot shift them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["Key", "ModuleTracker", "OUTSIDE"]

OUTSIDE = "<outside modules>"  # saves made while no module of the model runs (functional code, backward)


class Key(NamedTuple):
    module: str
    call: int
    index: int
    shape: tuple[int, ...]

    def __str__(self) -> str:
        name = self.module or "(root)"
        call = f"#{self.call}" if self.call > 1 else ""
        return f"{name}{call}[{self.index}]"


class ModuleTracker:
    """Follows module calls of one model with forward pre- and post-hooks and hands out keys.

    ``on_new_pass`` runs when the model itself is called while none of its modules runs: the start of a
    forward pass; ``on_pass_end`` when that call returns (or raises).
    """

    def __init__(
        self, model: nn.Module, on_new_pass: Callable[[], None], on_pass_end: Callable[[], None] = lambda: None
    ) -> None:
        self.model = model
        self.on_new_pass = on_new_pass
        self.on_pass_end = on_pass_end
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._stack: list[list] = []  # [name, call number, saves so far]
        self._calls: dict[str, int] = {}
        self._outside = 0

    def attach(self) -> None:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, name)))
            self._handles.append(module.register_forward_hook(partial(self._exit, name), always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _enter(self, name: str, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():  # a compiled region's saves are named by its graph (compiled.py)
            return
        if not self._stack and module is self.model:
            self._calls.clear()
            self._outside = 0
            self.on_new_pass()
        call = self._calls[name] = self._calls.get(name, 0) + 1
        self._stack.append([name, call, 0])

    def _exit(self, name: str, module: nn.Module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        if self._stack and self._stack[-1][0] == name:
            self._stack.pop()
            if not self._stack and module is self.model:
                self.on_pass_end()

    @property
    def inside(self) -> bool:
        """Whether a module of the model is running (a forward pass is under way)."""
        return bool(self._stack)

    def frame(self) -> tuple[str, int] | None:
        """The innermost module running eagerly (its name and call), or ``None``."""
        return (self._stack[-1][0], self._stack[-1][1]) if self._stack else None

    def key(self, t: torch.Tensor) -> Key:
        """The key of a tensor being saved now."""
        if not self._stack:
            self._outside += 1
            return Key(OUTSIDE, 1, self._outside - 1, tuple(t.shape))
        frame = self._stack[-1]
        frame[2] += 1
        return Key(frame[0], frame[1], frame[2] - 1, tuple(t.shape))
