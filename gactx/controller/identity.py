"""Which saved tensor is which: a key that names "the same tensor" from one step to the next.

A key is the innermost module running when the tensor was saved (its qualified name), which call of that
module it was in this forward (a shared block applied twice), the index of the save within that call,
and the tensor's shape. A changed graph (another branch, a new sequence length) produces new keys; keys
never depend on a global save counter, so recomputation and dynamic graphs cannot shift them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["BACKWARD", "Key", "ModuleTracker", "OUTSIDE", "graph_task_id", "in_backward"]

_CALL_IMPL = nn.Module._call_impl.__code__  # the frame of every module call, hooks included
OUTSIDE = "<outside modules>"  # saves made while no module of the model runs (functional code)
BACKWARD = "<backward>"  # saves made while backward runs (recomputation)
graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # -1: no backward runs
# Read on every module call: bound once (TorchDynamo knows the function, however it is reached).
_is_compiling, _get_ident = torch.compiler.is_compiling, threading.get_ident


def in_backward() -> bool:
    """Whether autograd's backward is running in this thread (a reentrant checkpoint recomputing, say)."""
    return graph_task_id() != -1


class Slot(NamedTuple):
    """Where a save is made, whatever its shape: the module (qualified name), its call in the pass (1 the first)
    and the save's index among that call's. What the allocation, the plan and the sensitivities are kept by."""

    module: str
    call: int
    index: int


class Key(NamedTuple):
    """A save's :class:`Slot` and the saved tensor's shape."""

    module: str
    call: int
    index: int
    shape: tuple[int, ...]

    @property
    def slot(self) -> Slot:
        return Slot(self[0], self[1], self[2])

    def __str__(self) -> str:
        name = self.module or "(root)"
        call = f"#{self.call}" if self.call > 1 else ""
        return f"{name}{call}[{self.index}]"


_new_key = partial(tuple.__new__, Key)  # Key(...) without its Python __new__: every save makes one


class ModuleTracker:
    """Follows module calls of one model with forward pre- and post-hooks and hands out keys.

    ``on_new_pass`` runs when a forward pass starts: the model itself called while none of its modules runs,
    or a submodule called alone (``model.body(x)``) a second time since the last start; ``on_pass_end`` when
    the outermost call returns (or raises).

    ``nn.Module`` runs its ``always_call`` post-hooks on an ``Exception`` only: a ``KeyboardInterrupt`` (or
    any other ``BaseException``) inside a forward leaves its modules on the tracker's stack. That is found
    when a module on the stack is called again and no call of it is running any more (the Python stack says
    so): the stale frames are dropped, the interrupted pass ends, and the call starts a pass of its own.
    """

    def __init__(
        self, model: nn.Module, on_new_pass: Callable[[], None], on_pass_end: Callable[[], None] = lambda: None
    ) -> None:
        self.model = model
        self.on_new_pass = on_new_pass
        self.on_pass_end = on_pass_end
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # What attach() registered on each module, kept for the next attach: id -> (module, pre-hook handle,
        # post-hook handle). The hooks are the same two functions on every module, made once.
        self._registered: dict[int, tuple] = {}
        self._enter_hook, self._exit_hook = self._enter, self._exit
        self._names: dict[int, tuple[nn.Module, str]] = {}  # id of a module of the model -> (it, its name)
        self._stack: list[list] = []  # [name, call number, saves so far, module]
        self.calls: dict[str, int] = {}  # module -> its calls in the pass under way
        self._entered: set[str] = set()  # modules called while none of the model's ran, this pass
        self._outside = self._backward = 0
        self._thread = threading.get_ident()
        # Called as hook(name, call, module, output) when a followed module call returns normally, before its
        # frame is dropped: the free sensitivity estimate hooks the gradient of the call's output there.
        self.output_hooks: list[Callable[[str, int, nn.Module, object], None]] = []
        # Called as a followed module call begins or returns, before the stack changes: compiled graphs' logged saves
        # are recorded then, under the module that ran them (compiled.py).
        self.on_boundary: Callable[[], None] | None = None

    def attach(self) -> None:
        """Follow the model's calls in this thread (saved-tensor hooks act in the thread that installed them;
        calls from other threads, an evaluation say, run as plain PyTorch and are not followed).

        Every module gets the same two hook functions, which find it among the model's by its id: torch.compile
        guards on every hook a compiled module's call runs, and a hook of its own on each module (a bound partial)
        gave TorchDynamo's guard tree 957 lines a call on ``benchmarks.host``'s MLP of 17 modules, against compiled
        plain's 307 (559 now). The model's modules are read at each attach: one added later is followed from the
        next installation on. Attached again, a module gets the hooks it had, under the same ids: new ones at every
        installation recompiled the model each time, until TorchDynamo's recompile limit (8) left it uncompiled."""
        self._thread = threading.get_ident()
        self._names = {id(module): (module, name) for name, module in self.model.named_modules()}
        registered, self._registered = self._registered, {}  # the model's modules now: none that left it is held
        for module, _ in self._names.values():
            known = registered.get(id(module))
            if known is not None and known[0] is module:
                _, pre, post = known
                module._forward_pre_hooks[pre.id] = self._enter_hook  # what register_forward_pre_hook sets
                module._forward_hooks[post.id] = self._exit_hook  # ... and register_forward_hook(always_call=True)
                module._forward_hooks_always_called[post.id] = True
            else:
                pre = module.register_forward_pre_hook(self._enter_hook)
                post = module.register_forward_hook(self._exit_hook, always_call=True)
            self._registered[id(module)] = (module, pre, post)
            self._handles += [pre, post]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _enter(self, module: nn.Module, args) -> None:
        # A compiled region's saves are named by its graph (compiled.py); calls while backward runs (a
        # reentrant checkpoint recomputing) belong to no forward pass (in_backward(), inlined: every module call).
        if _is_compiling() or graph_task_id() != -1 or _get_ident() != self._thread:
            return
        known = self._names.get(id(module))
        if known is None or known[0] is not module:  # no module of the model now (its id another's since)
            return
        if self.on_boundary is not None:
            self.on_boundary()
        stack, name = self._stack, known[1]
        if stack and (module is self.model or module is stack[0][3]) and self._interrupted(module):
            del stack[:]
            self.on_pass_end()
        if not stack:
            if module is self.model or name in self._entered:
                self.calls.clear()
                self._entered.clear()
                self._outside = self._backward = 0
                self.on_new_pass()
            self._entered.add(name)
        calls = self.calls
        call = calls[name] = calls.get(name, 0) + 1
        stack.append([name, call, 0, module])

    def _interrupted(self, entering: nn.Module) -> bool:
        """Whether the outermost module on the stack is no longer running: no frame of ``nn.Module``'s call
        has it as ``self`` (``entering``'s own call, of this pre-hook, aside). Read only where the model or
        the outermost module is entered again with modules on the stack: a recursive call, or a forward that
        was interrupted."""
        bottom, frame, running = self._stack[0][3], sys._getframe(1), 0
        while frame is not None:
            if frame.f_code is _CALL_IMPL and frame.f_locals.get("self") is bottom:
                running += 1
            frame = frame.f_back
        return running <= (1 if entering is bottom else 0)

    def _exit(self, module: nn.Module, args, output) -> None:
        if _is_compiling() or graph_task_id() != -1 or _get_ident() != self._thread:
            return
        known = self._names.get(id(module))
        if known is None or known[0] is not module:
            return
        if self.on_boundary is not None:
            self.on_boundary()
        stack, name = self._stack, known[1]
        if stack and stack[-1][0] == name:
            frame = stack.pop()
            if self.output_hooks:
                for hook in self.output_hooks:
                    hook(name, frame[1], module, output)
            if not stack:  # the model, or a submodule called alone, returned: its forward ended
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
        if graph_task_id() != -1:  # in_backward(), called for every save
            self._backward += 1
            return Key(BACKWARD, 1, self._backward - 1, tuple(t.shape))
        if not self._stack:
            self._outside += 1
            return Key(OUTSIDE, 1, self._outside - 1, tuple(t.shape))
        frame = self._stack[-1]
        index = frame[2]
        frame[2] = index + 1
        return _new_key((frame[0], frame[1], index, tuple(t.shape)))
