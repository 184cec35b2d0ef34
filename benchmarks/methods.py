"""The ways to train a workload that the benchmarks compare: full precision, gactx levels, activation
checkpointing (the model's own where it has one, else per block), checkpointing with a gactx level
(``"checkpoint+L1"``), and ``torch.autograd.graph.save_on_cpu``; each optionally under bf16 autocast.

Checkpointing as users run it, in three forms (all non-reentrant ``torch.utils.checkpoint``):

- ``checkpoint``: the model's own where it has one (Hugging Face's ``gradient_checkpointing_enable``, with
  ``use_reentrant=False``), else every block with torch's defaults;
- ``checkpoint-fast``: every block, with what torch offers to make it cheaper and still right: no check of the
  recomputed tensors' metadata (``determinism_check="none"``), and where the model has no dropout to draw again
  (the workloads draw no other random numbers), no RNG state saved and restored (``preserve_rng_state=False``);
- ``checkpoint-selective``: every block under a selective policy (``create_selective_checkpoint_contexts``): the
  results of matrix products, convolutions and fused attention kept, everything else recomputed.

A :class:`Method` wraps one workload for one run: ``with method.forward():`` around the forward pass
(backward runs outside, as autocast wants), then ``method.after_step()`` after the optimizer step
(gactx's ``iterate``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

import gactx

__all__ = ["CHECKPOINT_FORMS", "METHODS", "GACTX_LEVELS", "COMPILABLE", "Method", "method_names", "sub_batch"]

GACTX_LEVELS = ("L1", "L1.2", "L2", "L2.2", "L3")
CHECKPOINT_FORMS = ("checkpoint", "checkpoint-fast", "checkpoint-selective")
METHODS = ("fp", *GACTX_LEVELS, *CHECKPOINT_FORMS, "save_on_cpu")
# The ops whose results checkpoint-selective keeps: the costly ones to recompute.
_KEPT_OPS = tuple(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name)
)  # fmt: skip
COMPILABLE = ("fp", "L1", "L1.2", "L2", "L2.2")  # methods the models benchmark also runs compiled
PROBE_SAMPLES = 8  # the estimator's closure runs on this many samples of the batch


def method_names() -> tuple[str, ...]:
    """Every name :class:`Method` takes: METHODS, and checkpointing with each gactx level but L3."""
    return (*METHODS, *(f"checkpoint+{level}" for level in GACTX_LEVELS if level != "L3"))


def _checkpoint_options(form: str, model: torch.nn.Module) -> dict:
    """``torch.utils.checkpoint``'s arguments for a form of checkpointing (the module docstring) of ``model``."""
    if form == "checkpoint-fast":
        random = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
        return dict(use_reentrant=False, preserve_rng_state=random, determinism_check="none")
    if form == "checkpoint-selective":
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE

        return dict(use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    return dict(use_reentrant=False)


class Method:
    def __init__(
        self, name: str, workload, precision: str = "fp32", compiled: bool = False, compile_backend: str = "inductor"
    ) -> None:
        """``compiled``: the model's forward under ``torch.compile`` for the run, with ``compile_backend``."""
        if name not in method_names():
            raise ValueError(f"method {name!r} is not one of {method_names()}")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {precision!r} is not one of ('fp32', 'bf16')")
        if compiled and name not in COMPILABLE:
            raise ValueError(f"method {name!r} is not run compiled; those that are: {COMPILABLE}")
        self.name, self.workload, self.precision, self.compiled = name, workload, precision, compiled
        self.device_type = next(workload.model.parameters()).device.type
        self.controller = None
        level = name.removeprefix("checkpoint+")
        if level in GACTX_LEVELS:  # installed for the whole run: installing hooks every module, once
            self.controller = gactx.Controller(workload.model, level=level).install_hook()
        self.checkpointed = name.startswith("checkpoint")
        self._wrapped: list = []  # (block, the forward in its __dict__ before, if any) while checkpointed by block
        self._checkpoint_on = False
        self._checkpoint(True)
        self._compiled_model = None
        if compiled:
            torch._dynamo.reset()
            model = workload.model
            model.forward = torch.compile(model.forward, backend=compile_backend)
            self._compiled_model = model

    @property
    def label(self) -> str:
        return self.name + ("" if self.precision == "fp32" else "+bf16") + ("+compile" if self.compiled else "")

    def _checkpoint(self, on: bool) -> None:
        """Checkpointing on or off, in the method's form (the module docstring): ``checkpoint`` the model's own where
        it has it (Hugging Face's), else every block under non-reentrant ``torch.utils.checkpoint``: its activations
        are recomputed in backward."""
        if not self.checkpointed or on == self._checkpoint_on:
            return
        self._checkpoint_on = on
        form = self.name.partition("+")[0]  # checkpoint+L1: the plain form, with a gactx level
        own = getattr(self.workload, "checkpointing", None) if form == "checkpoint" else None
        if own is not None:
            own(on)
        elif on:
            options = _checkpoint_options(form, self.workload.model)
            for block in self.workload.blocks:
                original = block.forward

                def forward(*args, _original=original, **kwargs):
                    return checkpoint(_original, *args, **options, **kwargs)

                self._wrapped.append((block, vars(block).get("forward")))
                block.forward = functools.wraps(original)(forward)
        else:
            for block, own_forward in self._wrapped:
                if own_forward is None:
                    del block.forward
                else:
                    block.forward = own_forward
            self._wrapped.clear()

    def close(self) -> None:
        self.suspend()
        self.checkpointed = False
        if self._compiled_model is not None:
            self._compiled_model.__dict__.pop("forward", None)
            self._compiled_model = None

    def suspend(self) -> None:
        """Take the method off the model (gactx's hooks, checkpointing) until :meth:`active` (another method's run
        in between)."""
        if self.controller is not None and self.controller.installed:
            self.controller.uninstall_hook()
        self._checkpoint(False)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The method on for the block (after :meth:`suspend`), off again after it."""
        installed = self.controller is not None and not self.controller.installed
        if installed:
            self.controller.install_hook()
        self._checkpoint(True)
        try:
            yield
        finally:
            if installed:
                self.controller.uninstall_hook()
            self._checkpoint(False)

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
        self.controller.iterate(self.backprop(inputs, target))

    def backprop(self, inputs: tuple, target: torch.Tensor) -> Callable[[], None]:
        """The closure the estimator runs: forward (as this method runs one) and backward on a sub-batch of the
        batch."""
        probe_inputs, probe_target = sub_batch(self.workload, inputs, target)

        def backprop() -> None:
            with self.forward():
                loss = self.workload.loss(self.workload.model, probe_inputs, probe_target)
            loss.backward()

        return backprop


def sub_batch(workload, inputs: tuple, target: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """The workload's probe batch where it names one, else the first few samples of a batch (a graph is trained
    whole: GNNs get the whole batch)."""
    if getattr(workload, "sub_batch", None) is not None:
        return workload.sub_batch(inputs, target)
    if workload.family == "gnn":
        return inputs, target
    return tuple(t[:PROBE_SAMPLES] if torch.is_tensor(t) else t for t in inputs), target[:PROBE_SAMPLES]
