"""How an allocated tensor may be stored, and what each way costs it in variance, measured on its own values.

A :class:`Choice` is a width and a scheme, one of the storage schemes registered in ``gactx/kernels/schemes`` (each
one module there: what it stores, its bytes, its measured error). The built-in ones:

=================  ==============================================================  =========================
scheme             stored                                                          for
=================  ==============================================================  =========================
``uniform``        codes on the group's min-max grid (``gactx/kernels/format.py``)  every allocated tensor
``normal``         codes on levels fitted to the group's normal (``normal.py``)     linear and attention saves
``sketch``         a ``fraction`` of the rows, each kept row at ``bits``            inputs of linear layers
                   (``schemes/sketch.py``): FewBit's randomized linear
``samples``        the ``fraction`` of samples of widest range at ``high`` bits,    tensors whose samples are
                   the others at ``bits`` (``schemes/samples.py``): ActNN's    whole groups
                   per-sample widths
=================  ==============================================================  =========================

The allocator's model is GACT's: storing tensor ``l`` adds gradient variance ``C_l * S(b)``, ``S(b) = 1 / (2**b -
1)**2``, with ``C_l`` measured at the probe width. That ``S(b)`` is the rounding error of a uniform grid over a
group's range; another scheme, or a bell-shaped group, or a sketch that drops rows, errs differently. So the
error itself is measured: while an estimator's pass runs, :class:`ChoiceMeter` computes for each allocated tensor
the expected squared error ``V_l(o)`` of storing its values under each choice ``o`` (exact, from the values and
the levels they would fall between, with device reductions only), and a choice's variance is::

    C_l * S(probe) * V_l(o) / V_l(uniform at the probe width)

The gradient of a linear op is linear in the saved tensor, so its variance follows the stored error as long as the
error is spread over the rows alike. Codes spread it so; a row sketch does not: it drops whole rows, and where the
gradient reaching some rows is much larger than the rest (a classifier that reads one token of a sequence) its
error weighs more than its squared size says. So GACT's estimator also measures it: two more passes per tensor a
sketch may store, half the rows kept and then the other half, give the gradient variance the sketch really adds (see
:data:`CALIBRATION_PAIR`), and the ratio of that
to the prediction (:func:`calibration`) scales the sampling part of every sketch of that tensor. ActNN's free
estimator runs no such passes: its sketches stay predicted. ``benchmarks/schemes.py`` measures how far the
predictions hold on real models' gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

import torch

from gactx.controller.adaptation.widths import variance_factor
from gactx.kernels.format import expected_nbytes, memory_order
from gactx.kernels.schemes import CODE_WIDTHS, Choice, Measured, scheme
from gactx.kernels.schemes.sketch import SKETCH_FRACTIONS

__all__ = [
    "CODE_WIDTHS",
    "Choice",
    "SKETCH_FRACTIONS",
    "CALIBRATION_SKETCH",
    "CALIBRATION_PAIR",
    "CALIBRATION_PAIRS",
    "ChoiceMeter",
    "calibration",
    "choice_options",
    "predicted_sketch_variance",
]

# What GACT's estimator probes where a sketch may be chosen: half the rows, kept as they are (the sampling alone), and
# then the other half with the same seed. The two average to the tensor, so a quarter of their gradients' squared
# distance is the sketch's gradient variance, even where one row carries the whole gradient (two random draws would
# keep or drop it together half the time and measure nothing).
CALIBRATION_SKETCH = Choice(32, "sketch", 0.5)
CALIBRATION_PAIR = (CALIBRATION_SKETCH, Choice(32, "sketch", 0.5, complement=True))
# Pairs of passes a sketchable tensor's calibration averages, each with its own seed: one pair's measure is off by
# 30-40% (a few rows carry most of the gradient), and the allocator picks the sketches that one measured low.
CALIBRATION_PAIRS = 3


class ChoiceMeter:
    """Measures ``V_l(o)`` for each allocated tensor while :attr:`armed` (an observer of ``PackPath``).

    ``sketchable(slot)`` says whether the slot's save is the input of a linear layer; ``also_armed()`` arms it too
    (the free estimator's collecting step). Inside the hook only device work runs; :meth:`read` makes the one host
    read, after the pass."""

    def __init__(
        self,
        schemes: tuple[str, ...],
        group_size: int,
        sketchable: Callable[[Hashable], bool],
        also_armed: Callable[[], bool] = lambda: False,
    ) -> None:
        self.schemes = schemes
        self.group_size = group_size
        self.sketchable = sketchable
        self.also_armed = also_armed
        self.armed = False
        self._values: dict[Hashable, list] = {}  # slot -> each scheme's measure()

    def __call__(self, key, t: torch.Tensor, rule) -> None:
        slot = key.slot
        if not (self.armed or self.also_armed()) or rule.kind != "quantize" or slot in self._values:
            return
        if not t.is_floating_point():
            return

        x = t.detach()
        flat = memory_order(x)[0].contiguous()
        sketchable = lambda: self.sketchable(slot)  # noqa: E731
        # the storage schemes' registry (gactx/kernels/schemes); read as one piece each by read()
        self._values[slot] = [scheme(name).measure(x, flat, self.group_size, sketchable) for name in self.schemes]

    def clear(self) -> None:
        """Forget what was measured (no host read): a new measured pass begins."""
        self._values = {}

    def read(self) -> dict[Hashable, dict[Choice, float]]:
        """What was measured since the last read, as floats (one host read), and forget it."""
        measured, self._values = self._values, {}
        keys, parts = [], []
        for slot, results in measured.items():
            for result in results:
                if isinstance(result, Measured):
                    keys += [(slot, choice) for choice in result.choices]
                    parts.append(result.errors.reshape(-1))
                else:
                    for choice, v in result.items():
                        keys.append((slot, choice))
                        parts.append(v.reshape(1))
        if not parts:
            return {}
        one_device = len({p.device for p in parts}) == 1
        numbers = torch.cat([p.to(torch.float64) if one_device else p.to("cpu", torch.float64) for p in parts]).tolist()
        out: dict[Hashable, dict[Choice, float]] = {}
        for (slot, choice), value in zip(keys, numbers, strict=True):
            out.setdefault(slot, {})[choice] = value
        return out


def predicted_sketch_variance(measured: dict[Choice, float], sensitivity: float, probe_bits: int) -> float:
    """The gradient variance :data:`CALIBRATION_SKETCH` is predicted to add: ``C * S(probe) * V(sketch) / V(probe)``
    (0 where the meter measured no reference)."""
    reference, sampled = measured.get(Choice(probe_bits), 0.0), measured.get(CALIBRATION_SKETCH, 0.0)
    return sensitivity * variance_factor(probe_bits) * sampled / reference if reference > 0 else 0.0


def calibration(measured: dict[Choice, float], probed: dict | None, sensitivity: float, probe_bits: int) -> float:
    """How much more gradient variance a sketch of this tensor adds than predicted: the measured variance of
    :data:`CALIBRATION_SKETCH` over :func:`predicted_sketch_variance`; 1 where nothing was measured."""
    got = (probed or {}).get(CALIBRATION_SKETCH)
    predicted = predicted_sketch_variance(measured, sensitivity, probe_bits)
    if got is None or not predicted > 0 or not math.isfinite(got):
        return 1.0
    return min(max(got / predicted, 1e-3), 1e3)  # a blown-up pass must not make a sketch free or forbidden


def choice_options(
    measured: dict[Choice, float],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    group_size: int,
    probe_bits: int,
    min_bits: int = 1,
    as_is_bytes: int | None = None,
    sketch_scale: float = 1.0,
    response: tuple[float, float] = (1.0, 0.0),
) -> tuple[tuple[Choice, int, float], ...]:
    """The allocator's options of one measured tensor: ``(choice, bytes, variance per unit of sensitivity)``, for
    every measured choice of at least ``min_bits`` (the class's narrowest width), the 16- and 32-bit widths, and
    each measured sketch with its kept rows at every width (``sketch_scale``: :func:`calibration`). ``response``:
    ``(a, q)``, the variance per unit of sensitivity is ``a x + q x**2`` at the choice's ``x = S(probe) V(choice) /
    V(probe)`` (``curves.fit_curve``; linear, ``(1, 0)``, but for a normalisation's input)."""
    numel = torch.Size(shape).numel()
    reference = measured.get(Choice(probe_bits), 0.0)
    scale = variance_factor(probe_bits) / reference if reference > 0 else math.inf

    a, q = response

    def factor(v: float) -> float:
        if v <= 0:
            return 0.0
        if not math.isfinite(scale):
            return 1e30  # a tensor the probe width stores exactly
        x = scale * v
        return a * x + q * x * x

    # Each measured choice as the options it stands for (a sketch: its kept rows at every code width), those of
    # schemes derived from others' measurements last.
    offered = {}
    for derived in (False, True):
        for choice, v in measured.items():
            s = scheme(choice.scheme)
            if s.derived == derived:
                offered |= s.options(choice, v, measured, sketch_scale)
    options = []
    for choice, v in offered.items():
        if choice.bits >= min_bits:
            options.append((choice, scheme(choice.scheme).nbytes(shape, dtype, choice, group_size), factor(v)))
    eight = measured.get(Choice(8), 0.0)
    if dtype == torch.float32:  # bfloat16 storage: see allocator.variance_factor
        options.append((Choice(16), expected_nbytes(numel, dtype, 16, group_size), factor(eight / 16)))
    as_is = max(expected_nbytes(numel, dtype, 32, group_size), as_is_bytes or 0)
    if dtype == torch.float32:
        options.append((Choice(32), as_is, 0.0))
    else:
        options.append((Choice(16), as_is, 0.0))  # 16 bits of a 16-bit tensor: itself
    return tuple(options)
