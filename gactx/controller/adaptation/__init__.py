"""Adaptive bits: the sensitivity estimators (``estimators.py``, behind one protocol: GACT's, ``gact_estimator.py``
over ``sensitivity.py``, whose passes (``passes.py``) measure tensors whose noise lands apart in the same ones,
``groups.py``, and replay the closure's backward, ``replayed.py`` (an embedding's gradient as its rows, ``rows.py``),
its probes' forms read from the training pass's records, ``trained.py``; ActNN's, ``free_sensitivity.py``; what both
hold, ``measuring.py``), the storage choices a tensor may be offered and
their measured errors (``choices.py``), the variance model of a width (``widths.py``), the allocator under a budget
(``allocator.py``) and one adaptation's plan from an estimate (``budget.py``), what an adaptation costs against
training (``cost.py``) and when adaptations run (``schedule.py``); ``ranks.py`` keeps the ranks of
``torch.distributed`` agreeing.

The controller imports ``estimators`` itself: it reads the pack path's plan, which reads this package's widths.
"""

from gactx.controller.adaptation.budget import (
    NOISE_CEILING,
    Adaptation,
    allocate_estimate,
    default_width,
    noise_floor,
    plan,
    reduce_across_ranks,
)
from gactx.controller.adaptation.cost import SlowAdaptationWarning

__all__ = [
    "NOISE_CEILING", "Adaptation", "SlowAdaptationWarning", "allocate_estimate", "default_width", "noise_floor", "plan",
    "reduce_across_ranks",
]  # fmt: skip
