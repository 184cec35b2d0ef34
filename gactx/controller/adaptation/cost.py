"""What an adaptation costs against training: the training step's wall time, the share of training an adaptation takes
at the adaptation interval, and a warning where it takes long enough for a user to wonder why a step stalled.

A training step is the time between two calls of ``Controller.iterate()`` (forward, backward, the optimizer, the data),
adaptations left out. Its figure is the median of the last :data:`WINDOW` steps: the first step of a run (a compile,
the op watcher's pass) is no typical one. Before the second ``iterate()`` the only step there is the first, from
installation to that call: the first adaptation's share is read against it and says so.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
import warnings

from gactx.config import _caller_level
from gactx.controller.stats import format_bytes

__all__ = [
    "SLOW_SECONDS",
    "SlowAdaptationWarning",
    "StepClock",
    "announce",
    "parts_text",
    "report_line",
    "share",
    "summed",
]

SLOW_SECONDS = 5.0  # an adaptation that takes longer warns (a Python warning: seen without configuring logging)
WINDOW = 100  # steps whose median is the step time
logger = logging.getLogger(__name__)


class SlowAdaptationWarning(UserWarning):
    """An adaptation took longer than :data:`SLOW_SECONDS`: no error, training goes on. Issued at the first frame
    outside gactx (the line that called ``iterate()``, ``adapt()``, or a training library that called them), it says
    what makes adaptations cheaper. Silence it with
    ``warnings.filterwarnings("ignore", category=gactx.SlowAdaptationWarning)``."""


class StepClock:
    """The wall time of training steps: from one ``tick()`` (``iterate()``) to the next, adaptations left out."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._steps: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def start(self) -> None:
        """Training begins (the controller is installed): the first step is timed from here."""
        if self._last is None:
            self._last = time.perf_counter()

    def tick(self) -> None:
        """A step ended (``iterate()``)."""
        now = time.perf_counter()
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now

    def resume(self) -> None:
        """An adaptation ended: the next step is timed from now, not from before it."""
        self._last = time.perf_counter()

    @property
    def first_only(self) -> bool:
        """Whether the step time is the first step's alone (from installation to the first ``iterate()``)."""
        return len(self._steps) <= 1

    @property
    def seconds(self) -> float | None:
        """The median step of the last :data:`WINDOW` (``None`` before the first step ended)."""
        return statistics.median(self._steps) if self._steps else None


def share(seconds: float, step_seconds: float | None, interval: int) -> float | None:
    """The share of training an adaptation of ``seconds`` takes when one runs every ``interval`` steps of
    ``step_seconds``: ``seconds / (seconds + interval * step_seconds)``."""
    if step_seconds is None:
        return None
    return seconds / (seconds + interval * step_seconds) if seconds > 0 else 0.0


def describe(adaptation, interval: int, first_only: bool) -> str:
    """One line: what the adaptation cost and its share of training."""
    a = adaptation
    text = f"gactx adaptation at step {a.step}: {a.passes} passes of the closure, {a.seconds:.1f} s"
    if a.share is not None:
        base = "the first step" if first_only else "the median step"
        text += (
            f", {100 * a.share:.1f}% of training at one adaptation every {interval} steps of {a.step_seconds:.3g} s "
            f"({base})"
        )
    return text


def summed(tables: list[dict]) -> dict:
    """Several estimates' ``part -> (measurements, passes)`` tables (``Estimate.parts``) added up, parts in the order
    they first came."""
    out: dict[str, tuple[int, int]] = {}
    for table in tables:
        for part, (measurements, passes) in table.items():
            had = out.get(part, (0, 0))
            out[part] = (had[0] + measurements, had[1] + passes)
    return out


def parts_text(parts: dict) -> str:
    """``Adaptation.passes_by_part`` in words: ``"2 discovery, 9 for 20 linear inputs together, ..."``."""
    return ", ".join(f"{p} for {m} {name}" if m else f"{p} {name}" for name, (m, p) in parts.items())


def report_line(adaptation, config) -> str:
    """``Controller.report()``'s line on the last adaptation: its cost and share, and the bytes it allocated against
    the budget ``config`` sets."""
    a = adaptation
    share = "" if a.share is None else f" ({100 * a.share:.1f}% of training at one every {a.interval} steps)"
    basis = (f"budget={config.budget!r}, less what is kept or stored at a fixed width" if config.budget is not None
             else f"{config.bits:g} bits an element of what plain PyTorch saves, each storage once, and the groups' "
             "metadata")  # fmt: skip
    return (
        f"last adaptation at step {a.step}: {a.passes} passes of the closure"
        + (f" ({parts_text(a.passes_by_part)})" if a.passes_by_part else "")
        + (f", {a.partial_passes} of them from the probed nodes down" if a.partial_passes else "")
        + f", {a.seconds:.2f} s{share}; "
        f"{a.allocated_bytes} of {max(0, a.budget_bytes)} bytes allowed for compressed tensors ({basis})"
        + ("" if a.feasible else " (budget not met: narrowest widths)")
    )


def announce(adaptation, interval: int, first_only: bool) -> None:
    """Log what ``adaptation`` cost and allocated (INFO), and where it took longer than :data:`SLOW_SECONDS`, say so
    with a :class:`SlowAdaptationWarning`."""
    a = adaptation
    logger.info(
        "%s; %s allocated of a %s budget%s", describe(a, interval, first_only), format_bytes(a.allocated_bytes),
        format_bytes(max(0, a.budget_bytes)), "" if a.feasible else " (not met: the narrowest widths)",
    )  # fmt: skip
    if a.seconds < SLOW_SECONDS:
        return
    warnings.warn(
        describe(adaptation, interval, first_only) + ". Not an error: training goes on with the new widths. The "
        "time grows with the number of compressed tensors (GACT's estimator: a pass each, two a normalization input's "
        "first, one for all the inputs of linear and convolution layers; tensors whose noise was seen to land apart "
        "share passes). To spend less: give iterate() a closure on a smaller batch, raise adapt_interval, or use "
        "estimator='actnn' (measured in the training step itself) (docs/adaptive.md#slow-adaptations). To silence it: "
        "warnings.filterwarnings('ignore', category=gactx.SlowAdaptationWarning)",
        SlowAdaptationWarning,
        stacklevel=_caller_level(),
    )
