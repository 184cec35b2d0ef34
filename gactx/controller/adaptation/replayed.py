"""An estimate's passes against the exact base from one forward of the closure: its backward, replayed for each probe.

A probe pass against the exact base (``sensitivity.EXACT_BASE``) changes nothing in the forward: only what backward
reads of the probed tensor. So the closure runs once, under a plan that defers (``Plan.deferred``: every save of an
allocated class kept for later probes, ``gactx/controller/probes.py``), with its backward calls recorded and their
graphs kept (``retain_graph``); each later pass replays those calls under the probe then in force. A pass then costs a
backward, not a forward and a backward: on the LoRA decoder (small) the forward was two thirds of a pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gactx.controller.identity import in_backward

__all__ = ["REPLAY", "Replayed"]

# Replay the closure's backward for each pass of an estimate against the exact base; False: run the closure whole.
REPLAY = True


class Replayed:
    """``backprop`` as the passes of one estimate (called as the closure is, once a pass). The first call runs it whole,
    under a deferring plan (``defer(True)``, then ``defer(False)``), recording its backward calls; every later call
    replays them. The first call's gradients are a replay's too (the calls replayed once after the closure returns), so
    that whatever the closure does to the gradients after its backward (clipping) is in no pass. Where the closure made
    no backward call that can be replayed (``torch.autograd.grad``, ``create_graph``), every call runs it whole, under
    the probe then in force. :meth:`close` frees the kept graphs."""

    def __init__(self, model: nn.Module, backprop: Callable[[], object], defer: Callable[[bool], None]) -> None:
        self.model, self.backprop, self.defer = model, backprop, defer
        self.calls: list[tuple] | None = None  # (tensors, grad_tensors, inputs) of each backward call, once recorded

    def __call__(self) -> None:
        if self.calls is None:
            self.calls = self._record()
            if not self.calls:
                return  # the whole closure ran, with its own gradients
            for p in self.model.parameters():
                p.grad = None
        elif not self.calls:
            self.backprop()
            return
        for tensors, grad_tensors, inputs in self.calls:
            torch.autograd.backward(tensors, grad_tensors, retain_graph=True, inputs=inputs)

    def close(self) -> None:
        """Drop the recorded calls, and with them the graphs and the saves they keep."""
        self.calls = []

    def _record(self) -> list[tuple]:
        calls, replayable = [], True
        original = torch.autograd.backward

        def recording(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None,
                      inputs=None):  # fmt: skip
            nonlocal replayable
            if in_backward():  # a reentrant checkpoint's own, inside the closure's backward: replayed with it
                return original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
            replayable = replayable and not create_graph and grad_variables is None
            calls.append((tensors, grad_tensors, inputs))
            return original(tensors, grad_tensors, retain_graph=True, create_graph=create_graph, inputs=inputs)

        self.defer(True)
        torch.autograd.backward = recording
        try:
            self.backprop()
        finally:
            torch.autograd.backward = original
            self.defer(False)
        return calls if replayable else []
