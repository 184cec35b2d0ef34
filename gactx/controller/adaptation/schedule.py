"""When adaptations run: after the first step, then every ``adapt_interval`` steps, less often while they change
nothing.

An adaptation costs the same however often it runs (GACT's estimator: a pass or two of the closure a compressed
tensor), so what it costs training is set by how often it runs. Sensitivities move most early in training; later an
adaptation mostly finds the allocation it already had. Each adaptation prices the allocation it replaces under its own
estimate (``Allocation.kept_variance``): where that is within :data:`STABLE_VARIANCE` of the new allocation's
predicted variance (and fits the budget), keeping the old one would have cost the gradient little, and the interval to
the next adaptation doubles, up to ``adapt_backoff`` times ``adapt_interval``. An adaptation that finds more to gain
brings the interval back to ``adapt_interval``. Adaptations stay on multiples of ``adapt_interval``: with 1000 and
a stable allocation, at steps 1, 1000, 3000, 7000, 15000, 23000, ... (``adapt_backoff=8``).

Why a variance and not the widths: near the budget, allocations of almost equal variance can differ in many tensors
(the character transformer's swapped normal-fitted and uniform codes on 14 of 23 tensors between two adaptations
50 steps apart, and back at the next, each allocation within 1% to 7% of the other's variance), so a count of changed
widths says little about what re-allocating gained.
"""

from __future__ import annotations

__all__ = ["STABLE_VARIANCE", "Schedule", "stable"]

# An adaptation is stable where the allocation before it, priced under its estimate, has at most this much more
# predicted gradient variance than the allocation it makes (0.1: 10% more).
STABLE_VARIANCE = 0.1


def stable(variance: float, kept_variance: float | None) -> bool:
    """Whether keeping the allocation before (``kept_variance``, None where it could not be kept) would have added at
    most :data:`STABLE_VARIANCE` of the new allocation's ``variance``."""
    return kept_variance is not None and kept_variance <= (1 + STABLE_VARIANCE) * variance


class Schedule:
    """The steps at which ``Controller.iterate()`` adapts (the module docstring). ``base``: ``adapt_interval``;
    ``backoff``: ``adapt_backoff`` (1: every ``base`` steps)."""

    def __init__(self, base: int, backoff: int) -> None:
        self.base, self.backoff = base, backoff
        self.interval = base  # steps to the next adaptation, from the multiple of ``base`` the last one ran at
        self.next = base  # the next step an adaptation is due at

    def due(self, step: int) -> bool:
        """Whether an adaptation is due when ``iterate()`` ends step ``step``."""
        return step == 1 or (step % self.base == 0 and step >= self.next)

    def adapted(self, step: int, is_stable: bool) -> None:
        """An adaptation ran at ``step``: the interval doubles (to ``backoff * base`` at most) if it was stable, else
        it is ``base`` again; the next is due that many steps after the last multiple of ``base``."""
        self.interval = min(2 * self.interval, self.backoff * self.base) if is_stable else self.base
        self.next = step - step % self.base + self.interval

    def state(self) -> list[int]:
        return [self.interval, self.next]

    def load(self, state: list[int] | None) -> None:
        """A :meth:`state` (``None``: start again at ``base``)."""
        self.interval, self.next = (self.base, self.base) if state is None else (int(state[0]), int(state[1]))
