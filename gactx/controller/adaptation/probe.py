"""What the sensitivity estimator perturbs in a pass (``sensitivity.py``), as the plan holds it (``plan.py``)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["Probe"]


@dataclass(frozen=True)
class Probe:
    """Quantize the tensor of ``slot`` at ``bits`` with ``seed`` (other tensors as usual); ``choice``: store it
    under that storage choice instead (``choices.py``), to measure what the choice itself does to the gradient."""

    slot: Hashable
    bits: int
    seed: int
    choice: object = None
