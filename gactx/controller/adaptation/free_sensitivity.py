"""ActNN's sensitivity estimate, free: read during an ordinary training step, no extra passes.

A saved tensor ``x`` that an op uses linearly (``y = x W^T``, a convolution, one side of a matmul) turns
quantization noise ``e`` into noise ``g^T e`` of the weight gradient, ``g`` the gradient reaching the op's
output. Stochastic rounding of a group of range ``R`` at ``b`` bits leaves ``Var(e) = R^2 S(b) / 6`` an
element (a uniform position between two grid points: ``E[p (1 - p)] = 1/6`` of a step squared,
``S(b) = 1/(2^b - 1)^2``). Summing ``g_i^2 Var(e_j)`` over every product the weight gradient forms::

    C = ||g||^2 * sum_groups(n_group * R_group^2 / 6) * fan_in / numel(x)

``fan_in`` is how many elements of ``x`` one output element reads (``in_features``; ``C_in/groups * k^2``
for a convolution; 1 for a leaf module without a weight, an element-wise activation; the last dimension
elsewhere), so that ``fan_in / numel(x)`` is ``1 / rows`` for a linear
layer. ``C`` is in GACT's units (added gradient variance per unit of ``S(b)``): the allocator takes either.
Where ``x`` and ``g`` have the same rows (``x`` is ``rows x fan_in``), each row of ``x`` is paired with the row
of ``g`` it produces, ActNN's per-sample form ``sum_n ||g_n||^2 sum_j Var(e_nj)`` (``per_row``; exact for a
linear layer's input); elsewhere one product per tensor. The input of a normalization layer is read by its
consumer as ``(x - mean) / std``: its term is scaled by the mean of ``1 / var`` (``normalized``).

That formula is linear in the noise; a normalization input is not (:func:`gactx.controller.rules.curved`). Its
noise reaches the normalized values as ``e / std``, and where that is larger than the values themselves (unit
variance) the input gradient it gives is mostly noise, which the layers below carry and the next normalization
input at few bits multiplies again: one LayerNorm input of a small ViT at 1 bit took its gradient error to 800
times the gradient, all of them to 1e16. GACT's estimator measures that; this one cannot, so it also reports
each LayerNorm input's ratio ``rho = mean(R^2 / 6) * mean(1 / var)`` (the normalized noise at ``S(b) = 1``
over the normalized values' variance), and the allocator gives it no width where ``rho * S(b) > 1``
(:data:`gactx.controller.adaptation.NOISE_CEILING`). Not BatchNorm's: even normal values have ``rho`` about 5
(the range of 256 draws is about 6 standard deviations), so the floor would take every BatchNorm input of a CNN
to 2 bits, more than an average of 2 bits leaves (ResNet-50 at L2.2: an infeasible budget, and a gradient error
60 times GACT's with uniform codes, against 7 times without the floor).

What is read, and when: in the step before an adaptation is due (and in the first), each allocated tensor's
group ranges as it is stored (a ``PackPath`` observer), and the squared norm of the gradient reaching the
output of the module call that saved it (a tensor hook registered in that call's forward post-hook). Both
are device reductions; the products are accumulated as device tensors and read once, after the step, by
:meth:`FreeCollector.take`. A save's consumer is taken to be its module: exact for the inputs of linear and
convolution layers; for saves a container makes itself (attention's matmuls, functional activations) the
container's output gradient stands in for the op's. A saved tensor still alive and unchanged when backward
runs (the batch the loop holds) is read from where it lives, not decoded (``store.Packed``): its term is 0,
as GACT's measurement finds.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from gactx.controller.adaptation.sensitivity import Estimate, ModelSnapshot, cap
from gactx.controller.identity import BACKWARD, OUTSIDE, Key, ModuleTracker
from gactx.controller.rules import Rule
from gactx.kernels.free import add_weighted_norms, mean_inverse_variance, row_variances

__all__ = ["FreeCollector", "free_estimate", "range_variance"]

_WEIGHTED = (nn.Linear, nn.modules.conv._ConvNd)  # modules whose saved input meets a weight (fan_in from it)


def range_variance(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """``sum_groups n_group * R_group^2 / 6`` over groups of ``group_size`` consecutive elements: the variance
    stochastic rounding adds to ``t``, per unit of ``S(b)``. A float32 device tensor of one element (no host read)."""
    return row_variances(t, group_size)


def _fan_in(module: nn.Module | None, t: torch.Tensor) -> int:
    """Elements of ``t`` that one output element of its consumer reads (see the module docstring): from the
    weight of a linear or convolution layer whose input ``t`` is; 1 for a leaf module without a weight (an
    activation: element-wise); else the last dimension (a matmul a container makes)."""
    if isinstance(module, _WEIGHTED) and t.dim() >= 1:
        w = module.weight
        channels = t.shape[-1] if isinstance(module, nn.Linear) else (t.shape[1] if t.dim() >= 2 else -1)
        if channels == w.shape[1] * getattr(module, "groups", 1):
            return math.prod(w.shape[1:])
    if module is not None and not any(True for _ in module.children()) and getattr(module, "weight", None) is None:
        return 1
    return t.shape[-1] if t.dim() else 1


def _inverse_variance(module: nn.Module | None, t: torch.Tensor) -> torch.Tensor | None:
    """For the input of a normalization layer, the mean of ``1 / (var + eps)`` over what it normalizes: its
    consumer reads ``(x - mean) / std``, so rounding noise reaches the gradient scaled by ``1 / std``. ``None``
    for other saves."""
    if isinstance(module, nn.LayerNorm) and t.dim() >= len(module.normalized_shape):
        dims = tuple(range(t.dim() - len(module.normalized_shape), t.dim()))
    elif isinstance(module, nn.modules.batchnorm._BatchNorm) and t.dim() >= 2:
        dims = (0, *range(2, t.dim()))
    else:
        return None
    return mean_inverse_variance(t, dims, module.eps)


def _tensors(output) -> list[torch.Tensor]:
    """The tensors of a module's output that a gradient can reach (tuples, lists, dicts, nested)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []


class FreeCollector:
    """Collects the free estimate over the forward and backward passes of the steps it is armed for.

    ``arm()``, as a forward pass begins, adds its observer to ``observers`` (the pack path's) and its output
    hook to the tracker; ``take()`` reads the accumulated estimate once, removes
    every hook and returns ``(sensitivity by slot, seconds)``: seconds of host time spent in its hooks and
    in the read (on a CPU the whole of its cost; on a GPU the launches, the reductions run on the stream).
    ``watching()``: whether the pack path's pass is watched, where a save may be resolved after its module's call
    returns; in an unwatched pass a call that saved nothing gets no gradient hook.
    """

    def __init__(
        self,
        model: nn.Module,
        tracker: ModuleTracker,
        observers: list[Callable[[Key, torch.Tensor, Rule], None]],
        group_size: int,
        per_row: bool = True,
        normalized: bool = True,
        watching: Callable[[], bool] = lambda: True,
    ) -> None:
        self.model, self.tracker, self.observers, self.watching = model, tracker, observers, watching
        self.group_size, self.per_row, self.normalized = group_size, per_row, normalized
        self.armed = False
        self._modules: dict[str, nn.Module] = {}
        self._fans: dict[tuple, int] = {}  # (module, shape) -> _fan_in, while armed
        self._frames: dict[tuple[str, int], list] = {}  # (module, call) -> [(slot, range term a row, save, version)]
        self._sums: dict[tuple, torch.Tensor] = {}  # slot -> accumulated C (device)
        self._ratios: dict[tuple, torch.Tensor] = {}  # LayerNorm input's slot -> rho, the largest seen (device)
        self._seconds = 0.0

    @property
    def collected(self) -> bool:
        """Whether a backward pass has delivered anything since the last ``take()``."""
        return bool(self._sums)

    def arm(self) -> None:
        """Collect in the forward pass that begins now (and its backward)."""
        self._frames = {}  # the tensor hooks of an earlier pass hold their own frames' lists
        if not self.armed:
            self.armed = True
            self._modules, self._fans = dict(self.model.named_modules()), {}
            self.observers.append(self._observe)
            self.tracker.output_hooks.append(self._on_output)

    def disarm(self) -> None:
        if self.armed:
            self.armed = False
            self.observers.remove(self._observe)
            self.tracker.output_hooks.remove(self._on_output)
            self._frames, self._modules = {}, {}

    def take(self) -> tuple[dict, float, dict]:
        """The estimate accumulated so far, by slot, its cost in seconds, and each LayerNorm input's ``rho``
        by slot (the module docstring); one host read; disarms."""
        start = time.perf_counter()
        self.disarm()
        slots, normalized = list(self._sums), list(self._ratios)  # a slot with a ratio has a sum
        tensors = [self._sums[s] for s in slots] + [self._ratios[s] for s in normalized]
        values = torch.cat(tensors).tolist() if tensors else []  # float32 values, as Python floats exactly
        seconds = self._seconds + time.perf_counter() - start
        self._sums, self._ratios, self._seconds = {}, {}, 0.0
        ratios = dict(zip(normalized, values[len(slots) :], strict=True))
        return dict(zip(slots, values[: len(slots)], strict=True)), seconds, ratios

    # -- hooks: device work only -------------------------------------------------------------------------------

    def _observe(self, key: Key, t: torch.Tensor, rule: Rule) -> None:
        if key.module in (OUTSIDE, BACKWARD) or not t.is_floating_point() or t.numel() == 0:
            return  # no module's output gradient to pair with (functional code, recomputation in backward)
        start = time.perf_counter()
        module = self._modules.get(key.module)
        inverse = _inverse_variance(module, t) if self.normalized else None
        fan = 1 if inverse is not None else self._fans.get((key.module, t.shape))
        if fan is None:
            fan = self._fans[(key.module, t.shape)] = _fan_in(module, t)
        rows = t.numel() // max(fan, 1)
        if self.per_row and inverse is None and t.dim() >= 2 and rows * fan == t.numel():
            term = row_variances(t, self.group_size, rows)  # sum_n ||g_n||^2 v_n: no 1 / rows
        else:
            term = range_variance(t, self.group_size) * (fan / t.numel())  # one row
        slot = key.slot
        if inverse is not None:
            term = term * inverse
            if isinstance(module, nn.LayerNorm):  # rho (the module docstring): not BatchNorm's
                seen = self._ratios.get(slot)
                self._ratios[slot] = term if seen is None else torch.maximum(seen, term)
        if slot not in self._sums:
            self._sums[slot] = term.new_zeros(1)  # observed: 0 unless a gradient reaches it
        # A tensor still alive and unchanged when backward needs it is read from where it lives, not decoded
        # (store.Packed): its rounding never reaches the gradient.
        entry = (slot, term, weakref.ref(t), t._version)
        self._frames.setdefault((key.module, key.call), []).append(entry)
        self._seconds += time.perf_counter() - start

    def _on_output(self, name: str, call: int, module: nn.Module, output) -> None:
        if not torch.is_grad_enabled():
            return
        frame = self._frames.get((name, call))
        if frame is None:
            if not self.watching():
                return  # an unwatched pass observes each save as it is made: none will join this call's
            frame = self._frames[(name, call)] = []  # a watched pass's saves resolved after the call returns join it
        for out in _tensors(output):
            out.register_hook(lambda g, frame=frame: self._gradient(frame, g))

    def _gradient(self, frame: list, g: torch.Tensor) -> None:
        if not frame or g is None:
            return
        start = time.perf_counter()
        for slot, term, ref, version in frame:
            live = ref()
            if live is not None and live._version == version:
                continue
            if g.numel() % term.numel():  # rows that do not match the gradient's: one product of the whole
                term = term.sum().reshape(1)
            add_weighted_norms(self._sums[slot], g, term)
        self._seconds += time.perf_counter() - start


def free_estimate(model: nn.Module, collector: FreeCollector, backprop: Callable[[], object] | None) -> Estimate:
    """The estimate ``collector`` read in the last step (``passes=0``), or, where it read none, from one ordinary
    pass of ``backprop`` (``passes=1``; the model's RNG states, buffers and gradients restored after it)."""
    if collector.collected:
        sensitivity, seconds, ratios = collector.take()
        return Estimate(cap(sensitivity), 0, seconds, ratios=ratios)
    if backprop is None:
        raise RuntimeError(
            "gactx estimator 'actnn': no step under the controller collected sensitivities yet; run a training "
            "step first or give adapt() a backprop closure (docs/adaptive.md#estimators)"
        )
    start = time.perf_counter()
    snapshot = ModelSnapshot(model)
    try:
        for p in model.parameters():
            p.grad = None
        collector.arm()
        backprop()
        sensitivity, _, ratios = collector.take()
    finally:
        collector.disarm()
        snapshot.restore()
    return Estimate(cap(sensitivity), 1, time.perf_counter() - start, ratios=ratios)
