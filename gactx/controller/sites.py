"""What the pack path knows of each slot's op: learned in watched passes, recalled in the others.

A watched pass (``watch.py``) tells the pack path which op saved each tensor and in which role (its
:class:`~gactx.controller.rules.Site`), and so its :class:`~gactx.controller.rules.Rule`. :class:`Sites` keeps that by
slot, with the signature of the tensor saved there (dtype, rank, the node that made it), and gives it back for the
slot's saves in unwatched passes while the signature holds. It also keeps which later saves shared what a first save
stored (the pack path's dedupe: the Q, K and V projections of one input), which the estimators read: a slot is
sketchable, or read by backward only for weights' gradients, only if every save that shares it is.
"""

from __future__ import annotations

import torch

from gactx.controller.identity import Key, Slot
from gactx.controller.rules import PROVENANCE, UNKNOWN, Rule, Site, curved, rule_for, sketchable, weight_only

__all__ = ["Sites", "rule_of", "signature"]

# Under a dispatch mode, composite ops (matmul) reach the same tensor through another kind of view.
_VIEWS = {"ViewBackward0": "view", "ReshapeAliasBackward0": "view", "UnsafeViewBackward0": "view"}


def rule_of(site: Site, origin: str | None) -> Rule:
    """The rule of a save a watched pass found at ``site``, or made by a known provenance (``origin``: watch.py)."""
    if origin is not None:
        return PROVENANCE[origin]
    return UNKNOWN if site.op == "?" else rule_for(site)


def signature(t: torch.Tensor) -> tuple:
    """What a slot's save must still look like for a learned op to apply: dtype, rank and the node that made
    the tensor (for a saved result, its own op's node), so that another branch through the same module
    (tanh where a dropout mask was) is not taken for what was learned."""
    fn = t.grad_fn
    name = None if fn is None else type(fn).__name__
    return (t.dtype, t.dim(), _VIEWS.get(name, name))


class Sites:
    """The learned op of each slot, and the sharers of each first save (see the module docstring)."""

    def __init__(self) -> None:
        self.learned: dict[Slot, tuple[Site, str | None, tuple, Rule]] = {}  # slot -> (site, origin, signature, rule)
        self._calls: dict[tuple, dict] = {}  # (module, call) -> {index: what learned holds}: a call's learned saves
        # slot of a first save -> {slot of a later save that shared what it stored: that save's site}
        self.sharers: dict[Slot, dict[Slot, Site | None]] = {}

    def __len__(self) -> int:
        return len(self.learned)

    def learn(self, t: torch.Tensor, slot: Slot, site: Site, origin: str | None, rule: Rule) -> None:
        """The op of ``slot``'s save ``t``, as a watched pass told it."""
        self.learned[slot] = learned = (site, origin, signature(t), rule)
        self._calls.setdefault(slot[:2], {})[slot.index] = learned

    def recall(self, t: torch.Tensor, key: Key, slot: Slot) -> tuple[Site, Rule, bool] | None:
        """The site and rule learned for the save ``t`` of ``slot`` (``key``), and whether they were learned for the
        slot itself; ``None`` where nothing learned fits it."""
        learned, sig = self.learned.get(slot), signature(t)
        if learned is not None and learned[2] == sig:
            return learned[0], learned[3], True
        # A watched pass may number a module call's saves apart from an unwatched one: under the watcher a composite
        # op (the CTC loss) saves copies of its integer arguments that it does not save otherwise, and the saves after
        # them shift. The one save of this call learned with the same signature, if there is exactly one, is this.
        alike = [v for v in self._calls.get((key.module, key.call), {}).values() if v[2] == sig]
        if len(alike) == 1:
            return alike[0][0], alike[0][3], False
        return None

    def share(self, first: Slot, slot: Slot, site: Site | None) -> None:
        """The save of ``slot`` (at ``site``) shared what the save of ``first`` stored."""
        self.sharers.setdefault(first, {})[slot] = site

    def target(self, slot: Slot) -> Slot:
        """The slot whose probe a deferred save of ``slot`` follows: the first save of what it stores (sharers)."""
        return next((first for first, later in self.sharers.items() if slot in later), slot)

    def sketchable(self, slot: Slot) -> bool:
        """Whether the save of ``slot`` may be stored as a row sketch: the input of a linear layer, as its op was
        learned, and so is every later save that shares what it stores (the other projections of one input)."""
        learned = self.learned.get(slot)
        sharers = self.sharers.get(slot, {}).values()
        return learned is not None and all(s is not None and sketchable(s) for s in (learned[0], *sharers))

    def weight_only(self, slot: Slot) -> bool:
        """Whether backward reads the save of ``slot`` only for weights' gradients (``rules.weight_only``), as its op
        was learned, and so every later save that shares what it stores."""
        learned = self.learned.get(slot)
        sharers = self.sharers.get(slot, {}).values()
        return learned is not None and all(s is not None and weight_only(s) for s in (learned[0], *sharers))

    def curved(self, slot: Slot) -> bool:
        """Whether the save of ``slot`` is a normalisation's input, as its op was learned (``rules.curved``)."""
        learned = self.learned.get(slot)
        return learned is not None and curved(learned[0])
