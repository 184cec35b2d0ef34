"""Which saved tensor is which: a key that names "the same tensor" from one step to the next.

A key is the innermost module running when the tensor was saved (its qualified name), which call of that
module it was in this forward (a shared block applied twice), the index of the save within that call,
and the tensor's shape. A changed graph (another branch, a new sequence length) produces new keys; keys
never depend on a global save counter, so recomputation and dynamic graphs cannot shift them. A save made while
backward runs (a checkpointed region recomputing) is numbered within that backward: every backward of one graph
names its saves alike, and so draws the same noise for them.

The tracker finds them with a forward pre- and post-hook on every module of the model. Those hooks cost every module
call (``nn.Module`` takes its slow path for a module with hooks) about as much as gactx's whole pack path costs a
small save. So once two forward passes in a row saved the same sequence (each save's key, dtype, ``grad_fn`` node and
call site: the code and instruction of the frame that ran the op), the tracker keeps only the model's own hooks and
hands out the keys of the last pass by position: the ``i``-th save of a pass gets the ``i``-th key while it matches
there. The first save that differs (another branch, another length, more saves), or a save made while a module of
the model runs with no pass of the model under way (a submodule called alone), ends that. The modules get their hooks
back at once, and the tracker's stack is rebuilt where the pass stands: the last pass's module calls up to the last
save that matched, laid against the modules Python's frames show running. A pass by position that makes fewer saves
ends it too, for the next pass. What this cannot see is a difference in the module alone: a block inserted before an
identical one takes that one's keys for the pass (the same ops, so the same rules; the docs say more), and a module
whose call saved nothing and that no frame shows any more may have a later call numbered one lower than a followed
pass numbers it. Every divergence doubles the matching passes needed before keys go by position again, and after
``MAX_DIVERGENCES`` the tracker follows every call for good. An adaptation's probes (the closure, on another batch)
follow every module and leave the passes to repeat as they were (:meth:`ModuleTracker.following`). Keys go by
position only while nothing else needs module calls: no module output hooks (the free estimator's), no compiled
graphs (their saves are named at module boundaries), passes that begin at the model itself. What a followed pass
saved, and its module calls, are kept in ``positions.py``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from gactx.controller.positions import Trace, call_site, passes_saves_on

__all__ = [
    "BACKWARD", "MAX_DIVERGENCES", "Key", "ModuleTracker", "OUTSIDE", "graph_task_id", "in_backward", "passes_saves_on",
]  # fmt: skip

_CALL_IMPL = nn.Module._call_impl.__code__  # the frame of every module call, hooks included
OUTSIDE = "<outside modules>"  # saves made while no module of the model runs (functional code)
BACKWARD = "<backward>"  # saves made while backward runs (recomputation)
MAX_DIVERGENCES = 4  # passes that left the keys by position: after this many, every module call is followed for good
graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # -1: no backward runs
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback  # runs as the current backward ends
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
    """Follows module calls of one model with forward pre- and post-hooks and hands out keys; once passes repeat,
    hands them out by position with the model's own hooks alone (the module docstring).

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
        # [name, call number, saves so far, module, unseen]: ``unseen``, a call rebuilt when keys stopped going by
        # position, whose return no hook may tell (it began without the tracker's hooks)
        self._stack: list[list] = []
        self.calls: dict[str, int] = {}  # module -> its calls in the pass under way
        self._entered: set[str] = set()  # modules called while none of the model's ran, this pass
        self._outside = 0
        # The backward making saves now (a checkpointed region recomputing): each graph task of it -> [its number, its
        # saves so far] (_backward_key). None: no backward has saved since the last one ended or the last pass began.
        self._backward: dict[int, list[int]] | None = None
        self._thread = threading.get_ident()
        # Called as hook(name, call, module, output) when a followed module call returns normally, before its
        # frame is dropped: the free sensitivity estimate hooks the gradient of the call's output there.
        self.output_hooks: list[Callable[[str, int, nn.Module, object], None]] = []
        # Called as a followed module call begins or returns, before the stack changes: compiled graphs' logged saves
        # are recorded then, under the module that ran them (compiled.py).
        self.on_boundary: Callable[[], None] | None = None
        # Keys by position (the module docstring): the last followed pass of the model, and the one under way.
        self._trace = Trace()
        self.by_position = False  # keys are handed out by position now, the model's own hooks alone
        self._position = 0  # saves of the pass under way, by position
        self._repeats = 0  # followed passes in a row that saved what the one before saved
        self.divergences = 0  # passes that left the keys by position
        self._recording = False  # the pass under way began at the model itself, followed: its saves are recorded
        self._paused = False  # inside following(): no pass is one to repeat

    def attach(self, only_model: bool = False) -> None:
        """Follow the model's calls in this thread (saved-tensor hooks act in the thread that installed them;
        calls from other threads, an evaluation say, run as plain PyTorch and are not followed).

        Every module gets the same two hook functions, which find it among the model's by its id: torch.compile
        guards on every hook a compiled module's call runs, and a hook of its own on each module (a bound partial)
        gave TorchDynamo's guard tree 957 lines a call on ``benchmarks.host``'s MLP of 17 modules, against compiled
        plain's 307 (559 now). The model's modules are read at each attach: one added later is followed from the
        next installation on. Attached again, a module gets the hooks it had, under the same ids: new ones at every
        installation recompiled the model each time, until TorchDynamo's recompile limit (8) left it uncompiled.
        ``only_model``: the model's own hooks alone (keys by position)."""
        self._thread = threading.get_ident()
        self._unhook()
        self.by_position = only_model
        self._names = {id(module): (module, name) for name, module in self.model.named_modules()}
        registered, self._registered = self._registered, {}  # the model's modules now: none that left it is held
        for module, _ in self._names.values():
            known = registered.get(id(module))
            if known is not None and known[0] is module:
                self._registered[id(module)] = known
            if only_model and module is not self.model:
                continue
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

    @contextmanager
    def following(self) -> Iterator[None]:
        """Every module followed for the block, and none of its passes a pass to repeat or a divergence: an adaptation's
        probes run the closure (another batch: other shapes). After it, the passes to repeat are the training's again,
        and keys go by position from the next pass that repeats them."""
        paused, self._paused = self._paused, True
        if self.by_position:
            self.attach()
        try:
            yield
        finally:
            self._paused = paused

    def detach(self) -> None:
        self._unhook()
        self.by_position = False
        self._stack.clear()

    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- module calls ---------------------------------------------------------------------------------------

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
            self._recording = False  # an interrupted pass is no pass to repeat
            self.on_pass_end()
        if not stack:
            if module is self.model or name in self._entered:
                self.calls.clear()
                self._entered.clear()
                self._outside = self._position = 0
                self._backward = None
                self._recording = not self.by_position and not self._paused and module is self.model
                if self._recording:
                    self._trace.begin()
                self.on_new_pass()
                if self.by_position and (self.output_hooks or self.on_boundary is not None):
                    self.attach()  # what watches module calls needs them all followed
            self._entered.add(name)
        calls = self.calls
        call = calls[name] = calls.get(name, 0) + 1
        stack.append([name, call, 0, module, False])
        if self._recording:
            self._trace.entered(name)

    def _interrupted(self, entering: nn.Module) -> bool:
        """Whether the outermost module on the stack is no longer running: no frame of ``nn.Module``'s call
        has it as ``self`` (``entering``'s own call, of this pre-hook, aside). Read only where the model or
        the outermost module is entered again with modules on the stack: a recursive call, or a forward that
        was interrupted."""
        bottom = self._stack[0][3]
        running = sum(1 for module in self._running() if module is bottom)
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
        while stack and stack[-1][4] and stack[-1][3] is not module:  # rebuilt calls that returned unseen
            stack.pop()
        if stack and stack[-1][0] == name:
            frame = stack.pop()
            if self._recording:
                self._trace.returned()
            if self.output_hooks:
                for hook in self.output_hooks:
                    hook(name, frame[1], module, output)
            if not stack:  # the model, or a submodule called alone, returned: its forward ended
                self._ended()
                self.on_pass_end()

    def _ended(self) -> None:
        """A forward ended: a followed pass of the model becomes the pass to repeat (keys go by position once enough
        passes in a row repeat it); a pass by position that made fewer saves than the one it repeats ends keys by
        position (what it skipped may have shifted the rest)."""
        if self.by_position:
            if self._position and self._position != len(self._trace):
                self._diverged()
            return
        if not self._recording:  # a pass of a submodule alone, an interrupted one, or one inside following()
            return
        self._recording = False
        repeated = self._trace.end()
        if repeated is None:  # a pass that saved nothing (an evaluation) changes nothing
            return
        self._repeats = self._repeats + 1 if repeated else 0
        if (
            self._repeats >= 1 << self.divergences and self.divergences < MAX_DIVERGENCES
            and not self.output_hooks and self.on_boundary is None
        ):  # fmt: skip
            self.attach(only_model=True)

    def _diverged(self) -> None:
        """Keys stop going by position: every module followed again, after more repeats (the module docstring)."""
        self.divergences += 1
        self._repeats = 0
        self.attach()

    def _diverge(self) -> None:
        """A save of the pass under way differs from the one at its position (or comes while a module of the model runs
        outside a pass of it): keys stop going by position, and the stack is rebuilt where the pass stands."""
        position = self._position - 1 if self._stack else 0  # the saves of the pass that matched
        self._diverged()
        # A submodule called alone after a pass by position: the calls of the whole pass repeated, its stack empty.
        modules = {name: module for module, name in self._names.values()}
        stack, calls = self._trace.calls_at(position if self._stack else len(self._trace), modules)
        names = self._names
        running = self._running()
        kept = 0
        while kept < min(len(stack), len(running)) and stack[kept][3] is running[kept]:
            kept += 1
        del stack[kept:]
        for module in running[kept:]:
            name = names[id(module)][1]
            call = calls[name] = calls.get(name, 0) + 1
            stack.append([name, call, 0, module, True])
        for frame in stack:
            frame[4] = frame[3] is not self.model  # the model's own calls had their hooks
        if stack and not self._stack:
            self._entered.add(stack[0][0])
        self._stack[:], self.calls = stack, calls

    def _running(self) -> list[nn.Module]:
        """The model's modules whose calls are running, outermost first, as Python's frames show them."""
        names, found, frame = self._names, [], sys._getframe(1)
        while frame is not None:
            if frame.f_code is _CALL_IMPL:
                module = frame.f_locals.get("self")
                known = names.get(id(module))
                if known is not None and known[0] is module:
                    found.append(module)
            frame = frame.f_back
        found.reverse()
        return found

    def _returned_unseen(self) -> None:
        """Drop the rebuilt calls on top of the stack that are no longer running (no hook tells their return)."""
        running = {id(module) for module in self._running()}
        stack = self._stack
        while stack and stack[-1][4] and id(stack[-1][3]) not in running:
            stack.pop()

    # -- keys -----------------------------------------------------------------------------------------------

    @property
    def inside(self) -> bool:
        """Whether a module of the model is running (a forward pass is under way)."""
        if self._stack and self._stack[-1][4]:
            self._returned_unseen()
        return bool(self._stack)

    def frame(self) -> tuple[str, int] | None:
        """The innermost module running eagerly (its name and call), or ``None``."""
        return (self._stack[-1][0], self._stack[-1][1]) if self._stack else None

    @passes_saves_on
    def at_position(self, t: torch.Tensor) -> tuple | None:
        """Where keys go by position and a pass of the model is under way: the save at this one's position in the pass
        repeated, ``(key, node, dtype, code, instruction)``, if ``t`` matches it (its shape, dtype, node and call
        site), the position then passed; else ``None``, nothing changed (:meth:`key` then tells the divergence). A
        forward save only."""
        if not self._stack:
            return None
        # Called from the pack path's lane (its pack and _by_position), under the hook: 3 frames that pass saves on.
        at = self._trace.at(self._position, t, call_site(3))
        if at is not None:
            self._position += 1
        return at

    def _backward_key(self, task: int, t: torch.Tensor) -> Key:
        """The key of a save made while backward runs (a checkpointed region recomputing): numbered from the first
        save of that backward, not of the pass, so that each backward of one graph (``retain_graph=True``) names the
        saves of its recomputation alike and draws their noise alike (``plan.seed`` by key). A backward started inside
        it (a reentrant checkpoint runs its region's backward so) is a graph task of its own, made afresh each time:
        its saves are numbered apart, as the key's ``call``, by the order the tasks first saved in."""
        tasks = self._backward
        if tasks is None:
            tasks = self._backward = {}
            # Closed as the task of its first save ends: the outermost backward that saves, whose nested tasks end
            # before it does. A backward that raises never ends so; the next pass reopens the numbering.
            _queue_callback(partial(self._backward_ended, tasks))
        numbered = tasks.get(task)
        if numbered is None:
            numbered = tasks[task] = [len(tasks) + 1, 0]
        index = numbered[1]
        numbered[1] = index + 1
        return Key(BACKWARD, numbered[0], index, tuple(t.shape))

    def _backward_ended(self, tasks: dict[int, list[int]]) -> None:
        if self._backward is tasks:
            self._backward = None

    @passes_saves_on
    def key(self, t: torch.Tensor) -> Key:
        """The key of a tensor being saved now."""
        task = graph_task_id()
        if task != -1:  # in_backward(), called for every save
            return self._backward_key(task, t)
        stack = self._stack
        if self.by_position:
            if stack:
                position = self._position
                self._position = position + 1
                at = self._trace.at(position, t, call_site())
                if at is not None:
                    return at[0]
                self._diverge()
            elif self._running():  # a submodule called alone
                self._diverge()
        if stack and stack[-1][4]:
            self._returned_unseen()
        if not stack:
            self._outside += 1
            return Key(OUTSIDE, 1, self._outside - 1, tuple(t.shape))
        frame = stack[-1]
        index = frame[2]
        frame[2] = index + 1
        key = _new_key((frame[0], frame[1], index, tuple(t.shape)))
        if self._recording:
            self._trace.saved(key, t, call_site())
        return key
