"""The ways to train a workload that the benchmarks compare: full precision, gactx levels, per-block
activation checkpointing, and ``torch.autograd.graph.save_on_cpu``; each optionally under bf16 autocast.

A :class:`Method` wraps one workload for one run: ``with method.forward():`` around the forward pass
(backward runs outside, as autocast wants), then ``method.after_step()`` after the optimizer step
(gactx's ``iterate``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

import gactx

__all__ = ["METHODS", "GACTX_LEVELS", "COMPILABLE", "Method"]

GACTX_LEVELS = ("L1", "L1.2", "L2", "L2.2", "L3")
METHODS = ("fp", *GACTX_LEVELS, "checkpoint", "save_on_cpu")
COMPILABLE = ("fp", "L1", "L1.2", "L2", "L2.2")  # methods the models benchmark also runs compiled
PROBE_SAMPLES = 8  # the estimator's closure runs on this many samples of the batch


class Method:
    def __init__(self, name: str, workload, precision: str = "fp32", compiled: bool = False) -> None:
        """``compiled``: the model's forward under ``torch.compile`` (Inductor) for the run."""
        if name not in METHODS:
            raise ValueError(f"method {name!r} is not one of {METHODS}")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {precision!r} is not one of ('fp32', 'bf16')")
        if compiled and name not in COMPILABLE:
            raise ValueError(f"method {name!r} is not run compiled; those that are: {COMPILABLE}")
        self.name, self.workload, self.precision, self.compiled = name, workload, precision, compiled
        self.device_type = next(workload.model.parameters()).device.type
        self.controller = None
        if name in GACTX_LEVELS:  # installed for the whole run: installing hooks every module, once
            self.controller = gactx.Controller(workload.model, level=name).install_hook()
        self._unwrap: list = []
        if name == "checkpoint":
            self._wrap_blocks()
        if compiled:
            torch._dynamo.reset()
            model = workload.model
            model.forward = torch.compile(model.forward)
            self._unwrap.append((model, None))

    @property
    def label(self) -> str:
        return self.name + ("" if self.precision == "fp32" else "+bf16") + ("+compile" if self.compiled else "")

    def _wrap_blocks(self) -> None:
        """Checkpoint every block (non-reentrant): its activations are recomputed in backward."""
        for block in self.workload.blocks:
            original = block.forward

            def forward(*args, _original=original, **kwargs):
                return checkpoint(_original, *args, use_reentrant=False, **kwargs)

            block.forward = functools.wraps(original)(forward)
            self._unwrap.append((block, original))

    def close(self) -> None:
        for block, original in self._unwrap:
            if original is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = original
        self._unwrap.clear()
        if self.controller is not None and self.controller.installed:
            self.controller.uninstall_hook()

    def suspend(self) -> None:
        """Take gactx's hooks off until :meth:`active` (another method's run in between)."""
        if self.controller is not None and self.controller.installed:
            self.controller.uninstall_hook()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The method's hooks on for the block (after :meth:`suspend`), off again after it."""
        installed = self.controller is not None and not self.controller.installed
        if installed:
            self.controller.install_hook()
        try:
            yield
        finally:
            if installed:
                self.controller.uninstall_hook()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around one forward pass."""
        with contextlib.ExitStack() as stack:
            if self.precision == "bf16":
                stack.enter_context(torch.autocast(self.device_type, dtype=torch.bfloat16))
            if self.name == "save_on_cpu":
                stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=self.device_type == "cuda"))
            yield

    def after_step(self, inputs: tuple, target: torch.Tensor) -> None:
        """After the optimizer step: gactx counts the step and, at adaptive levels, adapts on a sub-batch."""
        if self.controller is None:
            return
        probe_inputs, probe_target = _sub_batch(self.workload, inputs, target)

        def backprop():
            with self.forward():
                loss = self.workload.loss(self.workload.model, probe_inputs, probe_target)
            loss.backward()

        self.controller.iterate(backprop)


def _sub_batch(workload, inputs: tuple, target: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """The first few samples of a batch (a graph is trained whole: GNNs get the whole batch)."""
    if workload.family == "gnn":
        return inputs, target
    return tuple(t[:PROBE_SAMPLES] if torch.is_tensor(t) else t for t in inputs), target[:PROBE_SAMPLES]
