"""What keys by position read (``identity.py``): the saves of the last followed pass of the model, each with its call
site, and the module calls around them, to match a later pass's saves against and to rebuild the tracker's stack from.

A save's call site is the code and instruction of the frame that ran the op saving it: the first frame above the
functions a save passes through on its way from autograd to the tracker (the pack hook's, the pack path's, the
tracker's own; each marked with :func:`passes_saves_on`).
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["Trace", "call_site", "passes_saves_on"]

_PASSING: set = set()  # the code of the functions a save passes through to the tracker


def passes_saves_on(fn: Callable) -> Callable:
    """Mark ``fn`` as a function a save passes through on its way to the tracker: its frame is no call site."""
    _PASSING.add(fn.__code__)
    return fn


def call_site(skip: int = 0) -> tuple:
    """The code and instruction of the frame that ran the op saving now: the first frame outside the marked ones above
    the caller, ``skip`` frames above it known to be marked passed over (a frame object is made for each frame read on
    the way)."""
    frame = sys._getframe(skip + 1)
    while frame is not None and frame.f_code in _PASSING:
        frame = frame.f_back
    if frame is None:
        return None, -1
    code, instruction = frame.f_code, frame.f_lasti
    if PRECALL is not None and instruction >= 0 and code.co_code[instruction] == PRECALL:
        instruction += PRECALL_TO_CALL
    return code, instruction


# Python 3.11's specialized PRECALL instructions make the call themselves: once a frame's code is specialized (after a
# few runs), a call site's instruction reads as its PRECALL, before that as the CALL after it. Read as the CALL's, it
# stays the same (a specialized call otherwise diverged keys by position once). None after 3.11 (no PRECALL).
PRECALL = dis.opmap.get("PRECALL")
PRECALL_TO_CALL = 2 + 2 * getattr(dis, "_inline_cache_entries", {PRECALL: 0})[PRECALL] if PRECALL else 0


class Trace:
    """The last followed pass of the model (``saves``: each ``(key, node, dtype, code, instruction)``; ``events``: its
    module calls in order, a module entered as its name, one returned as ``None``, a save as ``True``; ``marks``: each
    save's place among the events), and the same of the followed pass under way while it is recorded."""

    def __init__(self) -> None:
        self.saves: list[tuple] = []
        self.marks: list[int] = []
        self.events: list = []
        self._saves, self._marks, self._events = [], [], []

    def __len__(self) -> int:
        return len(self.saves)

    def begin(self) -> None:
        """A followed pass of the model begins: recorded from here."""
        self._saves, self._marks, self._events = [], [], []

    def entered(self, name: str) -> None:
        self._events.append(name)

    def returned(self) -> None:
        self._events.append(None)

    def saved(self, key, t: torch.Tensor, site: tuple) -> None:
        self._saves.append((key, type(t.grad_fn), t.dtype, *site))
        self._marks.append(len(self._events))
        self._events.append(True)

    def end(self) -> bool | None:
        """The recorded pass ended: it becomes the pass to repeat. Whether it saved what the one before saved; ``None``
        where it saved nothing (an evaluation), which changes nothing."""
        if not self._saves:
            return None
        repeated = self._saves == self.saves
        self.saves, self.marks, self.events = self._saves, self._marks, self._events
        self._saves, self._marks, self._events = [], [], []
        return repeated

    def at(self, position: int, t: torch.Tensor, site: tuple) -> tuple | None:
        """The save at ``position`` if ``t``, saved at ``site``, matches it (shape, dtype, node, call site), else
        ``None``."""
        if position < len(self.saves):
            at = self.saves[position]
            if at[0][3] == t.shape and t.dtype is at[2] and type(t.grad_fn) is at[1] and site == at[3:]:
                return at
        return None

    def calls_at(self, saves: int, modules: dict[str, nn.Module]) -> tuple[list[list], dict[str, int]]:
        """The tracker's stack (``[name, call, saves so far, module, True]`` each: rebuilt, its return unseen) and calls
        as the pass repeated had them at its save ``saves`` (its first ``saves`` made); ``modules``: by name."""
        stack, calls = [], {}
        for event in self.events[: self.marks[saves - 1] + 1 if saves else 0]:
            if event is True:
                stack[-1][2] += 1
            elif event is None:
                stack.pop()
            else:
                call = calls[event] = calls.get(event, 0) + 1
                stack.append([event, call, 0, modules.get(event), True])
        return stack, calls
