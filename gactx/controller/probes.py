"""Saves that one forward keeps for several probes: the sensitivity estimator's backward replays.

Against the exact base (``adaptation/sensitivity.py``) a probe pass differs from the base only in what one tensor (or a
group) stores, and only backward reads what a save stores. Where the estimator can replay the closure's backward calls
(``sensitivity.Replayed``), it runs the closure's forward once, under a plan that defers (``Plan.deferred``): every save
of an allocated class is kept as it is in a :class:`Deferred` handle, and each backward stores and decodes it at unpack,
as the probe then in force says, where that probe perturbs its slot (or the slot whose stored values it shares in
training, ``Sites.sharers``): the same encoding, width, scheme and seed as a forward under that probe would have
stored, so one forward serves every probe. Elsewhere the handle gives the tensor back as it is. Each unpack is told
to the path's ``unpacked`` where one is set: which backward nodes read a slot (``adaptation/replayed.py``).
"""

from __future__ import annotations

import torch

from gactx.controller.decide import Decision, may_share
from gactx.controller.identity import Key, Slot, in_backward
from gactx.controller.rules import LINEAR, Rule
from gactx.controller.store import Kept, Packed, encode

__all__ = ["Deferred", "Waiting"]


class Deferred(Kept):
    """A save of a deferring forward (the module docstring): kept as it is, except in a backward whose probe perturbs
    ``target`` (its own slot, or the slot whose stored values it shares in training). A :class:`Kept`, so that the
    unpack hook takes it as one."""

    __slots__ = ("target", "path", "site", "packed", "rule", "forward")

    def __init__(self, t: torch.Tensor, key: Key, target: Slot, path, site, ptr: int, rule: Rule) -> None:
        super().__init__(t.detach(), t._version)  # an alias of its own: ``t`` lives on only where others hold it
        self.target, self.path, self.site = target, path, site
        # A later save of what ``target`` stores shares a probe's codes only where a forward under that probe would
        # share them (decide.may_share: not an attention class below its floor); ``None`` for the target's own save.
        self.rule = None if target == key.slot else rule
        # What a probe stores goes through a handle of the whole path: a tensor alive elsewhere (a batch the caller
        # holds) is read from where it lives, as training reads it.
        self.packed = Packed(None, key, t, path.config.backend, ptr)
        self.forward = not in_backward()  # made by the closure's forward, not by a recomputation inside backward

    def unpack(self) -> torch.Tensor:
        if self.path.unpacked is not None:
            self.path.unpacked(self.target, self.forward)
        probes = self.path.plan.probe
        probe = probes.get(self.target) if probes else None
        if probe is None or self.rule is not None and not may_share(Decision(LINEAR, probe.bits, probe.choice),
                                                                     Decision(self.rule), self.site):  # fmt: skip
            return super().unpack()
        cfg = self.path.config
        self.packed.stored = encode(
            self.tensor, LINEAR, probe.bits, probe.seed, cfg.group_size, cfg.stochastic, cfg.backend, probe.choice,
            self.site,
        )  # fmt: skip
        out, self.packed.stored = self.packed.unpack(), None  # the codes live only while this backward reads them
        return out


class Waiting:
    """A deferred save of a watched pass, waiting for its op (``watch.py`` reads the tensor as ``stored``; the pack path
    learns the op's site and rule into the :class:`Deferred` it returned for the save)."""

    __slots__ = ("stored", "deferred")

    def __init__(self, stored: torch.Tensor, deferred: Deferred) -> None:
        self.stored, self.deferred = stored, deferred
