"""Saved-tensor hooks, tensor identity, bits per tensor and memory accounting. Knows nothing of kernels' insides."""

from gactx.controller.adaptation import Adaptation
from gactx.controller.choices import Choice
from gactx.controller.controller import Controller, Packed
from gactx.controller.identity import Key
from gactx.controller.plan import Plan
from gactx.controller.stats import KeyRecord, MemoryStats

__all__ = ["Adaptation", "Choice", "Controller", "Key", "KeyRecord", "MemoryStats", "Packed", "Plan"]
