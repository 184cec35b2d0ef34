"""GACT's estimator (:class:`GactEstimator`): each allocated tensor perturbed in turn, one pass of the closure each
(``sensitivity.py``, ``groups.py``, ``replayed.py``), one implementation of ``estimators.Estimator``; the constants
here turn each of its economies off for the tests and the benchmarks that measure them."""

from __future__ import annotations

import dataclasses
import logging
import warnings
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from gactx.config import Config, _caller_level
from gactx.controller.adaptation import replayed
from gactx.controller.adaptation import sensitivity as gact
from gactx.controller.adaptation.budget import default_width
from gactx.controller.adaptation.choices import (
    CALIBRATION_PAIR,
    CALIBRATION_PAIRS,
    CALIBRATION_SKETCH,
    Choice,
    calibration,
    predicted_sketch_variance,
)
from gactx.controller.adaptation.free_sensitivity import FreeCollector, free_estimate
from gactx.controller.adaptation.groups import Profiles, Weights
from gactx.controller.adaptation.measuring import Measuring, Progress
from gactx.controller.adaptation.ranks import distributed
from gactx.controller.adaptation.sensitivity import Estimate, Probe, estimate_sensitivities
from gactx.controller.adaptation.trained import context, noise, stored_form
from gactx.controller.identity import ModuleTracker, Slot
from gactx.controller.plan import mix
from gactx.controller.stats import KeyRecord, PassStats

if TYPE_CHECKING:
    from gactx.controller.pack import PackPath

__all__ = [
    "FREE_FIRST", "KEEP_CALIBRATION", "KEEP_CURVES", "RECHECK", "RECHECK_MARGIN", "REPLAY_FIRST", "UNEXPLAINED",
    "GactEstimator",
]  # fmt: skip

# True: the first adaptation's first estimate (which only places the second around an allocation, GactEstimator) is
# ActNN's, read in one pass of the closure, instead of GACT's, a pass or two a tensor. Off: on the 15 models of
# benchmarks.schemes it cut the first adaptation's passes by 22% to 45% at the same gradient error (within 5%), but
# on an MLP of tanh layers whose inputs differ by 100x between samples, with per-sample widths offered, the second
# estimate, measured around the first's allocation, gave a tanh input 1 bit and the gradient error rose from 0.74 to
# 11 times the gradient's squared norm (docs/adaptive.md).
FREE_FIRST = False
# An adaptation after the first probes a normalisation input at the probe width alone (a pair) and keeps the shape of
# the curve it last fitted through two widths (GactEstimator); False: two pairs each time.
KEEP_CURVES = True
# A sketchable tensor's calibration (how much more gradient variance a sketch adds than predicted, choices.calibration)
# is measured once, in the first estimate, and kept as a ratio to the prediction, which later estimates make afresh
# (GactEstimator); False: three pairs of passes each estimate.
KEEP_CALIBRATION = True
# An estimate against the exact base (sensitivity.EXACT_BASE) whose first pass, every tensor as training stores it, is
# further from the base than this many times what the estimate predicts for it (Estimate.unexplained: the tensors'
# noises interact, which passes that keep the others exact cannot see) is followed by estimates with the other tensors
# at their widths, around the allocation it made (GactEstimator). 13 of the 15 models of benchmarks.schemes read 0.24
# to 1.07, ViT-B/16 35 (where the exact estimate's allocation had a lower gradient error than the other's), the zoo
# transformer layer 8e5 (its gradient error 3.3 times the other's with uniform codes only).
UNEXPLAINED = 100.0
# An estimate against the exact base whose backward is replayed runs no first pass of the closure: it takes the
# allocated saves from the training pass, measures their stored errors (the meter) in the forward its probes replay,
# and replays that forward's backward with each one probed at the width training stored it at for its first pass
# (GactEstimator._discover). Where that forward's allocated saves are not the training pass's (a smaller sub-batch's
# tensor under min_numel), the estimate starts again with the first pass run. A closure's forward and backward fewer an
# estimate (ResNet-50 small: its 36 ms for the meter's 6 ms in the replayed forward and an 11 ms replay); False: the
# first pass runs the closure.
REPLAY_FIRST = True
# An estimate after the first whose first pass would be a replay (REPLAY_FIRST) leaves it out, and with it the check of
# UNEXPLAINED, where the last check read below UNEXPLAINED / RECHECK_MARGIN, for at most RECHECK - 1 estimates in a row
# (GactEstimator._checks): the pass measures no sensitivity, only whether the noises interact, which a model whose last
# reading was far below the threshold is then found doing at most RECHECK - 1 adaptations late. 13 of the 15 models of
# benchmarks.schemes read 0.24 to 1.07; ResNet-50 small's later adaptation saves the replay's 11 ms of about 200 three
# times in four. 1: every estimate checks.
RECHECK = 4
RECHECK_MARGIN = 10.0
logger = logging.getLogger(__name__)


class GactEstimator(Measuring):
    """GACT's estimator: each allocated tensor perturbed in turn at the probe width, one pass of the closure each with
    every other tensor stored as it is, against a base pass that stores them all so (``sensitivity.EXACT_BASE``); the
    squared distance between the two gradients is its sensitivity (``sensitivity.py``); the inputs of linear and
    convolution layers, whose noise reaches only their own weights' gradients, all in the same pass, and tensors whose
    noise an earlier measurement saw land in parameters few others' reach, several in the same passes (``groups.py``:
    it keeps where each tensor's noise landed, ``_profiles``). An estimate does not depend on how the other tensors
    are stored, so the first adaptation estimates once, fitting the normalisation inputs' curves.

    With ``EXACT_BASE`` off the other tensors keep their widths in every pass, two passes a tensor (one against the
    base where its stored noise is known: ``_context``, from ``trained.context``), and the first adaptation measures
    twice: a tensor's effect on the gradient then depends on how the others are stored (a normalisation's input on a
    BERT layer: 10 times larger with the others at the default width than at the widths then allocated), so the second
    round measures around the allocation the first found, as every later adaptation does; the first round probes no
    curve (``_straight``)."""

    def __init__(self, config: Config, model: nn.Module, path: PackPath, tracker: ModuleTracker) -> None:
        super().__init__(config, model, path, tracker)
        self.pending = False
        self._warned = False
        self._context: dict[Slot, float | None] = {}  # what each slot stores when nothing is probed (trained.context)
        self._stored: dict[Slot, tuple | None] = {}  # its form then, where a probe stores it so (trained.stored_form)
        self._curves: dict[Slot, tuple[float, float]] = {}  # the curves last fitted (KEEP_CURVES)
        self._calibrations: dict[Slot, float] = {}  # the sketch calibrations last measured (KEEP_CALIBRATION)
        self._read: dict | None = None  # what the meter measured in the estimate's first pass (_discover)
        self._profiles: Profiles | None = None  # where each tensor's noise landed in the gradient (groups.py)
        self._noise: dict[Slot, float] = {}  # each slot's noise in the first pass, in units of S (_discover)
        self._paired = False  # an exact estimate left most of the gradient's error unexplained (UNEXPLAINED)
        # Where this estimate's first pass is a replay (REPLAY_FIRST): the training pass's allocated saves, by slot
        self._trained_records: dict[Slot, KeyRecord] | None = None
        self._reading = False  # ... and the forward the probes replay is still to run (_defer)
        self._changed = False  # ... and it made other allocated saves than the training pass
        self._no_replay = False  # an estimate started again with its first pass run (_SlotsChanged)
        self._last_check: float | None = None  # the last Estimate.unexplained read (RECHECK)
        self._unchecked = 0  # estimates since that one, each of which left its first pass out
        self._weights = None  # the parameters' weights of the last estimate against the exact base (groups.Weights)

    def rounds(self, allocated: bool) -> int:
        return 1 if allocated or (gact.EXACT_BASE and not self._paired) else 2

    def forward_begins(self, due: bool) -> None:
        return None

    def ready(self, backprop: Callable[[], object] | None) -> bool:
        if backprop is None and not self._warned:
            cfg = self.config
            warnings.warn(
                f"gactx level {cfg.level} adapts bits only when iterate() gets a backprop closure; "
                f"every tensor stays at {default_width(cfg.bits)} bits (docs/adaptive.md#the-closure)",
                RuntimeWarning,
                stacklevel=_caller_level(),
            )
            self._warned = True
        return backprop is not None

    def estimate(self, backprop: Callable[[], object] | None, step: int, progress: Progress) -> Estimate:
        if backprop is None:
            raise TypeError("adapt() with estimator='gact' needs a backprop closure")
        if FREE_FIRST and not self.path.plan.allocation:
            return self._free(backprop)
        seed = self.config.seed
        exact = self._exact

        def seed_of(slot: Slot, k: int) -> int:
            return mix(seed, step, zlib.crc32(repr(slot).encode()), k)

        modules = dict(self.model.named_modules())
        kept = self._curves if KEEP_CURVES else {}
        curved = self.path.sites.curved

        def fitted(slot: Slot) -> bool:  # a curve to fit now: two widths
            return curved(slot) and slot not in kept

        def run() -> Estimate:
            return estimate_sensitivities(
                self.model, backprop, self._discover, self._set_probe, self.config.probe_bits, seed_of, progress,
                self._probed_choices, fitted if self.path.plan.allocation or exact else _straight,
                lambda slot: self._weights_of(slot, modules),
                # filled by the first pass (_discover), so read at each call; a curved tensor's is not what it stores
                # scaled by S(b) (probed in the form it is stored in instead, read on its kept curve)
                lambda slot: None if slot in kept else self._context.get(slot),
                lambda slot: self._stored.get(slot),  # filled by the first pass too
                kept.get,  # a kept curve's shape: the tensor is probed where it is stored, read on the curve
                self._profiles, exact, lambda slot: self._noise[slot],  # filled by the first pass too
                self._defer, self.allocated_variance if self.path.plan.allocation else None,
                lambda: self._trained(seed_of), weighing,
            )  # fmt: skip

        # Each parameter's weight in the squared distances (Config.objective "update"): from the base pass of an
        # estimate against the exact base, kept for the estimates with the others at their widths (a noisy base).
        weighing = Weights(self.config.objective == "update", None if exact else self._weights)

        try:
            estimate = run()
        except _SlotsChanged:  # the replayed first pass's forward saved other tensors: the first pass run instead
            logger.info("gactx adaptation at step %d: the closure saves other tensors than training; its first "
                        "pass runs", step)  # fmt: skip
            self._no_replay = True
            try:
                estimate = run()
            finally:
                self._no_replay = False
        self._profiles = estimate.profiles
        if exact and weighing.vector is not None:
            self._weights = weighing.vector
        if estimate.unexplained is not None:
            self._last_check, self._unchecked = estimate.unexplained, 0
        elif self._trained_records is not None:  # its replayed first pass left out (_checks)
            self._unchecked += 1
        switch = exact and estimate.unexplained is not None and estimate.unexplained > UNEXPLAINED
        if switch:
            logger.info(
                "gactx adaptation at step %d: the tensors' noises interact (the training widths' gradient error %.3g "
                "times what an estimate of each tensor alone predicts); measuring with the others at their widths",
                step, estimate.unexplained,
            )  # fmt: skip
            self._paired = True  # from here on, and a second estimate of a first adaptation (rounds)
            self._profiles = None  # what the others at their widths put where: measured afresh
        if self.path.plan.allocation or exact:
            # A kept curve's shape with the sensitivity measured now at the probe width: the curve's value there.
            reused = {s: c for s, c in kept.items() if s in estimate.sensitivity}
            self._curves = {**reused, **estimate.curves}
            estimate = dataclasses.replace(estimate, curves=self._curves)
        if switch:
            self._curves = {}  # fitted again with the others at their widths
        return self._calibrated(self._measured(estimate))

    def _measured(self, estimate: Estimate) -> Estimate:
        """``estimate`` with what the meter measured in its first pass, read there (_discover), or read now."""
        read, self._read = self._read, None
        return super()._measured(estimate) if read is None else dataclasses.replace(estimate, measured=read)

    def _calibrated(self, estimate: Estimate) -> Estimate:
        """``estimate`` with each sketch calibration it measured kept (:data:`KEEP_CALIBRATION`), and one kept for each
        sketchable tensor it did not measure: the variance that ratio gives the prediction made now (what
        ``choices.calibration`` reads back as the ratio)."""
        if not KEEP_CALIBRATION or self.meter is None:
            return estimate
        bits, probed = self.config.probe_bits, dict(estimate.probed)
        for slot, c in estimate.sensitivity.items():
            measured = estimate.measured.get(slot, {})
            if CALIBRATION_SKETCH in probed.get(slot, {}):
                self._calibrations[slot] = calibration(measured, probed[slot], c, bits)
            elif slot in self._calibrations:
                predicted = predicted_sketch_variance(measured, c, bits)
                if predicted > 0:
                    probed[slot] = {**probed.get(slot, {}), CALIBRATION_SKETCH: self._calibrations[slot] * predicted}
        return dataclasses.replace(estimate, probed=probed)

    def _free(self, backprop: Callable[[], object]) -> Estimate:
        """ActNN's estimate from one pass of the closure, the meter measuring it (:data:`FREE_FIRST`): where the first
        adaptation's second estimate is to measure, for a pass or two a tensor instead of the first's."""
        if self.meter is not None:
            self.meter.clear()
            self.meter.armed = True
        collector = FreeCollector(
            self.model, self.tracker, self.path.observers, self.config.group_size, watching=lambda: self.path.watching
        )
        try:
            estimate = free_estimate(self.model, collector, backprop)
        finally:
            if self.meter is not None:
                self.meter.armed = False
        sensitivity = estimate.sensitivity
        top = max(sensitivity.values(), default=0.0)
        curved = self.path.sites.curved
        linear = {r.key.slot for r in self.path.stats.records if r.cls == "linear"}
        sensitivity = {s: c if s in linear and not curved(s) else top for s, c in sensitivity.items()}
        return self._measured(dataclasses.replace(estimate, sensitivity=sensitivity))

    def _weights_of(self, slot: Slot, modules: dict[str, nn.Module]) -> tuple:
        """The weights whose gradients alone a slot's noise reaches: where the save is the activation operand of
        products or convolutions with weights (``rules.weight_only``: backward reads it only for their gradients) and
        each such save (the slot's, and those that share what it stores) is made in a module that owns one matrix
        weight, those weights; else ``()``, and the slot is probed on its own. ``modules``: the model's, by name."""
        path = self.path
        if not path.sites.weight_only(slot):
            return ()
        weights = []
        for name in (slot[0], *(s[0] for s in path.sites.sharers.get(slot, {}))):
            module = modules.get(name)
            owned = [] if module is None else [p for p in module.parameters(recurse=False) if p.dim() >= 2]
            if len(owned) != 1 or not owned[0].requires_grad:
                return ()
            weights.append(owned[0])
        return tuple(weights)

    def _discover(self, run: Callable[[], object]) -> list[Slot]:
        """Run the estimator's first pass on fresh statistics (the meter measuring it); the slots it allocated. Where
        it may be a replay (:data:`REPLAY_FIRST`, :meth:`_replayable`), ``run`` is not called: the slots are the
        training pass's allocated ones, the meter measures the forward the probes replay (:meth:`_defer`), and the
        estimate replays the first pass with the probes of :meth:`_trained`."""
        path = self.path
        trained = {r.key.slot: r for r in path.stats.records if r.allocated}
        self._trained_records = trained if trained and self._replayable() else None
        self._reading = self._trained_records is not None
        path.stats, path.fresh = PassStats(), False
        if self._trained_records is not None:
            self._noise = {s: noise(r) for s, r in trained.items()}
            self.discovered = None  # no pass of its own: the controller reads the forward the probes replay
            return list(trained)
        if self.meter is not None:
            self.meter.clear()  # nothing left from an earlier pass
            self.meter.armed = True
        try:
            run()
        finally:
            if self.meter is not None:
                self.meter.armed = False
        self.discovered = path.stats  # every save recorded as training stores it (a probe pass keeps some exact)
        # What the meter measured in this pass (one host read, outside any hook): the estimate's (_measured), and what
        # prices a save under the normal scheme as the base pass's context (_context).
        self._read = self.meter.read() if self.meter is not None else {}
        records = [r for r in path.stats.records if r.allocated]
        choices, bits = path.plan.choices, self.config.probe_bits
        self._stored = {r.key.slot: stored_form(r, choices.get(r.key.slot), self._read, bits) for r in records}
        self._context = {r.key.slot: context(r, self._stored[r.key.slot]) for r in records}
        self._noise = {r.key.slot: noise(r) for r in records}
        return [r.key.slot for r in records]

    def _replayable(self) -> bool:
        """Whether this estimate's first pass may be a replay (:data:`REPLAY_FIRST`): an estimate against the exact base
        whose backward is replayed (``replayed.REPLAY``, one process) after a training pass of eager saves, not one
        started again (:class:`_SlotsChanged`)."""
        return (
            REPLAY_FIRST and not self._no_replay and self._exact and replayed.REPLAY and not distributed()
            and not self.path.stats.graph_runs
        )  # fmt: skip

    def _trained(self, seed_of: Callable[[Slot, int], int]) -> dict[Slot, Probe] | None:
        """Where this estimate's first pass is a replay, its probes: each slot at the width training stored it at
        (uniform codes, or the other scheme the plan gives it; none where it was stored as it is), with a seed of its
        own; else ``None``. Raises :class:`_SlotsChanged` where the forward the probes replay made other allocated
        saves than the training pass."""
        if self._trained_records is None:
            return None
        if self._changed:
            raise _SlotsChanged
        if not self._checks():
            return None
        choices = self.path.plan.choices
        return {
            s: Probe(s, r.bits, seed_of(s, 0), choices.get(s)) for s, r in self._trained_records.items() if noise(r)
        }

    def _checks(self) -> bool:
        """Whether this estimate replays its first pass, which only :data:`UNEXPLAINED`'s check reads: the first
        adaptation's always; a later one's unless the last check read below ``UNEXPLAINED / RECHECK_MARGIN`` and fewer
        than ``RECHECK - 1`` estimates since it left theirs out (:data:`RECHECK`)."""
        last = self._last_check
        return (
            not self.path.plan.allocation or last is None or last * RECHECK_MARGIN >= UNEXPLAINED
            or self._unchecked + 1 >= RECHECK
        )  # fmt: skip

    def _set_probe(self, probe: Probe | None) -> None:
        self.path.plan = self.path.plan.probing(probe, exact=self._exact)

    @property
    def _exact(self) -> bool:
        """Whether an estimate keeps what it does not probe exact: :data:`sensitivity.EXACT_BASE`, until an estimate
        found the tensors' noises interacting (:data:`UNEXPLAINED`)."""
        return gact.EXACT_BASE and not self._paired

    def _defer(self, on: bool, watch: Callable[[Slot, bool], None] | None = None) -> None:
        path = self.path
        path.plan = path.plan.probing(path.plan.probe, exact=True, deferred=on)
        path.unpacked = watch if on else None
        if not self._reading:
            return
        # The first pass a replay (_discover): the meter measures this forward, whose allocated saves are told
        if on:
            path.deferred, self._changed = set(), False
            if self.meter is not None:
                self.meter.clear()
                self.meter.armed = True
            return
        self._changed, path.deferred, self._reading = path.deferred != self._trained_records.keys(), None, False
        if self.meter is not None:
            self.meter.armed = False
            self._read = self.meter.read()

    def _probed_choices(self, slot: Slot) -> tuple[tuple[Choice, Choice], ...]:
        """Choices whose effect on the gradient is measured for ``slot``: a sketch of half the rows, where a sketch may
        be chosen (its error lands on the rows whose gradient is large or small alike only if the gradient's rows are
        alike; the measurement says by how much they are not, see choices.py)."""
        if self.meter is not None and "sketch" in self.config.schemes and self.path.sites.sketchable(slot):
            if KEEP_CALIBRATION and slot in self._calibrations:
                return ()  # measured before: the kept ratio (_calibrated)
            return (CALIBRATION_PAIR,) * CALIBRATION_PAIRS
        return ()


def _straight(slot: Slot) -> bool:
    """``curved`` of the first adaptation's first estimate: no tensor is probed for a curve. That estimate only
    places the second around an allocation (``rounds``), which fits the normalisation inputs' curves; with them in
    both, the first adaptation takes more passes for the same sensitivities and allocation
    (``python -m benchmarks.adaptation``)."""
    return False


class _SlotsChanged(Exception):
    """The forward a replayed first pass's probes replay made other allocated saves than the training pass."""
