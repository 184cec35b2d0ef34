"""Saved-tensor hooks, tensor identity, bits per tensor and memory accounting. Knows nothing of kernels' insides."""

from gactx.controller.controller import Controller, Packed
from gactx.controller.identity import Key
from gactx.controller.stats import MemoryStats

__all__ = ["Controller", "Key", "MemoryStats", "Packed"]
