"""How much each saved tensor's compression perturbs the gradient: GACT's sensitivity estimator.

For every compressed tensor ``l`` (named by its slot: module, call, index) the user's ``backprop`` closure
runs twice with every tensor at its current bits and the same noise, except that ``l`` is quantized at
``probe_bits`` with two different seeds; the two parameter gradients ``g_a``, ``g_b`` differ by ``l``'s
noise alone, so::

    C_l = 1/2 * ||g_a - g_b||^2 / S(probe_bits)

That is ``1 + 2 L`` passes for ``L`` tensors (one pass finds the tensors), and two more for each storage choice
whose effect on the gradient is measured rather than predicted (a row sketch: ``choices.py``). Around them, the
estimator saves and restores the RNG states (CPU and CUDA: dropout draws the same masks in every pass, and training
continues with the stream it had), the model's buffers (BatchNorm running statistics, batch counters)
and every parameter's ``.grad``. Parameters are never written: the closure runs forward and backward only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from gactx.controller.allocator import variance_factor

__all__ = ["Probe", "Estimate", "ModelSnapshot", "estimate_sensitivities"]

# Sensitivities legitimately span orders of magnitude (first layers vs last); one that is not finite, or
# more than a million times the median, is a blown-up pass and is capped there, so that it cannot make the
# allocator starve every other tensor.
CAP_FACTOR = 1e6


@dataclass(frozen=True)
class Probe:
    """Quantize the tensor of ``slot`` at ``bits`` with ``seed`` (other tensors as usual); ``choice``: store it
    under that storage choice instead (``choices.py``), to measure what the choice itself does to the gradient."""

    slot: Hashable
    bits: int
    seed: int
    choice: object = None


@dataclass(frozen=True)
class Estimate:
    sensitivity: dict  # slot -> C
    passes: int
    seconds: float
    probed: dict = field(default_factory=dict)  # slot -> {choice: the gradient variance it adds, measured}


class ModelSnapshot:
    """RNG states, buffers and gradients of a model, to put back exactly as they were."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.buffers = [b.detach().clone() for b in model.buffers()]
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]

    def restore_rng(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore(self) -> None:
        self.restore_rng()
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), self.buffers, strict=True):
                b.copy_(saved)
        for p, g in zip(self.model.parameters(), self.grads, strict=True):
            p.grad = g


def _gradient(model: nn.Module, backprop: Callable[[], object], snapshot: ModelSnapshot) -> torch.Tensor:
    """The flat parameter gradient of one run of ``backprop`` from the snapshot's RNG state, in float64."""
    snapshot.restore_rng()
    for p in model.parameters():
        p.grad = None
    backprop()
    parts = [p.grad.detach().reshape(-1).double() for p in model.parameters() if p.grad is not None]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def estimate_sensitivities(
    model: nn.Module,
    backprop: Callable[[], object],
    discover: Callable[[Callable[[], object]], list],
    set_probe: Callable[[Probe | None], None],
    probe_bits: int,
    seed_of: Callable[[Hashable, int], int],
    progress: Callable[[int, int], None] | None = None,
    choices_of: Callable[[Hashable], tuple] | None = None,
) -> Estimate:
    """Run GACT's estimator. ``discover(run)`` runs one pass and returns the slots it compressed;
    ``set_probe`` tells the controller which tensor to perturb; ``seed_of(slot, k)`` gives probe seeds;
    ``progress(done, total)`` is told the passes run so far after each slot. ``choices_of(slot)``: pairs of storage
    choices whose stored values average to the tensor (a row sketch and its complement, one seed); the gradient
    variance of the first, a quarter of the two gradients' squared distance, is measured too, two more passes a pair
    (``Estimate.probed``)."""
    start = time.perf_counter()
    snapshot = ModelSnapshot(model)
    try:
        slots = discover(lambda: _gradient(model, backprop, snapshot))
        scale = 0.5 / variance_factor(probe_bits)
        raw, probed, passes = {}, {}, 1 + 2 * len(slots)
        for i, slot in enumerate(slots):
            if progress is not None:
                progress(1 + 2 * i, 1 + 2 * len(slots))
            grads = []
            for k in (1, 2):
                set_probe(Probe(slot, probe_bits, seed_of(slot, k)))
                grads.append(_gradient(model, backprop, snapshot))
            diff = grads[0] - grads[1]
            raw[slot] = scale * float(diff.dot(diff))  # a host read, outside any hook: once per slot
            for pair in choices_of(slot) if choices_of is not None else ():
                grads = []
                for choice in pair:
                    set_probe(Probe(slot, choice.bits, seed_of(slot, 3), choice))
                    grads.append(_gradient(model, backprop, snapshot))
                diff = grads[0] - grads[1]
                probed.setdefault(slot, {})[pair[0]] = 0.25 * float(diff.dot(diff))
                passes += 2
    finally:
        set_probe(None)
        snapshot.restore()
    return Estimate(cap(raw), passes, time.perf_counter() - start, probed)


def cap(raw: dict) -> dict:
    """Replace non-finite sensitivities, and any above ``CAP_FACTOR`` times the median, by that ceiling."""
    positive = sorted(c for c in raw.values() if math.isfinite(c) and c > 0)
    ceiling = CAP_FACTOR * positive[len(positive) // 2] if positive else 1.0
    return {s: (min(c, ceiling) if math.isfinite(c) else ceiling) for s, c in raw.items()}
