"""The plan: all the pack path needs from the controller to store a save, as one immutable value.

The controller replaces the plan, and never changes one, when the step advances (the noise seeds), an adaptation
allocates (bits and schemes by slot), the sensitivity estimator perturbs a slot (the probe) or a state is loaded.
The pack path and the compiled path read the plan in place and call nothing back::

    bits, choice, probing = plan.width(slot)       # an allocated class's save (a Slot, or a compiled GraphSlot)
    seed = plan.seed(slot, key_id)                  # its noise
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from gactx.controller.adaptation.budget import default_width
from gactx.controller.adaptation.choices import Choice
from gactx.controller.adaptation.probe import Probe
from gactx.controller.identity import Slot

__all__ = ["GraphSlot", "Plan", "mix"]

MASK62 = (1 << 62) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio, odd
_EMPTY: Mapping = MappingProxyType({})


def mix(*values: int) -> int:
    """A stable 62-bit hash of integers (splitmix64 steps): a step's part of the noise seeds, and the sensitivity
    probes' seeds."""
    h = GOLDEN
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & MASK62


class GraphSlot(NamedTuple):
    """A save of a compiled graph, as the plan tells its width: the modules that made or used it (the compiled
    region's names, relative to it, innermost first), its shape (a dynamic size as the value it was traced with)
    and dtype."""

    modules: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Widths, schemes and seeds for the saves of one controller (see the module docstring).

    ``bits``: the level's width (``None`` at L0); ``adaptive``: whether ``allocation`` decides it per slot (a slot it
    has not seen gets ``default_width(bits)``); ``choices``: the slots the allocation stores in another scheme than
    uniform codes; ``probe``: what the sensitivity estimator perturbs now, by slot (one slot, or saves probed
    together); ``step`` and ``seed_base``: the
    training step and its part of every noise seed; ``compiled``: ``(module, shape, dtype, width)`` of each
    allocated eager save of the pass the allocation was made for, which compiled graphs take their widths from."""

    bits: int | None
    adaptive: bool = False
    allocation: Mapping[Slot, int] = dataclasses.field(default_factory=lambda: _EMPTY)
    choices: Mapping[Slot, Choice] = dataclasses.field(default_factory=lambda: _EMPTY)
    probe: Probe | Mapping[Slot, Probe] | None = None
    step: int = 0
    seed_base: int = 0
    compiled: tuple[tuple[str, tuple, torch.dtype, int], ...] | None = None
    exact: bool = False  # while probing: the slots not probed are stored as they are (sensitivity.EXACT_BASE)
    deferred: bool = False  # ... and an allocated class's saves are kept for each backward to probe (probes.py)

    def __post_init__(self) -> None:
        """``probe`` given as one :class:`Probe`, or a mutable mapping, is held as a read-only mapping by slot."""
        probe = self.probe
        if probe is not None and type(probe) is not MappingProxyType:
            probes = {probe.slot: probe} if isinstance(probe, Probe) else dict(probe)
            object.__setattr__(self, "probe", MappingProxyType(probes))

    @classmethod
    def initial(cls, bits: int | None, adaptive: bool, seed: int) -> Plan:
        return cls(bits, adaptive, seed_base=mix(seed, 0))

    def at_step(self, step: int, seed: int) -> Plan:
        """This plan at training step ``step`` (a copy with its step and seed base; once a step, so no
        ``dataclasses.replace``, which runs ``__init__`` and ``__post_init__`` again)."""
        plan = object.__new__(Plan)
        for name in Plan.__slots__:
            object.__setattr__(plan, name, getattr(self, name))
        object.__setattr__(plan, "step", step)
        object.__setattr__(plan, "seed_base", mix(seed, step))
        return plan

    def allocated(self, bits: Mapping[Slot, int], choices: Mapping[Slot, Choice], compiled=None) -> Plan:
        """This plan with a new allocation (copied: the plan's own, read-only)."""
        return dataclasses.replace(
            self, allocation=MappingProxyType(dict(bits)), choices=MappingProxyType(dict(choices)), compiled=compiled
        )

    def probing(self, probe: Probe | Mapping[Slot, Probe] | None, exact: bool = False, deferred: bool = False) -> Plan:
        """This plan perturbing one slot (a :class:`Probe`), several (probes by slot), or none; ``exact``: every slot
        it does not probe stored as it is (an empty mapping: every slot); ``deferred`` (with ``exact``): the saves of
        allocated classes kept for the probes of later backward passes (``probes.py``)."""
        exact = exact and probe is not None
        return dataclasses.replace(self, probe=probe, exact=exact, deferred=deferred and exact)

    def width(self, slot: Slot | GraphSlot) -> tuple[int | None, Choice | None, bool]:
        """``(bits, choice, probing)`` of an allocated class's save in ``slot``: the probe's while it perturbs the
        slot, else the allocation's (``choice`` ``None``: uniform codes). A compiled graph's save: the level's width,
        at adaptive levels :meth:`compiled_width`'s."""
        if type(slot) is GraphSlot:
            return self.compiled_width(slot.modules, slot.shape, slot.dtype), None, False
        probe = self.probe.get(slot) if self.probe is not None else None
        if probe is not None:
            return probe.bits, probe.choice, True
        choice = self.choices.get(slot) if self.choices else None
        if not self.adaptive:
            return self.bits, choice, False
        return self.allocation.get(slot, default_width(self.bits)), choice, False

    def seed(self, slot: Slot, key_id: int) -> int:
        """The noise seed of the save numbered ``key_id`` (by the pack path, first seen first) in ``slot``: the probe's
        while it perturbs the slot, else a Weyl sequence from the step's hash (distinct seeds, which the kernels' own
        hash decorrelates)."""
        probe = self.probe.get(slot) if self.probe is not None else None
        if probe is not None:
            return probe.seed
        return (self.seed_base + (key_id + 1) * GOLDEN) & MASK62

    def compiled_width(self, modules: tuple[str, ...], shape: tuple, dtype: torch.dtype) -> int | None:
        """The width of a quantized save of a compiled graph: the level's; at adaptive levels the widest the
        allocation gave an eager save of the same shape and dtype in one of ``modules`` (the compiled region's
        names, relative to it), else the default width."""
        if not self.adaptive or self.compiled is None:
            return self.bits
        widths = [
            width
            for module, s, d, width in self.compiled
            if s == shape and d == dtype and any(module == m or (m and module.endswith("." + m)) for m in modules)
        ]
        return max(widths, default=default_width(self.bits))
