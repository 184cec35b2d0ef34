"""What both sensitivity estimators hold (``estimators.py``, ``gact_estimator.py``): the model, the pack path they reach
the saves through, and the storage choices' meter."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from gactx.config import Config
from gactx.controller.adaptation.choices import ChoiceMeter
from gactx.controller.adaptation.sensitivity import Estimate
from gactx.controller.identity import ModuleTracker
from gactx.controller.stats import PassStats

if TYPE_CHECKING:
    from gactx.controller.pack import PackPath

__all__ = ["Measuring", "Progress"]

Progress = Callable[[int, int], None]  # told the passes run so far and those the estimate plans so far


class Measuring:
    """What both estimators hold: the model, the pack path they reach the saves through, and the choices' meter."""

    def __init__(self, config: Config, model: nn.Module, path: PackPath, tracker: ModuleTracker) -> None:
        self.config, self.model, self.path, self.tracker = config, model, path, tracker
        self.meter: ChoiceMeter | None = None
        self.discovered: PassStats | None = None
        self.allocated_variance: float | None = None
        if config.adaptive and len(config.schemes) > 1:
            self.meter = ChoiceMeter(config.schemes, config.group_size, path.sites.sketchable, self._meter_armed)
            path.observers.append(self.meter)

    def _meter_armed(self) -> bool:
        return False

    def _measured(self, estimate: Estimate) -> Estimate:
        """``estimate`` with what the meter measured since it was last read."""
        return dataclasses.replace(estimate, measured=self.meter.read() if self.meter is not None else {})
