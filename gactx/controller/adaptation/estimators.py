"""The sensitivity estimators: two implementations of one protocol, which the controller drives without knowing which
one it holds.

The controller tells an estimator when a training forward begins (:meth:`Estimator.forward_begins`), asks at a step
where an adaptation is due whether it can adapt now (:meth:`Estimator.ready`), and then asks it for estimates
(:meth:`Estimator.estimate`, ``rounds`` of them). The estimator owns its state: the probe it sets in the pack path's
plan, the free collector's hooks, the storage choices' meter. It reaches the saves through the pack path
(``pack.py``: its plan, its pass statistics, the ops it learned), never through the controller.

- :class:`GactEstimator` (GACT, ``gact_estimator.py``): about ``2 + L`` extra passes of a closure, each perturbing one
  tensor or a group of tensors whose noise lands apart, all but one a replay of its backward (``sensitivity.py``,
  ``passes.py``, ``groups.py``, ``replayed.py``).
- :class:`ActnnEstimator` (ActNN): read in the ordinary training step before an adaptation, no extra pass
  (``free_sensitivity.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from torch import nn

from gactx.config import Config
from gactx.controller.adaptation import cost
from gactx.controller.adaptation.choices import ChoiceMeter
from gactx.controller.adaptation.free_sensitivity import FreeCollector, free_estimate
from gactx.controller.adaptation.gact_estimator import GactEstimator
from gactx.controller.adaptation.measuring import Measuring, Progress
from gactx.controller.adaptation.sensitivity import Estimate
from gactx.controller.identity import ModuleTracker
from gactx.controller.stats import PassStats

if TYPE_CHECKING:
    from gactx.controller.pack import PackPath

__all__ = ["ActnnEstimator", "Estimator", "GactEstimator", "ProgressLog", "make_estimator"]

PROGRESS_SECONDS = 3.0  # an adaptation that runs longer logs its progress this often
VISIBLE_SECONDS = 15.0  # ... and once past cost.SLOW_SECONDS, this often at WARNING
logger = logging.getLogger(__name__)


class ProgressLog:
    """Logs an adaptation's progress at INFO every ``PROGRESS_SECONDS`` once it has taken that long: a long one (1 +
    2 passes per compressed tensor of a deep net) says where it is. Past ``cost.SLOW_SECONDS`` a line every
    ``VISIBLE_SECONDS`` is logged at WARNING, which Python prints to stderr where no logging is set up: a training
    run that stalls for minutes says that it is adapting, and how far it is.

    A line gives the passes run and those the estimate plans so far, not a total it will keep to: a tensor's second
    curve width is left out once its first shows it negligible, tensors are measured in groups once their profiles are
    known (fewer passes), and a group or a joint pass that its measure does not bear out is measured again tensor by
    tensor (a few more). Nor is the plan a bound: it may grow, so the line does not say "at most". The last line of an
    estimate gives what it ran."""

    def __init__(self, step: int, rounds: int = 1) -> None:
        self.step, self.every, self.rounds, self.round = step, PROGRESS_SECONDS, rounds, 1
        self.start = self.last = time.perf_counter()
        self.shown: float | None = None  # when a line was last logged at WARNING

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            level = logging.INFO
            if now - self.start >= cost.SLOW_SECONDS and (self.shown is None or now - self.shown >= VISIBLE_SECONDS):
                level, self.shown = logging.WARNING, now
            estimate = f", estimate {self.round} of {self.rounds}" if self.rounds > 1 else ""
            logger.log(
                level, "gactx adaptation at step %d%s: %d %s of the closure, %d planned so far, %.1f s", self.step,
                estimate, done, "pass" if done == 1 else "passes", total, now - self.start,
            )  # fmt: skip


class Estimator(Protocol):
    """What the controller asks of a sensitivity estimator (the module docstring)."""

    meter: ChoiceMeter | None  # measures each allocated tensor's stored error under each scheme, where several
    pending: bool  # an adaptation that was due waits for a later step (ActNN's: one that collects)
    discovered: PassStats | None  # the statistics of the last estimate's first pass, where it ran one of its own
    allocated_variance: float | None  # the gradient variance the last allocation predicts (None before one)

    def rounds(self, allocated: bool) -> int:
        """How many estimates one adaptation takes (``allocated``: an allocation was made before)."""

    def forward_begins(self, due: bool) -> None:
        """A training forward pass begins; ``due``: an adaptation is due when this step ends."""

    def ready(self, backprop: Callable[[], object] | None) -> bool:
        """Whether an adaptation that is due can run now, with ``backprop`` (``None``: no closure was given)."""

    def estimate(self, backprop: Callable[[], object] | None, step: int, progress: Progress) -> Estimate:
        """One estimate of every allocated tensor's sensitivity (the model left as it was)."""


def make_estimator(config: Config, model: nn.Module, path: PackPath, tracker: ModuleTracker) -> Estimator:
    """The estimator ``config.estimator`` names, with a meter of the storage choices where the level offers several
    schemes."""
    cls = ActnnEstimator if config.estimator == "actnn" else GactEstimator
    return cls(config, model, path, tracker)


class ActnnEstimator(Measuring):
    """ActNN's estimator, free: the training step before an adaptation (and the first) is read as it runs, by a
    collector of group ranges and output gradients (``free_sensitivity.py``); where no step collected (hooks installed
    after its forward began), the next step does, or one ordinary pass of a closure given to ``adapt()``."""

    def __init__(self, config: Config, model: nn.Module, path: PackPath, tracker: ModuleTracker) -> None:
        self.collector = FreeCollector(
            model, tracker, path.observers, config.group_size, watching=lambda: path.watching
        )
        super().__init__(config, model, path, tracker)
        self.pending = False  # an adaptation waits for a step that collects

    def _meter_armed(self) -> bool:
        return self.collector.armed

    def rounds(self, allocated: bool) -> int:
        return 1

    def forward_begins(self, due: bool) -> None:
        if due or self.pending:
            self.collector.arm()  # the step before an adaptation: read the free estimate
            if self.meter is not None:
                self.meter.clear()  # and measure the choices' errors again

    def ready(self, backprop: Callable[[], object] | None) -> bool:
        self.pending = not self.collector.collected and backprop is None
        return not self.pending

    def estimate(self, backprop: Callable[[], object] | None, step: int, progress: Progress) -> Estimate:
        return self._measured(free_estimate(self.model, self.collector, backprop))
