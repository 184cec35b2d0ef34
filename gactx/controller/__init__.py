"""Saved-tensor hooks, tensor identity, bits per tensor and memory accounting. Knows nothing of kernels' insides."""

from gactx.controller.adaptation import Adaptation, SlowAdaptationWarning
from gactx.controller.adaptation.choices import Choice
from gactx.controller.controller import Controller, Packed
from gactx.controller.decide import Decision, decide
from gactx.controller.identity import Key, Slot
from gactx.controller.plan import Plan
from gactx.controller.stats import KeyRecord, MemoryStats

__all__ = [
    "Adaptation", "Choice", "Controller", "Decision", "Key", "KeyRecord", "MemoryStats", "Packed", "Plan", "Slot",
    "SlowAdaptationWarning", "decide",
]  # fmt: skip
